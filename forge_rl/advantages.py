"""Advantage estimators and reward shaping. Plain Python.

- `group_advantages`: GRPO's group baseline, with (GRPO, DAPO, GSPO, CISPO) or without (Dr. GRPO)
  division by the group's standard deviation.
- `episode_advantages`: the same for one `Episode`, leaving ERRORED completions out of the statistics.
- `completion_reward`: what a completion's group advantage is computed from.
- `token_advantages`: per-token advantages of one `Episode`: its group advantage plus process
  rewards (per step, per turn) and dense per-token rewards; the formula is in docs/scoring.md.
- `filter_zero_advantage_groups`: DAPO's dynamic sampling, which keeps only groups with a signal.
- `overlong_penalty`: DAPO's soft penalty for completions that run into the length budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from forge_rl.types import Completion, CompletionStatus, Episode

# Keeps a group whose rewards are all equal at advantage 0 instead of dividing by zero.
_STD_EPS = 1e-6


def group_advantages(rewards_G: Sequence[float], normalize_std: bool) -> list[float]:
    """Advantages of one group of G completions of the same prompt: r - mean, divided by
    (std + eps) when `normalize_std` (the population std, over the G rewards).

    Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division: it weights
    questions by how hard or easy they are (a group with a small spread gets its advantages blown
    up). A group whose samples all score the same carries no signal and gets all-zero advantages
    either way.

    Plain float64 arithmetic, not tensors: a group holds a handful of numbers and the trainer
    computes one group per prompt on its critical path, where four tensor operations per group
    cost more than the whole batch's padding (issue 16 part 7).
    """
    rewards = [float(r) for r in rewards_G]
    mean = math.fsum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / len(centered))
    return [c / (std + _STD_EPS) for c in centered]


def completion_reward(completion: Completion) -> float:
    """The reward a completion's group advantage is computed from: its final reward (a single-turn
    completion's score, an environment episode's closing reward). Per-turn rewards of a multi-turn
    episode are process rewards on top of it (forge_rl/envs/rollout.py `turn_steps`, then
    `token_advantages`)."""
    return completion.reward


def episode_advantages(episode: Episode, normalize_std: bool) -> list[float]:
    """One advantage per completion of `episode`, in order. ERRORED completions get 0 and are left
    out of the group's mean and std (their reward is not a measurement). Completions whose tokens
    are all untrainable still count: their reward is a valid sample for the baseline."""
    usable = [c.status != CompletionStatus.ERRORED for c in episode.completions]
    if not any(usable):
        return [0.0] * len(episode.completions)
    rewards_G = [completion_reward(c) for c, ok in zip(episode.completions, usable) if ok]
    advantages = iter(group_advantages(rewards_G, normalize_std))
    return [next(advantages) if ok else 0.0 for ok in usable]


def token_advantages(episode: Episode, normalize_std: bool, step_discount: float = 1.0) -> list[list[float]]:
    """Per completion of `episode`, the advantage of each of its tokens, [G][T]:

        A_it = A_i + sum_{k >= k(t)} step_discount^(k - k(t)) * r~_ik + d_it

    A_i is the completion's group advantage (`episode_advantages`); k(t) is the step holding token
    t; r~_ik = (r_ik - mean(R)) / (std(R) + eps), R being every step reward of the group's usable
    completions (centered only when not `normalize_std`), so a step is judged against the steps of
    its group, as DeepSeekMath's GRPO with process supervision does (Shao et al. 2024, Sec. 4.1.3,
    step_discount = 1: a token is credited with its own step and every later one); step_discount
    = 0 credits a token with its own step only. d_it is the token's dense reward (`token_rewards`),
    unnormalized (a teacher's per-token log ratio is already on a per-token scale). Without step
    or token rewards A_it = A_i: plain GRPO. A turn of a multi-turn episode is a step. ERRORED
    completions get zeros. Worked example and reasoning: docs/scoring.md."""
    if not 0.0 <= step_discount <= 1.0:
        raise ValueError(f"step_discount ({step_discount}) must be in [0, 1]")
    usable = [c for c in episode.completions if c.status != CompletionStatus.ERRORED]
    step_rewards = [r for c in usable for r in c.step_rewards or ()]
    if step_rewards:
        normalized = group_advantages(step_rewards, normalize_std)
    normalized_steps = iter(normalized if step_rewards else ())
    result = []
    for completion, advantage in zip(episode.completions, episode_advantages(episode, normalize_std)):
        if completion.status == CompletionStatus.ERRORED:
            result.append([0.0] * completion.num_tokens)
            continue
        steps = [next(normalized_steps) for _ in completion.step_rewards or ()]
        per_token = [advantage] * completion.num_tokens
        if steps:
            credits = place_on_steps(completion.step_ends, returns_to_go(steps, step_discount))
            per_token = [a + c for a, c in zip(per_token, credits)]
        if completion.token_rewards is not None:
            per_token = [a + d for a, d in zip(per_token, completion.token_rewards)]
        result.append(per_token)
    return result


def returns_to_go(step_values: list[float], discount: float) -> list[float]:
    """G_k = sum_{j >= k} discount^(j - k) * value_j, for each step k (0^0 = 1: discount 0 is each step alone)."""
    returns, running = [], 0.0
    for value in reversed(step_values):
        running = value + discount * running
        returns.append(running)
    return returns[::-1]


def place_on_steps(step_ends: list[int], step_values: list[float]) -> list[float]:
    """Each step's value on each of its tokens: tokens [step_ends[k-1], step_ends[k]) get
    step_values[k] (step 0 starts at token 0), [T] with T = step_ends[-1]."""
    per_token, start = [], 0
    for end, value in zip(step_ends, step_values, strict=True):
        per_token.extend([value] * (end - start))
        start = end
    return per_token


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
