"""The bridge between a Hugging Face Llama directory and a (parallelized) TorchTitan llama3 model.

`build_titan_model` reads config.json, builds the matching TorchTitan `Llama3Model`, loads
model.safetensors through `Llama3StateDictAdapter.from_hf` and, over several processes, applies
TorchTitan's own `parallelize_llama` (TP, then FSDP2). `export_hf_state_dict` goes the other way.
`read_hf_config` and `validate_parallelism` only read config.json, so the controller can run them
before any trainer process starts. No Monarch here: the launcher only sets RANK/WORLD_SIZE/MASTER_*.

TorchTitan is imported inside the functions: importing it takes about 2.5 s, which the controller,
importing this module for `ParallelConfig` and the checks, should not pay.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class ParallelConfig:
    """How the trainer's processes split the model: trainer.num_procs = dp_shard * tp."""

    dp_shard: int = 1
    """FSDP2 degree: ranks that shard parameters, gradients and optimizer state, each training on
    its own slice of the batch rows (the batch's row count must divide evenly by it)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split attention heads and MLP columns and see the same
    rows. Must divide the model's num_attention_heads and num_key_value_heads."""

    def __post_init__(self) -> None:
        for name in ("dp_shard", "tp"):
            value = getattr(self, name)
            if value < 1:
                flag = name.replace("_", "-")
                raise ValueError(
                    f"trainer.parallel.{name} ({value}) must be >= 1. Set --trainer.parallel.{flag}."
                )


def read_hf_config(model_dir: Path | str) -> dict:
    """config.json of `model_dir`, refused unless it describes a supported architecture."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the trainer needs a Hugging Face model directory.")
    hf_config = json.loads(path.read_text())
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(
            f"{path} describes {architectures}; the TorchTitan trainer supports "
            f"{list(SUPPORTED_ARCHITECTURES)}."
        )
    # TorchTitan's llama3 has bias-free linears and SiLU; such checkpoints would load wrongly or not at all.
    unsupported = {
        key: hf_config[key]
        for key, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"))
        if hf_config.get(key, expected) != expected
    }
    if unsupported:
        raise ValueError(
            f"{path} sets {unsupported}; the TorchTitan llama3 trainer supports only bias-free SiLU Llamas."
        )
    return hf_config


def validate_parallelism(parallel: ParallelConfig, num_procs: int, hf_config: dict) -> None:
    """Raise ValueError naming field, value and fix when `parallel` cannot run this model."""
    if parallel.dp_shard * parallel.tp != num_procs:
        raise ValueError(
            f"trainer.parallel.dp_shard ({parallel.dp_shard}) * trainer.parallel.tp ({parallel.tp}) = "
            f"{parallel.dp_shard * parallel.tp} must equal trainer.num_procs ({num_procs}). Set "
            f"--trainer.parallel.dp-shard and --trainer.parallel.tp so that their product is {num_procs}, "
            f"or set --trainer.num-procs {parallel.dp_shard * parallel.tp}."
        )
    n_heads = hf_config["num_attention_heads"]
    n_kv_heads = hf_config.get("num_key_value_heads") or n_heads
    if n_heads % parallel.tp or n_kv_heads % parallel.tp:
        valid = [t for t in range(1, n_kv_heads + 1) if n_heads % t == 0 and n_kv_heads % t == 0]
        choices = ", ".join(map(str, valid[:-1])) + f" or {valid[-1]}" if len(valid) > 1 else str(valid[0])
        raise ValueError(
            f"trainer.parallel.tp ({parallel.tp}) must divide the model's num_attention_heads ({n_heads}) "
            f"and num_key_value_heads ({n_kv_heads}). Set --trainer.parallel.tp to {choices}."
        )


def _rope_config(hf_config: dict):
    """ComplexRoPE config from config.json (transformers 5 `rope_parameters`, or the older keys)."""
    from torchtitan.models.common import ComplexRoPE

    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    common = dict(dim=head_dim, max_seq_len=hf_config["max_position_embeddings"], theta=theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return ComplexRoPE.Config(**common)
    if rope_type == "llama3":
        return ComplexRoPE.Config(
            **common,
            scaling="llama",
            scaling_factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    raise ValueError(f"config.json rope type {rope_type!r} is not supported; supported: 'default', 'llama3'.")


def _llama3_config(hf_config: dict):
    """A TorchTitan Llama3Model.Config with exactly the dimensions of the HF config."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    dim, vocab, eps = hf_config["hidden_size"], hf_config["vocab_size"], hf_config["rms_norm_eps"]
    rope = _rope_config(hf_config)

    def block() -> Llama3TransformerBlock.Config:
        return Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
            # SDPA, not TorchTitan's flex/varlen: each row is one right-padded sequence, so plain
            # causal attention is exact, and flex has no CPU backward while varlen has no CPU kernel.
            attention=make_gqa_config(
                dim=dim,
                n_heads=hf_config["num_attention_heads"],
                n_kv_heads=hf_config.get("num_key_value_heads"),
                head_dim=rope.dim,
                fuse_qkv=True,
                inner_attention=ScaledDotProductAttention.Config(),
                rope=rope,
                wqkv_param_init={},
                wo_param_init={},
            ),
            # make_ffn_config takes the final width (compute_ffn_hidden_dim would re-derive it from
            # dim, multiple_of and ffn_dim_multiplier), so intermediate_size is used as is.
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hf_config["intermediate_size"], w1_param_init={}, w2w3_param_init={}
            ),
        )

    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=[block() for _ in range(hf_config["num_hidden_layers"])],
    )


