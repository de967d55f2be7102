"""Hugging Face model directories on disk: read their safetensors, write a trained policy back.

A directory holds either one `model.safetensors` or shards named in `model.safetensors.index.json`
(`weight_map`: parameter name -> shard file), as `save_pretrained` writes them. `export_hf_model_dir`
writes the same layout, plus the source directory's config, generation config and tokenizer files,
so `transformers.AutoModelForCausalLM.from_pretrained` and vLLM load the result unchanged.

No TorchTitan here: these are plain HF names and tensors (TorchTitan's adapters rename them).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only for annotations: config validation reads weight_files without it
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Everything a tokenizer or a generation default may live in; copied when present. Chat templates
# sit in tokenizer_config.json (transformers < 5) or chat_template.jinja / .json (transformers 5).
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
COPIED_DIRS = ("additional_chat_templates",)
"""transformers 5 keeps named chat templates beside the default, one .jinja file each."""
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""5 GB shards, the size of the hub's big checkpoints (transformers 4's save_pretrained default;
transformers 5 writes up to 50 GB): small files resume and stream better."""


def weight_files(model_dir: Path | str) -> list[Path]:
    """The safetensors files of `model_dir`: the shards its index names, else model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}.")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(
        f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}: the trainer needs a Hugging Face "
        "model directory written by save_pretrained (safetensors weights)."
    )


def load_hf_state_dict(model_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors file(s), by HF parameter name, on CPU."""
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        state_dict.update(load_file(path))
    return state_dict


def _shards(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most max_shard_bytes each (a bigger tensor goes alone),
    the rule save_pretrained follows, so layers stay together in file order."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write_weights(state_dict: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    # safetensors refuses views of shared or strided storage; tied weights are already one entry.
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
    shards = _shards(tensors, max_shard_bytes)
    # {"format": "pt"} is what transformers checks to accept a safetensors file as PyTorch weights.
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_config(source_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """config.json of the source with its dtype set to the exported tensors' dtype (vLLM's and
    transformers' "auto" dtype read it)."""
    config = json.loads((source_dir / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    # transformers 5 writes "dtype", older versions "torch_dtype"; update whichever is there.
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    config.update(dict.fromkeys(keys, dtype_name))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_hf_model_dir(
    hf_state_dict: dict[str, torch.Tensor],
    source_model_dir: Path | str,
    out_dir: Path | str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `hf_state_dict` (HF names, e.g. `PolicyTrainer.hf_state_dict()`) as an HF model directory.

    config.json comes from `source_model_dir` (dtype updated); generation config and tokenizer
    files are copied from it. Weights go to model.safetensors, or to
    model-0000i-of-0000n.safetensors shards plus model.safetensors.index.json when they exceed
    `max_shard_bytes`. The directory is assembled beside `out_dir` and renamed into place, so
    `out_dir` never holds a partial export. Returns `out_dir`.
    """
    source_dir, out_dir = Path(source_model_dir), Path(out_dir)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes ({max_shard_bytes}) must be >= 1.")
    if not hf_state_dict:
        raise ValueError("hf_state_dict is empty: nothing to export.")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; export into a new directory.")
    dtypes = {t.dtype for t in hf_state_dict.values()}
    if len(dtypes) != 1:
        raise ValueError(f"hf_state_dict mixes dtypes {sorted(map(str, dtypes))}; export one dtype.")
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _write_weights(hf_state_dict, partial, max_shard_bytes)
    _write_config(source_dir, partial, dtypes.pop())
    for name in COPIED_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, partial / name)
    for name in COPIED_DIRS:
        if (source_dir / name).is_dir():
            shutil.copytree(source_dir / name, partial / name)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above); os.replace cannot replace a directory on every OS
    os.replace(partial, out_dir)
    return out_dir
