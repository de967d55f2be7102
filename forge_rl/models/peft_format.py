"""TorchTitan adapters as a PEFT LoRA adapter directory: what `peft` and vLLM's LoRA support load.

    adapter_state_dict()                       PEFT adapter directory
    "layers.3.attention.qkv_linear.wqkv.lora_A"  ─▶ "base_model.model.model.layers.3.self_attn.{q,k,v}_proj.lora_A.weight"
    "layers.3.attention.qkv_linear.wqkv.lora_B"  ─▶ "...{q,k,v}_proj.lora_B.weight"   (rows of B, split)
    "layers.3.feed_forward.w1.lora_A" / _B       ─▶ "...mlp.gate_proj.lora_A.weight" / lora_B.weight
    "lm_head.lora_A" / _B                        ─▶ "base_model.model.lm_head.lora_A.weight" / ...
    + adapter_config.json {peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path}

Why rows of B and nothing else: LoRA adds scaling * B A to a weight W [out, in]. TorchTitan's
fused `wqkv` is HF's q_proj, k_proj and v_proj stacked by rows (interleaved per KV group), and the
llama3 converter also permutes q and k rows (RoPE layout); both are maps of output rows only. A
row map T gives T(W + s B A) = T(W) + s T(B) A: every HF projection keeps A (shared by q, k, v)
and takes its own rows of B. The row maps are not re-derived here: `row_maps` pushes row indices
through TorchTitan's own split of `wqkv` and its own HF converter, so they are the exact maps
forge_rl's full-weight export uses (tested against it in tests/unit/models/test_peft_format.py). The
unembedding, `lm_head` in both namings, is copied as is by both families' converters; with tied
embeddings PEFT and vLLM add its adapter to the logits alone, as the trainer does.

Pure functions over tensors and config.json; no vLLM, no peft (only the test imports peft).
"""

from __future__ import annotations

import functools
import json
import re
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

from forge_rl.models.lora import LoRAConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # PEFT's prefix: PeftModel -> LoraModel -> the HF model
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_FUSED_QKV = "attention.qkv_linear.wqkv"
_UNEMBED = "lm_head"  # TorchTitan's and HF's name of the unembedding, outside the blocks


