"""The bridge between a Hugging Face model directory and a (parallelized) TorchTitan model.

`build_titan_model` reads config.json, finds its family in `families.FAMILIES` (llama3, qwen3),
builds the matching TorchTitan model, loads the safetensors (one file or shards) through the
family's TorchTitan state-dict adapter and, over several processes, applies the family's own
TorchTitan parallelize function (TP, then FSDP2). `export_hf_state_dict` goes the other way;
`hf_checkpoint.export_hf_model_dir` writes the result as a loadable HF directory.
`ParallelConfig`, `read_hf_config` and `validate_parallelism` (`forge_rl.models.parallel`) only
read config.json, so the controller can run them before any trainer process starts, without torch.
No Monarch here: the launcher only sets RANK/WORLD_SIZE/MASTER_*.

Every workaround the pinned stack needs on CPU and gloo (shared/STACK.md) lives in this file:
`_inner_attention_config`, `_point_torchtitan_at_cpu`, `_parallelism_config`, `_parallelize`.

TorchTitan is imported inside the functions that use it (its import is slow), so importing this
module costs torch alone.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_rl.models.families import FAMILIES, ModelFamily, build_model_config, family_for, resolve
from forge_rl.models.hf_checkpoint import load_hf_state_dict
from forge_rl.models.parallel import ParallelConfig, read_hf_config, validate_parallelism


def _inner_attention_config():
    """SDPA, not TorchTitan's flex/varlen (flex has no CPU backward, varlen no CPU kernel): plain
    causal when the model is called without attention masks (a right-padded sequence per row), or
    restricted to documents by a boolean mask when sequences are packed (`forge_rl.training.packing`)."""
    from forge_rl.models.document_attention import DocumentCausalSDPA

    return DocumentCausalSDPA.Config()


def _point_torchtitan_at_cpu() -> None:
    """TorchTitan picks its device at import time and falls back to "cuda" without an accelerator;
    several modules copy that name when imported, so each copy is repointed at the CPU."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.tools.utils as tt_utils

    for module in (tt_utils, tt_parallel_dims, tt_dist_utils):
        module.device_type = "cpu"
    tt_utils.device_module = tt_dist_utils.device_module = torch.cpu


def _parallelism_config(parallel: ParallelConfig):
    from torchtitan.config import ParallelismConfig

    # partial_dtensor: DTensors on the TP axis only; the default spmd_types and full_dtensor fail on CPU.
    return ParallelismConfig(
        data_parallel_replicate_degree=parallel.dp_replicate,
        data_parallel_shard_degree=parallel.dp_shard,
        tensor_parallel_degree=parallel.tp,
        expert_parallel_degree=parallel.ep,
        spmd_backend="partial_dtensor",
    )


def init_process_group_from_env(device: torch.device) -> tuple[int, int]:
    """(rank, world size) from RANK/WORLD_SIZE; joins the process group (gloo on CPU, nccl on GPU)
    when there is more than one process and the launcher has not joined it already."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return rank, world_size


def _activation_checkpointing_config(activation_checkpointing: str):
    """TorchTitan's full AC (each transformer block recomputed in backward), or None; Keep
    Routing's replay carried into the recomputation (`forge_rl.models.moe.ReplayingFullAC`,
    FullAC itself for a model without routers)."""
    from forge_rl.models.moe import ReplayingFullAC

    return ReplayingFullAC.Config() if activation_checkpointing == "full" else None


def _parallelize(model, family: ModelFamily, parallelism, parallel_dims, ac_config, mixed_precision: str) -> None:
    """The family's own TorchTitan TP + AC + FSDP2 recipe. FSDP2 computes in fp32 (trainer and
    generator logprobs agree) or, with mixed_precision "bf16", casts parameters to bf16 for the
    forward and backward while gradients are reduced and the optimizer steps in fp32."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend(parallelism.spmd_backend)
    param_dtype = "bfloat16" if mixed_precision == "bf16" else "float32"
    resolve(family.parallelize_fn)(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=ac_config,
        dump_folder="",
    )
    if model.enable_weight_tying and parallel_dims.tp_enabled:
        _retie_embeddings(model)
    if dist.get_backend() == "gloo":
        # Gloo has no PREMUL_SUM, which FSDP2 uses for its gradient reduction by default.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _retie_embeddings(model) -> None:
    """Share lm_head's weight with tok_embeddings again after TP (FSDP2 off: validate_parallelism).

    TorchTitan 0.3.0's `Module._distribute_states` (protocols/module.py) replaces each module's
    weight by a new DTensor Parameter, one module at a time, so after TP the two modules hold two
    Parameters: each trains on its own half of the gradient and the export (embed_tokens only)
    drifts from a 1-process run. Both are Shard(0) over the tp mesh with equal values here, so
    pointing the embedding at lm_head's Parameter restores the tie exactly.
    """
    embedding, head = model.tok_embeddings.weight, model.lm_head.weight
    if embedding is not head:
        assert embedding.placements == head.placements and torch.equal(embedding.to_local(), head.to_local())
        model.tok_embeddings.weight = head


