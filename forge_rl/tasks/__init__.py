"""Tasks: prompt generators with exact verifiers (`synthetic.py`, and reasoning-gym's datasets
through `reasoning_gym.py`), reward functions (`rewards.py`), and the config the dataset and the
scorer read. `make_task_prompt` and `encode_task_prompt` are the one way to get a task's prompt
and its token ids (the rollouts' prompts (`forge_rl.pipeline.prompts`), the preflight checks and
`forge-rl bench task-baseline`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from forge_rl.errors import ConfigError
from forge_rl.tasks.reasoning_gym import check_dataset, make_reasoning_gym_prompt
from forge_rl.tasks.rewards import resolve_reward_fn, reward_name
from forge_rl.tasks.synthetic import Prompt, make_prompt

if TYPE_CHECKING:
    from forge_rl.tasks.tokenizer import PromptTokenizer

TaskName = Literal["max_of_two", "copy_digit", "add_mod10", "repeat_digit", "reasoning_gym"]

DEFAULT_REWARD = "leading_number"
"""The reward of a config that names none: the synthetic tasks' verifier."""


@dataclass(frozen=True)
class TaskConfig:
    name: TaskName = "max_of_two"
    """Synthetic task: max_of_two, copy_digit, add_mod10 or repeat_digit (see `forge_rl.tasks.synthetic`); or
    reasoning_gym: the questions of `reasoning_gym_dataset` (optional extra, `forge_rl.tasks.reasoning_gym`)."""
    seed: int = 0
    """Seed of the prompt sequence; prompt i depends only on (name, seed, i)."""
    reward: str | None = None
    """The reward function: a registered name (leading_number, trailing_number, final_integer, exact_match, prefix_match, math_verify,
    reasoning_gym) or "package.module:function" taking (completion_text, answer, **columns by name)
    -> float (see `forge_rl.tasks.rewards`). Unset: leading_number, unless `rewards` is set. Task
    reasoning_gym needs reward reasoning_gym (its answers are question keys, not strings)."""
    rewards: dict[str, float] | None = None
    """Several reward functions, instead of `reward`: each spec (as `reward` takes it) with its weight.
    The reward that trains is the weighted sum; each function's own reward is logged as
    `reward/components/<name>` (its registered name, or its function's name)."""
    reasoning_gym_dataset: str = "chain_sum"
    """reasoning-gym dataset name (task reasoning_gym only), e.g. chain_sum, basic_arithmetic, gcd."""
    reasoning_gym_options: dict[str, int] = field(default_factory=dict)
    """Fields of that dataset's config (task reasoning_gym only), e.g. {min_terms: 2, max_digits: 1};
    unset fields keep reasoning-gym's defaults."""
    reasoning_gym_extract: Literal["tag_or_all", "last_number"] = "tag_or_all"
    """What of a completion the reasoning-gym verifier scores (task reasoning_gym only): tag_or_all,
    the text in its last <answer></answer> tags, else all of it (reasoning-gym's convention); or
    last_number, the last number in it (numeric datasets, models too small to write tags)."""
    prompt_format: Literal["plain", "chat"] = "plain"
    """plain: the prompt text itself, after the tokenizer's bos (the tiny models). chat: the text as
    one user message rendered by the model directory's chat template, ending with the assistant
    header (instruct models such as SmolLM2-135M-Instruct)."""
    completion_lengths: Literal["natural", "long_tail"] = "natural"
    """natural: completions end at EOS (or generator.max_new_tokens). long_tail: each prompt's
    completions are forced to a Pareto-distributed length (EOS ignored), capped at
    generator.max_new_tokens: the straggler-heavy workload of `forge-rl bench async-vs-sync`."""
    long_tail_min_tokens: int = 2
    """Shortest forced completion (long_tail only)."""
    long_tail_alpha: float = 1.0
    """Pareto shape of forced lengths (long_tail only); smaller means a heavier tail."""

    def __post_init__(self) -> None:
        self._check_rewards()
        if (self.name == "reasoning_gym") != (set(self.reward_weights) == {"reasoning_gym"}):
            raise ConfigError(
                f"task.name ({self.name!r}) and the reward ({', '.join(self.reward_weights)}) do not fit: reasoning-gym "
                "questions are scored by their own verifiers and nothing else. Set both --task.name and --task.reward "
                "to reasoning_gym, or neither."
            )
        if self.name == "reasoning_gym":
            check_dataset(self.reasoning_gym_dataset, self.reasoning_gym_options, self.seed)
        if self.long_tail_min_tokens < 1:
            raise ValueError(
                f"task.long_tail_min_tokens ({self.long_tail_min_tokens}) must be >= 1. "
                "Set --task.long-tail-min-tokens."
            )
        if self.long_tail_alpha <= 0:
            raise ValueError(f"task.long_tail_alpha ({self.long_tail_alpha}) must be > 0. Set --task.long-tail-alpha.")

    @property
    def reward_weights(self) -> dict[str, float]:
        """Each reward function's spec with its weight: `rewards`, else `reward` (default
        leading_number) with weight 1."""
        if self.rewards is not None:
            return dict(self.rewards)
        return {self.reward if self.reward is not None else DEFAULT_REWARD: 1.0}

    @property
    def only_reward(self) -> str:
        """The spec of the one reward function, for what scores with one function alone (the
        benchmarks); ConfigError when `rewards` names several."""
        if len(self.reward_weights) > 1:
            raise ConfigError(
                f"task.rewards names {len(self.reward_weights)} reward functions ({', '.join(self.reward_weights)}), "
                "and this command scores with one. Set --task.reward to one of them instead."
            )
        return next(iter(self.reward_weights))

    def _check_rewards(self) -> None:
        if self.rewards is not None and self.reward is not None:
            raise ConfigError(
                f"task.reward ({self.reward!r}) and task.rewards ({self.rewards!r}) are both set, and the reward is "
                "one of them: one function, or several with weights. Move the function into task.rewards (with "
                "its weight), or unset task.rewards."
            )
        if self.rewards is not None and (not isinstance(self.rewards, dict) or not self.rewards):
            raise ConfigError(
                f"task.rewards ({self.rewards!r}) must map at least one reward spec to its weight, e.g. "
                "{math_verify: 1.0, my_project.rewards:format: 0.2}; or unset it and set --task.reward."
            )
        field = "task.reward" if self.rewards is None else "task.rewards"
        names: dict[str, str] = {}
        for spec, weight in self.reward_weights.items():
            resolve_reward_fn(spec, field)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ConfigError(
                    f"task.rewards[{spec!r}] ({weight!r}) must be a finite number: the weight of that function's "
                    "reward in the sum that trains. Set it in task.rewards."
                )
            name = reward_name(spec)
            if name in names:
                raise ConfigError(
                    f"task.rewards names two functions called {name!r} ({names[name]!r} and {spec!r}), and a "
                    "reward's name keys its metric (reward/components/<name>). Rename one of the functions."
                )
            names[name] = spec


def make_task_prompt(task: TaskConfig, index: int) -> Prompt:
    """The index-th prompt of the task (independent of any other index)."""
    if task.name == "reasoning_gym":
        return make_reasoning_gym_prompt(
            task.reasoning_gym_dataset, task.reasoning_gym_options, task.seed, index, task.reasoning_gym_extract
        )
    return make_prompt(task.name, task.seed, index)


def encode_task_prompt(task: TaskConfig, tokenizer: PromptTokenizer, text: str) -> list[int]:
    """The prompt's token ids in the task's `prompt_format`."""
    if task.prompt_format == "chat":
        return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode_prompt(text)
