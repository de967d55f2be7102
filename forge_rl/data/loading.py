"""Opening `DataConfig.path` as one split of a memory-mapped Hugging Face dataset, with a
ConfigError naming the path, what was found and the fix for every way it can fail.

What a path may be, in the order it is tried:
- an existing file: .jsonl / .json (JSON lines or one JSON array), .parquet, .csv or .arrow, read by
  `datasets`' builder of that format into its Arrow cache; its one split is "train";
- a directory written by `Dataset.save_to_disk` (one split, "train") or `DatasetDict.save_to_disk`
  (its splits by name), memory-mapped where it lies;
- any other existing directory: its data files, in one format, with splits named by file names as
  `datasets` names them (train.jsonl, test.jsonl, data/train-*.parquet; else all "train");
- otherwise a Hugging Face hub name ("org/name"), loaded from the hub where this machine reaches
  it, and refused without a connection attempt when HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import datasets
import pyarrow

from forge_rl.errors import ConfigError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it."""
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
_KNOWN = "a JSONL, JSON, Parquet, CSV or Arrow file, a directory of them, or a directory written by save_to_disk"


def open_dataset(path: str, split: str, cache_dir: str | None = None) -> datasets.Dataset:
    """Split `split` of the data at `path`, memory-mapped (never loaded into memory): files are
    converted once into `datasets`' Arrow cache (`cache_dir`, default HF_DATASETS_CACHE)."""
    local = Path(path).expanduser()
    if local.is_file():
        splits = _load_file(local, cache_dir)
    elif local.is_dir():
        splits = _load_directory(local, cache_dir)
    else:
        splits = _load_hub(path, local, cache_dir)
    dataset = _pick_split(splits, split, path)
    # Converting a file leaves freed Arrow buffers in the allocator's pool; hand them back so a
    # long-lived controller's memory holds only what it uses (the rows themselves stay on disk).
    pyarrow.default_memory_pool().release_unused()
    return dataset


def _load_file(file: Path, cache_dir: str | None) -> datasets.DatasetDict:
    builder = FORMATS.get(file.suffix.lower())
    if builder is None:
        raise ConfigError(
            f"data.path ({str(file)!r}) has suffix {file.suffix or '(none)'!r}, which is no format forge_rl "
            f"reads: it reads {', '.join(sorted(FORMATS))}. Convert the file (e.g. to JSONL, one JSON object a "
            "line), or rename it if it already is one of these formats, and set --data.path."
        )
    return _read(builder, f"data.path ({str(file)!r})", file, cache_dir, data_files=str(file))


def _load_directory(directory: Path, cache_dir: str | None) -> datasets.DatasetDict | datasets.Dataset:
    if (directory / "dataset_dict.json").is_file() or (directory / "state.json").is_file():
        try:
            return datasets.load_from_disk(str(directory), keep_in_memory=False)
        except Exception as error:
            raise ConfigError(
                f"data.path ({str(directory)!r}) looks like a directory written by save_to_disk but does not "
                f"load: {type(error).__name__}: {error}. Write it again with Dataset.save_to_disk, or point "
                "--data.path at the data files themselves."
            ) from error
    files = [f for f in sorted(directory.rglob("*")) if f.is_file() and not _hidden(f.relative_to(directory))]
    builders = {FORMATS[f.suffix.lower()] for f in files if f.suffix.lower() in FORMATS}
    if not builders:
        found = ", ".join(str(f.relative_to(directory)) for f in files[:5]) or "nothing"
        raise ConfigError(
            f"data.path ({str(directory)!r}) is a directory with no data files ({', '.join(sorted(FORMATS))}) "
            f"and was not written by save_to_disk; it holds {found}{' ...' if len(files) > 5 else ''}. Point "
            f"--data.path at {_KNOWN}."
        )
    if len(builders) > 1:
        raise ConfigError(
            f"data.path ({str(directory)!r}) holds data files of several formats ({', '.join(sorted(builders))}); "
            "one directory must hold one format. Move the files of the other formats out, or point --data.path "
            "at one file."
        )
    return _read(str(directory), f"data.path ({str(directory)!r})", directory, cache_dir)


def _load_hub(name: str, local: Path, cache_dir: str | None) -> datasets.DatasetDict:
    if not _HUB_NAME.fullmatch(name) or local.suffix.lower() in FORMATS:
        raise ConfigError(
            f"data.path ({name!r}): no file or directory exists at {str(local.resolve())!r}. Check the path "
            f"(relative paths start from {os.getcwd()!r}) and set --data.path to {_KNOWN}."
        )
    offline = [variable for variable in _OFFLINE_VARIABLES if _is_true(os.environ.get(variable))]
    if offline or datasets.config.HF_HUB_OFFLINE:
        set_by = ", ".join(f"{variable}={os.environ[variable]}" for variable in offline) or "datasets.config"
        raise ConfigError(
            f"data.path ({name!r}) is no local file or directory (none exists at {str(local.resolve())!r}), and "
            f"read as a Hugging Face hub dataset it needs the network, which this machine is told not to use "
            f"({set_by}). On a machine with network, run "
            f"`datasets.load_dataset({name!r}).save_to_disk(DIR)` and set --data.path DIR here; or, where the "
            "hub is reachable, unset the offline variable."
        )
    absent = str(local.resolve())
    shown = f"data.path ({name!r}, read as a Hugging Face hub name: no file or directory exists at {absent!r})"
    return _read(name, shown, local, cache_dir)


def _read(
    builder: str, shown: str, local: Path, cache_dir: str | None, data_files: str | None = None
) -> datasets.DatasetDict:
    """`datasets.load_dataset`, its failures turned into a ConfigError that opens with `shown`."""
    try:
        return datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir, keep_in_memory=False)
    except Exception as error:  # datasets and pyarrow raise many types (even StopIteration on an empty file)
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        hint = " It holds no rows: add rows or point --data.path at other data." if _holds_no_rows(local) else ""
        raise ConfigError(
            f"{shown} could not be read by datasets ({detail}).{hint} Fix the data (each JSONL "
            f"line one JSON object, each CSV row as many fields as the header) or set --data.path to {_KNOWN}."
        ) from error


def _pick_split(splits: datasets.DatasetDict | datasets.Dataset, split: str, path: str) -> datasets.Dataset:
    if isinstance(splits, datasets.Dataset):
        splits = datasets.DatasetDict({"train": splits})
    if split not in splits:
        raise ConfigError(
            f"data.split ({split!r}) is not a split of data.path ({path!r}); its splits are: "
            f"{', '.join(map(repr, splits))} (a single file, or a directory written by Dataset.save_to_disk, "
            "holds one split, 'train'). Set --data.split to one of them."
        )
    return splits[split]


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "_")) for part in relative.parts)


def _holds_no_rows(local: Path) -> bool:
    """Whether the data files at `local` hold no rows (each empty, a CSV only its header, a JSON
    file an empty array); read only on a way to an error, and only as far as a second line."""
    files = [local] if local.is_file() else [f for f in local.rglob("*") if f.suffix.lower() in FORMATS]
    return bool(files) and all(_file_holds_no_rows(file) for file in files)


def _file_holds_no_rows(file: Path) -> bool:
    header_lines = 1 if file.suffix.lower() == ".csv" else 0
    with file.open("rb") as stream:
        lines = []
        for line in stream:
            if line.strip():
                lines.append(line.strip())
            if len(lines) > header_lines:
                break
    return len(lines) <= header_lines or (file.suffix.lower() == ".json" and lines == [b"[]"])


def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().upper() in {"1", "ON", "YES", "TRUE"}
