"""What a run evaluates, when, and how (`EvalConfig`), read by the evaluation beside training
(`forge_rl.run.evaluation`) and by `forge-rl eval`.

An eval set is a data file (`forge_rl.data.config.DataConfig`; a built-in task becomes one with
`forge-rl data export`). Its first `max_prompts` rows in the seed's order are the set, the same rows
at every version, scored by the run's reward functions; a sample passes when its reward reaches
`pass_threshold`, and pass@k is the unbiased estimator over `num_samples` samples of each prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from forge_rl.data.config import DataConfig
from forge_rl.errors import ConfigError


@dataclass(frozen=True)
class EvalSetConfig:
    name: str
    """Names the set's metrics (eval/<name>/pass@1) and its results files: letters, digits, - and _."""
    data: DataConfig
    """The set's file and how its rows become prompts (answers in `data.answer_column`)."""
    max_prompts: int = 200
    """Most prompts evaluated at each version: the set's first rows in the order of data.seed. A
    set with more rows is cut to these, with a warning naming both counts."""

    def __post_init__(self) -> None:
        if not self.name or not all(char.isalnum() or char in "-_" for char in self.name):
            raise ConfigError(
                f"eval set name ({self.name!r}) must be letters, digits, - or _ (it names metrics and files). "
                "Set eval.sets[i].name."
            )
        if self.max_prompts < 1:
            raise ConfigError(f"eval set {self.name!r}: max_prompts ({self.max_prompts}) must be >= 1.")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation at exact policy versions, beside training: version v is sampled with v's weights
    only (on generators of the evaluation's own, v reserved in the weight store when the step that
    makes it is near; or pinned on the run's generators), scored, and logged by version; its
    requests are never trained, buffered or admitted, and the train loop never waits for them (only
    the run's end waits for the last)."""

    sets: tuple[EvalSetConfig, ...] = ()
    """The eval sets (none: no evaluation)."""
    every_n_steps: int = 0
    """Evaluate the version each n-th step makes; 0: only at the start and the end."""
    at_start: bool = True
    """Evaluate the version training starts from (the baseline; a resumed run's checkpoint)."""
    at_end: bool = True
    """Evaluate the last step's version; the run ends once that evaluation has."""
    num_samples: int = 1
    """Samples per prompt: the n of pass@k."""
    k_values: tuple[int, ...] = (1,)
    """The k of each pass@k reported (each <= num_samples)."""
    temperature: float = 0.0
    """Sampling temperature of the evaluation; 0: greedy (allowed here only, and only with
    num_samples 1, whose samples would otherwise all be the same)."""
    max_new_tokens: int | None = None
    """Most tokens per sample; unset: generator.max_new_tokens."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this (1.0: a verifier's "correct")."""
    placement: Literal["own", "shared"] = "own"
    """own: on generators of the evaluation's own (`num_generators`), which load exactly the
    version under evaluation. shared: on the run's generators, each holding off its weight updates
    while it samples the evaluation's share of the prompts (the run's requests keep decoding, on
    that version), at most `shared_prompts_in_flight` at once; a version the generators have left
    behind before the evaluation reaches them cannot be evaluated there (counted in eval/failed)."""
    num_generators: int = 1
    """Generators of the evaluation's own (placement own): each one vLLM engine like the training
    generators', on the services host, loading only the version under evaluation."""
    shared_prompts_in_flight: int = 4
    """Placement shared: the most eval prompts a run's generator decodes at once (their
    num_samples samples each), beside the run's requests: the share evaluation may take."""
    max_waiting: int = 1
    """Evaluations waiting behind the one running; when a newer version's is asked for with this
    many waiting, the oldest waiting one is dropped (counted in eval/dropped): evaluation slower
    than training falls behind in versions, not in memory (each waiting one holds its version)."""

    @property
    def enabled(self) -> bool:
        return bool(self.sets)

    def __post_init__(self) -> None:
        names = [eval_set.name for eval_set in self.sets]
        if len(set(names)) != len(names):
            raise ConfigError(f"eval set names ({names}) must be unique: they name metrics and files.")
        checks = [
            ("every_n_steps", self.every_n_steps >= 0, ">= 0 (0: only at the start and the end)"),
            ("num_samples", self.num_samples >= 1, ">= 1"),
            ("temperature", 0 <= self.temperature < math.inf, ">= 0 and finite (0: greedy)"),
            ("max_new_tokens", self.max_new_tokens is None or self.max_new_tokens >= 1, ">= 1, or unset"),
            ("pass_threshold", math.isfinite(self.pass_threshold), "finite"),
            ("num_generators", self.num_generators >= 1, ">= 1"),
            ("shared_prompts_in_flight", self.shared_prompts_in_flight >= 1, ">= 1"),
            ("max_waiting", self.max_waiting >= 1, ">= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(
                    f"eval.{name} ({getattr(self, name)}) must be {rule}. Set --eval.{name.replace('_', '-')}."
                )
        if not self.k_values or any(k < 1 or k > self.num_samples for k in self.k_values):
            raise ConfigError(
                f"eval.k_values ({list(self.k_values)}) must be one or more k with 1 <= k <= eval.num_samples "
                f"({self.num_samples}): pass@k needs k samples of each prompt. Raise --eval.num-samples or lower the k."
            )
        if self.temperature == 0 and self.num_samples > 1:
            raise ConfigError(
                f"eval.temperature 0 (greedy) with eval.num_samples {self.num_samples}: greedy samples of one prompt "
                "are all the same, so pass@k would be pass@1. Set --eval.temperature above 0 (e.g. 1.0) or "
                "--eval.num-samples 1."
            )
        if self.sets and self.every_n_steps == 0 and not (self.at_start or self.at_end):
            raise ConfigError(
                "eval.sets are set but nothing would be evaluated (eval.every_n_steps 0, eval.at_start and "
                "eval.at_end false). Set --eval.every-n-steps, or --eval.at-start / --eval.at-end."
            )

    def steps(self, first_step: int, last_step: int) -> list[int]:
        """The steps in (first_step, last_step] whose versions are evaluated, in order."""
        if not self.sets:
            return []
        due = {s for s in range(first_step + 1, last_step + 1) if self.every_n_steps and s % self.every_n_steps == 0}
        if self.at_end and last_step > first_step:
            due.add(last_step)
        return sorted(due)
