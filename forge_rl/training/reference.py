"""The frozen reference policy of the KL penalty (`trainer.loss.kl_beta` > 0). Plain PyTorch.

The reference model is the initial policy, never trained. It runs on its own processes
(`forge_rl.actors.frozen_model`, the frozen-model actor that also serves a distillation teacher,
`forge_rl.scoring.teacher`; restarted if one dies, `forge_rl.actors.frozen_model_supervisor`), between the scorer and
the replay buffer: every completion enters
the buffer with `Completion.reference_logprobs`, so the trainer step needs no second model. Its
logprobs are taken like the trainer's (the generator's temperature and top-k/top-p kept sets,
`forge_rl.core.batching.token_logprobs`), so the KL compares two distributions over the same support.
With kl_beta = 0 (the default) nothing of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from forge_rl.models.parallel import ParallelConfig
from forge_rl.types import Episode

if TYPE_CHECKING:  # the config is read by the controller and the CLI, which need no torch
    import torch


@dataclass(frozen=True)
class ReferenceConfig:
    """Processes of a frozen model that scores tokens (the reference model; TeacherConfig adds a path)."""

    section: ClassVar[str] = "reference"
    """The config section, for error messages."""

    num_procs: int = 1
    """Processes of the reference model; must equal parallel.dp_shard * parallel.tp. Spawned only
    when trainer.loss.kl_beta > 0."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the reference processes split the model (FSDP2 shards the frozen weights too)."""
    num_threads: int = 1
    """Torch CPU threads per reference process."""
    max_restarts: int = 3
    """Times this model's processes are restarted on fresh ones after one dies, the calls in flight
    sent again to the replacement (`forge_rl.actors.frozen_model_supervisor`); one more death
    stops the run. 0: the first death stops the run."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(
                f"{self.section}.max_restarts ({self.max_restarts}) must be >= 0. "
                f"Set --{self.section.replace('_', '-')}.max-restarts."
            )
        for name in ("num_procs", "num_threads"):
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise ValueError(
                    f"{self.section}.{name} ({getattr(self, name)}) must be >= 1. Set --{self.section.replace('_', '-')}.{flag}."
                )


def completion_logprobs(episodes: list[Episode], logprobs_NL: torch.Tensor) -> list[list[list[float]]]:
    """Row n of `logprobs_NL` (rows in `make_train_batch` order: episode by episode, each completion
    a row of prompt + completion) without the prompt positions, as [episode][completion][token]."""
    result: list[list[list[float]]] = []
    row = 0
    for episode in episodes:
        start = len(episode.prompt_token_ids)
        result.append([])
        for completion in episode.completions:
            result[-1].append(logprobs_NL[row, start : start + completion.num_tokens].tolist())
            row += 1
    if row != logprobs_NL.shape[0]:
        raise ValueError(f"{logprobs_NL.shape[0]} rows of logprobs for {row} completions")
    return result


def attach_reference_logprobs(episodes: list[Episode], logprobs: list[list[list[float]]]) -> list[Episode]:
    """Store the reference model's logprobs (`completion_logprobs` order) on the completions."""
    if len(logprobs) != len(episodes):
        raise ValueError(f"reference logprobs for {len(logprobs)} episodes, {len(episodes)} given")
    for episode, per_completion in zip(episodes, logprobs, strict=True):
        for completion, values in zip(episode.completions, per_completion, strict=True):
            completion.reference_logprobs = values
    return episodes