def build_titan_model(
    model_dir: Path | str,
    parallel: ParallelConfig,
    device: torch.device,
    activation_checkpointing: str = "none",
    mixed_precision: str = "fp32",
):
    """(model, ParallelDims): the HF checkpoint as its TorchTitan family's model, parallelized over
    WORLD_SIZE, with `activation_checkpointing` ("none" | "full") applied per transformer block.

    `mixed_precision` "bf16" is FSDP2's MixedPrecisionPolicy (bf16 parameters in forward/backward,
    fp32 reduction) over more than one process; on one process there is no FSDP2 and the caller
    runs the forward under torch.autocast instead (see PolicyTrainer).

    Every rank reads the full checkpoint, then TP/FSDP keep each rank's shard. FSDP2 gradient
    division is off (TorchTitan's choice): gradients are summed over data-parallel ranks, so the
    caller normalizes its loss by the global token count.
    """
    from torchtitan.distributed import ParallelDims

    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    family = family_for(hf_config, source=str(model_dir / "config.json"))
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    validate_parallelism(parallel, world_size, hf_config)
    if device.type == "cpu":
        _point_torchtitan_at_cpu()
    parallelism = _parallelism_config(parallel)
    model_config = build_model_config(family, hf_config, _inner_attention_config())
    model_config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device(device):
        model = model_config.build()
    adapter = resolve(family.adapter_class)(model_config, None)
    model.load_state_dict(adapter.from_hf(load_hf_state_dict(model_dir)), strict=True)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    ac_config = _activation_checkpointing_config(activation_checkpointing)
    if world_size > 1:
        _parallelize(model, family, parallelism, parallel_dims, ac_config, mixed_precision)
    elif ac_config is not None:
        ac_config.build(dump_folder="").apply(model)
    return model, parallel_dims


def reshard(model) -> None:
    """Reshard every FSDP2 module, so the registered parameters are this rank's shards.

    FSDP2 registers the unsharded parameters while a module is unsharded (the root stays so after a
    no-grad forward such as compute_logprobs); resharded, the registered parameters are the sharded
    ones the optimizer steps and a checkpoint saves. No-op without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _family_of(model) -> ModelFamily:
    """The family whose TorchTitan class built `model` (FSDP2 subclasses it, so isinstance holds)."""
    for family in FAMILIES:
        if isinstance(model, resolve(family.model_class)):
            return family
    raise TypeError(f"{type(model).__name__} is not a model of any family in {[f.name for f in FAMILIES]}.")


def export_hf_state_dict(model, dtype: torch.dtype = torch.float32, keep: bool = True) -> dict[str, torch.Tensor]:
    """The full weights in HF names and layout, as CPU copies in `dtype`.

    Gathers DTensor shards, so every rank must call it (same order of collectives). `keep=False`
    joins the gathers and keeps nothing (returns {}): the ranks that do not publish skip the
    copy of the whole model to host memory. `model.state_dict()` already splits the fused QKV
    into wq/wk/wv. With tied embeddings the adapter leaves lm_head.weight out, as HF checkpoints do.
    """
    full = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank, in the same order
        if keep:
            full[name] = value.detach().to(device="cpu", dtype=dtype, copy=True)
    return resolve(_family_of(model).adapter_class)(model.config, None).to_hf(full) if keep else {}


def state_dict_adapter(hf_config: dict, source: str = "config.json"):
    """TorchTitan's HF <-> TorchTitan weight converter for the checkpoint `hf_config` describes
    (its config.json, named `source` in errors), without building the model: what
    `build_titan_model` loads through."""
    family = family_for(hf_config, source=source)
    return resolve(family.adapter_class)(build_model_config(family, hf_config, _inner_attention_config()), None)


def titan_state_dict_from_hf(model_dir: Path | str, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`hf_state_dict` (HF names, as the weight store publishes a version) in the names and layout of
    the TorchTitan model `build_titan_model(model_dir, ...)` builds: what its `load_state_dict`
    takes on one process."""
    adapter = state_dict_adapter(read_hf_config(model_dir), source=str(Path(model_dir) / "config.json"))
    return adapter.from_hf(hf_state_dict)
