"""Advantage estimators and reward shaping. Plain PyTorch.

- `group_advantages`: GRPO's group baseline, with (GRPO, DAPO, GSPO, CISPO) or without (Dr. GRPO)
  division by the group's standard deviation.
- `episode_advantages`: the same for one `Episode`, leaving ERRORED completions out of the statistics.
- `completion_reward`: what a completion's advantage is computed from (the seam for per-turn rewards).
- `filter_zero_advantage_groups`: DAPO's dynamic sampling, which keeps only groups with a signal.
- `overlong_penalty`: DAPO's soft penalty for completions that run into the length budget.
"""

from __future__ import annotations

import torch

from forge_rl.types import Completion, CompletionStatus, Episode

# Keeps a group whose rewards are all equal at advantage 0 instead of dividing by zero.
_STD_EPS = 1e-6


def group_advantages(rewards_G: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """Advantages of one group of G completions of the same prompt: r - mean, divided by
    (std + eps) when `normalize_std`.

    Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division: it weights
    questions by how hard or easy they are (a group with a small spread gets its advantages blown
    up). A group whose samples all score the same carries no signal and gets all-zero advantages
    either way.
    """
    centered_G = rewards_G - rewards_G.mean()
    if not normalize_std:
        return centered_G
    return centered_G / (rewards_G.std(unbiased=False) + _STD_EPS)


def completion_reward(completion: Completion) -> float:
    """The reward a completion's advantage is computed from: its final reward (a single-turn
    completion's score, an environment episode's closing reward). Every advantage reads it here.

    The seam for per-turn (process) rewards: a multi-turn completion records them in
    `Completion.turn_rewards`, one per environment step, and its `generated` mask marks where each
    turn's tokens lie (turn k = the k-th run of generated tokens). Turning them into per-token
    advantages (a return per turn, credited to that turn's tokens) replaces this scalar with one
    value per token; that belongs to the scorer work of issue 14, and until then per-turn rewards
    are recorded, not trained on."""
    return completion.reward


def episode_advantages(episode: Episode, normalize_std: bool) -> list[float]:
    """One advantage per completion of `episode`, in order. ERRORED completions get 0 and are left
    out of the group's mean and std (their reward is not a measurement). Completions whose tokens
    are all untrainable still count: their reward is a valid sample for the baseline."""
    usable = [c.status != CompletionStatus.ERRORED for c in episode.completions]
    if not any(usable):
        return [0.0] * len(episode.completions)
    rewards_G = torch.tensor(
        [completion_reward(c) for c, ok in zip(episode.completions, usable) if ok], dtype=torch.float64
    )
    advantages = iter(group_advantages(rewards_G, normalize_std).tolist())
    return [next(advantages) if ok else 0.0 for ok in usable]


def has_reward_spread(episode: Episode) -> bool:
    """True when the group's usable (not ERRORED) rewards are not all equal, i.e. its advantages
    are not all zero. Compares rewards, not advantages, so float rounding of the mean cannot turn a
    uniform group into a "signal"."""
    rewards = [completion_reward(c) for c in episode.completions if c.status != CompletionStatus.ERRORED]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def filter_zero_advantage_groups(episodes: list[Episode]) -> tuple[list[Episode], list[Episode]]:
    """DAPO's dynamic sampling (Yu et al. 2025, Sec. 3.2): splits `episodes` into (kept, filtered),
    order preserved, where a filtered group's rewards are all equal, so every advantage is zero and
    it would only dilute the batch. The caller keeps sampling until it has a full batch of kept
    groups, and accounts for the filtered ones."""
    kept = [e for e in episodes if has_reward_spread(e)]
    filtered = [e for e in episodes if not has_reward_spread(e)]
    return kept, filtered


def overlong_penalty(num_tokens: int, max_new_tokens: int, overlong_buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), added to a completion's reward.

    With L_max = max_new_tokens and L_cache = overlong_buffer:
        0                                    if num_tokens <= L_max - L_cache
        ((L_max - L_cache) - num_tokens) / L_cache   in between (0 down to -1, linearly)
    so a completion that hits the budget (truncated, num_tokens = L_max) gets -1, and one that
    ends within the last L_cache tokens is penalized in proportion to how far into them it ran.
    The engine never samples more than L_max tokens. overlong_buffer = 0 would penalize only
    lengths the engine cannot produce, so it is refused (as scorer.overlong_buffer is).
    """
    if not 1 <= overlong_buffer <= max_new_tokens:
        raise ValueError(
            f"overlong_buffer ({overlong_buffer}) must be in [1, max_new_tokens ({max_new_tokens})]: "
            "it is the stretch before the length budget over which the penalty ramps from 0 to -1."
        )
    if not 0 <= num_tokens <= max_new_tokens:
        raise ValueError(f"a completion of {num_tokens} tokens cannot exist with max_new_tokens {max_new_tokens}")
    soft_start = max_new_tokens - overlong_buffer
    return min(0.0, (soft_start - num_tokens) / overlong_buffer)
