"""The trainer's settings (`TrainerConfig`): no torch here, so the controller, the CLI and the
processes that only pass a config on validate and unpickle it without importing torch (the trainer
itself: `forge_rl.training.trainer`; tests/unit/test_package_boundaries.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from forge_rl.engines.simulated import SimTrainerConfig
from forge_rl.models.lora_config import LoRAConfig
from forge_rl.models.parallel import ParallelConfig
from forge_rl.training.losses.config import LossConfig

BATCHING_MODES = ("pad", "bucket", "pack", "tree")
"""How a trainer rank lays its rows out (`TrainerConfig.batching`, `forge_rl.training.packing`)."""


@dataclass(frozen=True)
class TrainerConfig:
    engine: Literal["torchtitan", "sim"] = "torchtitan"
    """"torchtitan": the real trainer. "sim": a SIMULATED step with no model (a wait computed from
    the batch's tokens, then a new policy version with no weights: `forge_rl.actors.simulated_trainer`),
    for testing the control plane at scale; needs generator.engine sim too."""
    sim: SimTrainerConfig = field(default_factory=SimTrainerConfig)
    """The simulated step's timing (read only with engine sim)."""
    num_procs: int = 1
    """Trainer processes; must equal parallel.dp_replicate * parallel.dp_shard * parallel.tp."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the processes split the model (FSDP2 and tensor parallelism)."""
    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_eps: float = 1e-8
    """AdamW epsilon. Coordinates whose gradient is near this size get updates that swing with
    float rounding; a larger value damps that."""
    max_grad_norm: float = 1.0
    """Gradients are rescaled so that their global L2 norm is at most this."""
    seed: int = 0
    """Torch seed of every trainer process."""
    num_threads: int | Literal["auto"] = 1
    """Torch CPU threads per trainer process (torch.set_num_threads); "auto": a share of this
    machine's cores beside the other roles' (`forge_rl.plumbing.threads`), local runs only."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss (grpo, dr_grpo, dapo, gspo, cispo), its off-policy corrections and KL penalty."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters on a frozen base (off by default: full fine-tuning). On: only the adapters
    train and are checkpointed; the published and exported weights are the merged ones."""
    max_consecutive_nonfinite_steps: int = 3
    """A step whose loss or gradient norm is NaN/inf is skipped (weights, optimizer state and policy
    version untouched); this many non-finite steps in a row stop the run with an error (so 1 stops
    at the first)."""
    batching: str = "pack"
    """How each rank lays its rows out for the forward pass (`forge_rl.training.packing`): "pad" (one row
    per completion, padded to the longest), "bucket" (rows sorted by length into a few micro-batches,
    each padded to its own longest) or "pack" (several completions per row, attention kept within
    each, positions restarting at 0) or "tree" (sequences that begin alike, a group's prompt or a
    branch's prefix, share those tokens' computation: each row a prefix tree, each token attending
    to its own path). Logprobs, loss and gradients are the same in all four."""
    activation_checkpointing: str = "none"
    """"full" recomputes each transformer block's activations in the backward pass (TorchTitan's
    FullAC, torch's checkpoint wrapper per block): less memory, about one more forward of compute."""
    mixed_precision: str = "fp32"
    """"bf16": forward and backward in bfloat16 with fp32 master weights, gradient reduction and
    optimizer (FSDP2's MixedPrecisionPolicy over several processes, torch.autocast on one). Trainer
    logprobs then differ from an fp32 generator's by bf16 rounding. "fp32": everything in fp32."""

    keep_routing: bool = False
    """Mixture-of-experts policies: replay the expert routing the generator recorded for each
    generated token (`Completion.routed_experts`) in the trainer's forward, so the trainer
    optimizes the function that sampled (`forge_rl.routing`). Tokens without a record (the prompt,
    completions from an engine that records none) route normally; such completions are counted
    (`keep_routing/completions_without_record`). Refused on a dense model."""

    def __post_init__(self) -> None:
        checks = {
            "num_procs": (self.num_procs >= 1, ">= 1"),
            "lr": (0.0 < self.lr < math.inf, "> 0 and finite"),
            "weight_decay": (0.0 <= self.weight_decay < math.inf, ">= 0 and finite"),
            "adam_eps": (0.0 < self.adam_eps < math.inf, "> 0 and finite"),
            "max_grad_norm": (self.max_grad_norm > 0.0, "> 0 (inf disables clipping)"),
            "num_threads": (self.num_threads == "auto" or self.num_threads >= 1, ">= 1 or auto"),
            "max_consecutive_nonfinite_steps": (self.max_consecutive_nonfinite_steps >= 1, ">= 1"),
            "batching": (self.batching in BATCHING_MODES, "one of " + ", ".join(BATCHING_MODES)),
            "activation_checkpointing": (self.activation_checkpointing in ("none", "full"), "none or full"),
            "mixed_precision": (self.mixed_precision in ("fp32", "bf16"), "fp32 or bf16"),
        }
        for name, (ok, constraint) in checks.items():
            if not ok:
                flag = name.replace("_", "-")
                value = getattr(self, name)
                raise ValueError(f"trainer.{name} ({value}) must be {constraint}. Set --trainer.{flag}.")
        if self.batching == "tree" and self.keep_routing:
            raise ValueError(
                "trainer.batching tree with trainer.keep_routing: a shared prompt token would replay one "
                "sequence's routing record for all. Set --trainer.batching pack (or leave keep_routing off)."
            )