def _point_torchtitan_at_cpu() -> None:
    """TorchTitan picks its device at import time and falls back to "cuda" without an accelerator;
    several modules copy that name when imported, so each copy is repointed at the CPU."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.tools.utils as tt_utils

    for module in (tt_utils, tt_parallel_dims, tt_dist_utils):
        module.device_type = "cpu"
    tt_utils.device_module = tt_dist_utils.device_module = torch.cpu


def _load_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}.")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    return weights


def init_process_group_from_env(device: torch.device) -> tuple[int, int]:
    """(rank, world size) from RANK/WORLD_SIZE; joins the process group (gloo on CPU, nccl on GPU)
    when there is more than one process and the launcher has not joined it already."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return rank, world_size


def _parallelize(model, parallelism, parallel_dims) -> None:
    """TorchTitan's own TP + FSDP2 recipe, in fp32 so trainer and generator logprobs agree."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.llama3 import parallelize_llama

    set_spmd_backend(parallelism.spmd_backend)
    parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    if dist.get_backend() == "gloo":
        # Gloo has no PREMUL_SUM, which FSDP2 uses for its gradient reduction by default.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def build_titan_model(model_dir: Path | str, parallel: ParallelConfig, device: torch.device):
    """(model, ParallelDims): the HF checkpoint as a TorchTitan llama3, parallelized over WORLD_SIZE.

    Every rank reads the full checkpoint, then TP/FSDP keep each rank's shard. FSDP2 gradient
    division is off (TorchTitan's choice): gradients are summed over data-parallel ranks, so the
    caller normalizes its loss by the global token count.
    """
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    validate_parallelism(parallel, world_size, hf_config)
    if device.type == "cpu":
        _point_torchtitan_at_cpu()
    # partial_dtensor: DTensors on the TP axis only; the default spmd_types and full_dtensor fail on CPU.
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=parallel.dp_shard,
        tensor_parallel_degree=parallel.tp,
        spmd_backend="partial_dtensor",
    )
    model_config = _llama3_config(hf_config)
    model_config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device(device):
        model = model_config.build()
    adapter = Llama3StateDictAdapter(model_config, None)
    model.load_state_dict(adapter.from_hf(_load_hf_weights(model_dir)), strict=True)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    if world_size > 1:
        _parallelize(model, parallelism, parallel_dims)
    return model, parallel_dims


def export_hf_state_dict(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The full weights in HF names and layout, as CPU copies in `dtype`.

    Gathers DTensor shards, so every rank must call it (same order of collectives); every rank
    gets the full dict. `model.state_dict()` already splits the fused QKV into wq/wk/wv.
    """
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    full = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        full[name] = value.detach().to(device="cpu", dtype=dtype, copy=True)
    return Llama3StateDictAdapter(model.config, None).to_hf(full)