def row_maps(hf_config: dict) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """See `_row_maps`; computed once per config (the trainer converts at every version)."""
    return _row_maps(json.dumps(hf_config, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _row_maps(hf_config_json: str) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """For each TorchTitan linear layer of a transformer block (name after "layers.N."), the HF
    modules it becomes (name after "model.layers.N.") and, for each, which of its output rows
    that module's rows are: HF weight = TorchTitan weight[rows].

    Computed once for layer 0 (every block of a dense family is alike) by running integer row
    indices through TorchTitan's `wqkv` split and the family's HF converter.
    """
    from torchtitan.models.common.attention import FusedQKVLinear

    from forge_rl.models.titan import state_dict_adapter

    hf_config = json.loads(hf_config_json)
    adapter = state_dict_adapter(hf_config)
    dim, hidden = hf_config["hidden_size"], hf_config["intermediate_size"]
    n_heads = hf_config["num_attention_heads"]
    n_kv = hf_config.get("num_key_value_heads") or n_heads
    head_dim = hf_config.get("head_dim") or dim // n_heads
    shapes = {
        _FUSED_QKV: ((n_heads + 2 * n_kv) * head_dim, dim),
        "attention.wo": (dim, n_heads * head_dim),
        "feed_forward.w1": (hidden, dim),
        "feed_forward.w2": (dim, hidden),
        "feed_forward.w3": (hidden, dim),
    }
    maps = {}
    for suffix, (rows, cols) in shapes.items():
        index = torch.arange(rows, dtype=torch.int64)[:, None].expand(rows, cols).contiguous()
        state_dict = {f"layers.0.{suffix}.weight": index}
        if suffix == _FUSED_QKV:  # the post-hook TorchTitan runs in state_dict(): wqkv -> wq, wk, wv
            qkv = types.SimpleNamespace(head_dim=head_dim, heads_per_kv=n_heads // n_kv, r_dim=n_heads // n_kv + 2)
            FusedQKVLinear._split_qkv_on_save(qkv, state_dict, "layers.0.attention.qkv_linear.", None)
        hf = adapter.to_hf(state_dict)
        maps[suffix] = [
            (name.removeprefix("model.layers.0.").removesuffix(".weight"), value[:, 0].clone())
            for name, value in sorted(hf.items())
        ]
    return maps


def peft_state_dict(adapter_state_dict: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """`LoRAAdapters.adapter_state_dict()` (TorchTitan module names) in PEFT's names and layout."""
    maps = row_maps(hf_config)
    out = {}
    for key, tensor in adapter_state_dict.items():
        module, _, part = key.rpartition(".")
        match = _LAYER.match(module)
        if part in ("lora_A", "lora_B") and module == _UNEMBED:
            out[f"{_PEFT_PREFIX}{_UNEMBED}.{part}.weight"] = tensor.contiguous()
            continue
        if part not in ("lora_A", "lora_B") or match is None or match.group(2) not in maps:
            raise ValueError(
                f"adapter tensor {key!r} is not a LoRA factor of a transformer block's projection or of "
                f"{_UNEMBED}; expected 'layers.N.<{'|'.join(maps)}>.lora_A' or '.lora_B', or "
                f"'{_UNEMBED}.lora_A' / '.lora_B' (LoRAAdapters.adapter_state_dict())."
            )
        layer, suffix = match.groups()
        for hf_module, rows in maps[suffix]:
            # A copy of A per module (q, k and v share it): safetensors refuses tensors sharing memory.
            value = tensor.clone() if part == "lora_A" else tensor[rows]
            out[f"{_PEFT_PREFIX}model.layers.{layer}.{hf_module}.{part}.weight"] = value.contiguous()
    return out


def peft_target_modules(lora: LoRAConfig, hf_config: dict) -> list[str]:
    """HF module names (last component) the adapters of `lora.targets` land on."""
    maps = row_maps(hf_config)
    return sorted(
        {
            hf_module.rsplit(".", 1)[-1]
            for suffix, modules in maps.items()
            if suffix.rsplit(".", 1)[-1] in lora.targets
            for hf_module, _ in modules
        }
        | ({_UNEMBED} if _UNEMBED in lora.targets else set())
    )


def peft_adapter_config(lora: LoRAConfig, hf_config: dict, base_model_name_or_path: str) -> dict:
    """adapter_config.json of a plain LoRA (no dropout, no bias, no rsLoRA): scaling alpha / r."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "target_modules": peft_target_modules(lora, hf_config),
        "base_model_name_or_path": base_model_name_or_path,
    }


def peft_adapter(
    adapter_state_dict: dict[str, torch.Tensor],
    lora: LoRAConfig,
    model_dir: Path | str,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors in PEFT names, adapter_config.json) of the adapters of the HF checkpoint in
    `model_dir`: what `write_peft_adapter` writes and the trainer publishes (CPU copies in `dtype`)."""
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    tensors = {
        name: value.detach().to(device="cpu", dtype=dtype or value.dtype).contiguous()
        for name, value in peft_state_dict(adapter_state_dict, hf_config).items()
    }
    return tensors, peft_adapter_config(lora, hf_config, str(model_dir))


def write_peft_adapter(
    out_dir: Path | str,
    adapter_state_dict: dict[str, torch.Tensor],
    lora: LoRAConfig,
    model_dir: Path | str,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for the
    adapters of the HF checkpoint in `model_dir`; `PeftModel.from_pretrained(base, out_dir)` and
    vLLM's `LoRARequest(lora_path=out_dir)` load it."""
    tensors, config = peft_adapter(adapter_state_dict, lora, model_dir, dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def merged_hf_state_dict(model, adapters) -> dict[str, torch.Tensor]:
    """The model with its adapters merged (W + scaling * B A), in HF names; the base is restored
    afterwards."""
    from forge_rl.models.titan import export_hf_state_dict

    with adapters.merged():
        return export_hf_state_dict(model)
