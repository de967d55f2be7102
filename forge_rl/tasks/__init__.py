"""Tasks: prompt generators with exact verifiers (`synthetic.py`), reward functions (`rewards.py`),
and the config the dataset and the scorer read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forge_rl.tasks.rewards import resolve_reward_fn
from forge_rl.tasks.synthetic import TaskName


@dataclass(frozen=True)
class TaskConfig:
    name: TaskName = "max_of_two"
    """Synthetic task: max_of_two, copy_digit or add_mod10 (see forge_rl/tasks/synthetic.py)."""
    seed: int = 0
    """Seed of the prompt sequence; prompt i depends only on (name, seed, i)."""
    reward: str = "leading_number"
    """Reward function: a registered name (leading_number, exact_match) or "package.module:function"
    taking (completion_text, answer) -> float (see forge_rl/tasks/rewards.py)."""
    completion_lengths: Literal["natural", "long_tail"] = "natural"
    """natural: completions end at EOS (or generator.max_new_tokens). long_tail: each prompt's
    completions are forced to a Pareto-distributed length (EOS ignored), capped at
    generator.max_new_tokens: the straggler-heavy workload of `forge-rl bench async-vs-sync`."""
    long_tail_min_tokens: int = 2
    """Shortest forced completion (long_tail only)."""
    long_tail_alpha: float = 1.0
    """Pareto shape of forced lengths (long_tail only); smaller means a heavier tail."""

    def __post_init__(self) -> None:
        resolve_reward_fn(self.reward)
        if self.long_tail_min_tokens < 1:
            raise ValueError(
                f"task.long_tail_min_tokens ({self.long_tail_min_tokens}) must be >= 1. "
                "Set --task.long-tail-min-tokens."
            )
        if self.long_tail_alpha <= 0:
            raise ValueError(
                f"task.long_tail_alpha ({self.long_tail_alpha}) must be > 0. Set --task.long-tail-alpha."
            )
