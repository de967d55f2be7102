"""How the trainer's (and a frozen model's) processes split a model, and the checks that a split can
run a given model: no torch here, so the controller and the CLI validate a config without importing
it (`forge_rl.config`; tests/unit/test_package_boundaries.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from forge_rl.models.families import family_for


@dataclass(frozen=True)
class ParallelConfig:
    """How the trainer's processes split the model: trainer.num_procs = dp_replicate * dp_shard * tp."""

    dp_replicate: int = 1
    """HSDP replica groups: each of dp_replicate groups of dp_shard ranks holds a full FSDP2-sharded
    copy of the model; gradients are reduce-scattered within a group and all-reduced across groups.
    Ranks of different groups train on different rows, like dp_shard ranks."""
    dp_shard: int = 1
    """FSDP2 degree: ranks that shard parameters, gradients and optimizer state, each training on
    its own slice of the batch rows (the batch's row count must divide evenly by it)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split attention heads and MLP columns and see the same
    rows. Must divide the model's num_attention_heads and num_key_value_heads."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models only): each MoE layer's experts are split
    over this many ranks, tokens travel to their experts' rank and back by all-to-all. Not a factor
    of trainer.num_procs: TorchTitan carves the EP groups out of the dp_shard x tp ranks, so it must
    divide dp_shard * tp and the model's expert count."""

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks, each with its own rows: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "ep"):
            value = getattr(self, name)
            if value < 1:
                flag = name.replace("_", "-")
                raise ValueError(f"trainer.parallel.{name} ({value}) must be >= 1. Set --trainer.parallel.{flag}.")


def read_hf_config(model_dir: Path | str) -> dict:
    """config.json of `model_dir`, refused (ValueError listing what is supported) unless a family
    in `families.FAMILIES` rebuilds it exactly."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the trainer needs a Hugging Face model directory.")
    hf_config = json.loads(path.read_text())
    family_for(hf_config, source=str(path))
    return hf_config


def validate_parallelism(parallel: ParallelConfig, num_procs: int, hf_config: dict, section: str = "trainer") -> None:
    """Raise ValueError naming field, value and fix when `parallel` cannot run this model.

    `section` is the config section the fields live in: "trainer", or "reference" for the frozen
    reference model of the KL penalty."""
    product = parallel.dp_replicate * parallel.dp_shard * parallel.tp
    if product != num_procs:
        raise ValueError(
            f"{section}.parallel.dp_replicate ({parallel.dp_replicate}) * {section}.parallel.dp_shard "
            f"({parallel.dp_shard}) * {section}.parallel.tp ({parallel.tp}) = {product} must equal "
            f"{section}.num_procs ({num_procs}). Set --{section}.parallel.dp-replicate, "
            f"--{section}.parallel.dp-shard and --{section}.parallel.tp so that their product is {num_procs}, "
            f"or set --{section}.num-procs {product}."
        )
    _validate_expert_parallelism(parallel, hf_config, section)
    n_heads = hf_config["num_attention_heads"]
    n_kv_heads = hf_config.get("num_key_value_heads") or n_heads
    if n_heads % parallel.tp or n_kv_heads % parallel.tp:
        valid = [t for t in range(1, n_kv_heads + 1) if n_heads % t == 0 and n_kv_heads % t == 0]
        choices = ", ".join(map(str, valid[:-1])) + f" or {valid[-1]}" if len(valid) > 1 else str(valid[0])
        raise ValueError(
            f"{section}.parallel.tp ({parallel.tp}) must divide the model's num_attention_heads ({n_heads}) "
            f"and num_key_value_heads ({n_kv_heads}). Set --{section}.parallel.tp to {choices}."
        )
    if hf_config.get("tie_word_embeddings") and parallel.tp > 1 and parallel.dp_degree > 1:
        # See _retie_embeddings: the tie can be restored after TP only while FSDP2 is off.
        raise ValueError(
            f"{section}.parallel.tp ({parallel.tp}) together with {section}.parallel.dp_shard "
            f"({parallel.dp_shard}) * {section}.parallel.dp_replicate ({parallel.dp_replicate}) > 1 cannot "
            "train a checkpoint with tie_word_embeddings=true: TorchTitan 0.3.0's TP unties embed_tokens "
            f"and lm_head before FSDP2 wraps them. Set --{section}.parallel.tp 1 (FSDP2 only) or "
            f"--{section}.parallel.dp-shard 1 --{section}.parallel.dp-replicate 1 (TP only)."
        )


def _validate_expert_parallelism(parallel: ParallelConfig, hf_config: dict, section: str) -> None:
    if parallel.ep == 1:
        return
    num_experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not num_experts:
        raise ValueError(
            f"{section}.parallel.ep ({parallel.ep}) > 1 needs a mixture-of-experts model, and this one is dense "
            f"({hf_config.get('architectures')}). Set --{section}.parallel.ep 1."
        )
    ranks = parallel.dp_shard * parallel.tp
    if ranks % parallel.ep or num_experts % parallel.ep:
        valid = [e for e in range(1, ranks + 1) if ranks % e == 0 and num_experts % e == 0]
        raise ValueError(
            f"{section}.parallel.ep ({parallel.ep}) must divide {section}.parallel.dp_shard ({parallel.dp_shard}) "
            f"* {section}.parallel.tp ({parallel.tp}) = {ranks} (the ranks its groups are carved from) and the "
            f"model's {num_experts} experts per layer. Set --{section}.parallel.ep to one of {valid}."
        )
