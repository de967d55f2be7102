"""Advantage estimators and reward shaping. Plain Python.

- `group_advantages`: GRPO's group baseline, with (GRPO, DAPO, GSPO, CISPO) or without (Dr. GRPO)
  division by the group's standard deviation.
- `episode_advantages`: the same for one `Episode`, leaving ERRORED completions out of the statistics.
- `completion_reward`: what a completion's group advantage is computed from.
- `token_advantages`: per-token advantages of one `Episode`: its group advantage plus process
  rewards (per step, per turn) and dense per-token rewards; the formula is in docs/scoring.md. A
  branched group (`forge_rl.core.branches`) gets its tree's credit instead (docs/branches.md).
- `is_plain`: whether one advantage per completion says it all (no steps, dense rewards or branches).
- `has_signal`, `DynamicSampling`: DAPO's dynamic sampling, which
  keeps only groups with a nonzero advantage on a token that trains, and stops a run that finds none.
- `overlong_penalty`: DAPO's soft penalty for completions that run into the length budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from forge_rl.core.branches import is_tree, tree_token_advantages
from forge_rl.errors import NoLearningSignal
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
    cost more than the whole batch's padding.
    """
    rewards = [float(r) for r in rewards_G]
    if max(rewards) == min(rewards):  # exactly 0: the float mean of equal values need not equal them
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / len(centered))
    return [c / (std + _STD_EPS) for c in centered]


def completion_reward(completion: Completion) -> float:
    """The reward a completion's group advantage is computed from: its final reward (a single-turn
    completion's score, an environment episode's closing reward). Per-turn rewards of a multi-turn
    episode are process rewards on top of it (`forge_rl.envs.rollout.turn_steps`, then
    `token_advantages`)."""
    return completion.reward


def baseline_groups(episode: Episode) -> list[list[int]]:
    """The completions of `episode` by `Completion.baseline_group`, as index lists in order of first
    appearance: one list of all of them for a single-agent group (GRPO's), one per seat (or per
    seat and episode) for a multi-agent one (`forge_rl.envs.graph`)."""
    groups: dict[str | None, list[int]] = {}
    for index, completion in enumerate(episode.completions):
        groups.setdefault(completion.baseline_group, []).append(index)
    return list(groups.values())


def episode_advantages(episode: Episode, normalize_std: bool) -> list[float]:
    """One advantage per completion of `episode`, in order, each against the completions of its
    baseline group (`baseline_groups`: the whole group unless agents of a multi-agent episode name
    their own): A_i = (r_i - mean_B r) / (std_B r + eps), B the usable completions of i's baseline
    group. ERRORED completions get 0 and are left out of the mean and std (their reward is not a
    measurement). Completions whose tokens are all untrainable still count: their reward is a valid
    sample for the baseline."""
    result = [0.0] * len(episode.completions)
    for indices in baseline_groups(episode):
        usable = [i for i in indices if episode.completions[i].status != CompletionStatus.ERRORED]
        if not usable:
            continue
        advantages = group_advantages([completion_reward(episode.completions[i]) for i in usable], normalize_std)
        for i, advantage in zip(usable, advantages):
            result[i] = advantage
    return result


def is_plain(episode: Episode) -> bool:
    """True when every token of a completion gets its completion's group advantage: no step or
    dense rewards and no branches in the group."""
    return all(c.step_rewards is None and c.token_rewards is None and c.parent is None for c in episode.completions)


def token_advantages(
    episode: Episode, normalize_std: bool, step_discount: float = 1.0, local_weight: float = 1.0
) -> list[list[float]]:
    """Per completion of `episode`, the advantage of each of its tokens, [G][T]:

        A_it = A_i + sum_{k >= k(t)} step_discount^(k - k(t)) * r~_ik + d_it

    A_i is the completion's group advantage (`episode_advantages`); k(t) is the step holding token
    t; r~_ik = (r_ik - mean(R)) / (std(R) + eps), R being every step reward of the usable
    completions of its baseline group (centered only when not `normalize_std`), so a step is judged
    against the steps of its group, as DeepSeekMath's GRPO with process supervision does (Shao et
    al. 2024, Sec. 4.1.3, step_discount = 1: a token is credited with its own step and every later
    one); step_discount = 0 credits a token with its own step only. d_it is the token's dense
    reward (`token_rewards`), unnormalized (a teacher's per-token log ratio is already on a
    per-token scale). Without step or token rewards A_it = A_i: plain GRPO. A turn of a multi-turn
    episode is a step. ERRORED completions get zeros. Worked example and reasoning: docs/scoring.md.

    In a branched group (its completions continue one another from pivots) A_it is the tree's
    credit of token t's segment instead (`tree_token_advantages`, `local_weight` its local term's
    weight), and step and dense rewards add to it as above."""
    if not 0.0 <= step_discount <= 1.0:
        raise ValueError(f"step_discount ({step_discount}) must be in [0, 1]")
    completions = episode.completions
    tree = tree_token_advantages(episode, normalize_std, local_weight) if is_tree(episode) else None
    normalized_steps: dict[int, list[float]] = {}
    for indices in baseline_groups(episode):
        usable = [i for i in indices if completions[i].status != CompletionStatus.ERRORED]
        step_rewards = [r for i in usable for r in completions[i].step_rewards or ()]
        normalized = iter(group_advantages(step_rewards, normalize_std) if step_rewards else ())
        for i in usable:
            normalized_steps[i] = [next(normalized) for _ in completions[i].step_rewards or ()]
    result = []
    for i, (completion, advantage) in enumerate(zip(completions, episode_advantages(episode, normalize_std))):
        if completion.status == CompletionStatus.ERRORED:
            result.append([0.0] * completion.num_tokens)
            continue
        steps = normalized_steps[i]
        per_token = [advantage] * completion.num_tokens if tree is None else tree[i]
        if steps:
            assert completion.step_ends is not None  # set with step_rewards (Completion.__post_init__ checks)
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


def has_signal(
    episode: Episode, normalize_std: bool = True, step_discount: float = 1.0, local_weight: float = 1.0
) -> bool:
    """True when some token that trains (`Completion.loss_mask`: generated, trainable, not ERRORED)
    has a nonzero advantage (`token_advantages`, with the loss's `normalize_std` and
    `step_discount`, and a tree's `local_weight`): the group moves the policy. The signal may be
    in the final rewards, in step
    or turn rewards, or in dense token rewards (a teacher's). A group whose values are all equal
    gets advantages of exactly 0 (`group_advantages`), so float rounding of a mean never passes
    for a signal."""
    if is_plain(episode):
        advantages = episode_advantages(episode, normalize_std)
        return any(a != 0.0 and c.num_trainable_tokens for a, c in zip(advantages, episode.completions))
    per_completion = token_advantages(episode, normalize_std, step_discount, local_weight)
    return any(
        a != 0.0 and trains
        for completion, per_token in zip(episode.completions, per_completion)
        for a, trains in zip(per_token, completion.loss_mask)
    )


class DynamicSampling:
    """DAPO's dynamic sampling (Yu et al. 2025, Sec. 3.2) for a run: keeps the groups with a signal
    (`has_signal`), order preserved, since a group whose every trained token has a zero advantage
    would only dilute the batch (the caller keeps sampling until it has a full batch of kept groups,
    and accounts for the filtered ones); and stops the run when no group has a signal for
    `max_filtered_steps` steps' worth of groups in a row (that many times `prompts_per_step`):
    no batch can then be filled, and the trainer would wait for one forever. A group with a signal
    starts the count again. Raises NoLearningSignal naming the cause and the fixes."""

    def __init__(
        self,
        max_filtered_steps: int,
        prompts_per_step: int,
        normalize_std: bool = True,
        step_discount: float = 1.0,
        local_weight: float = 1.0,
    ):
        self.max_filtered_steps = max_filtered_steps
        self.max_filtered_groups = max_filtered_steps * prompts_per_step
        self.normalize_std, self.step_discount, self.local_weight = normalize_std, step_discount, local_weight
        self.num_filtered_in_a_row = 0

    def filter(self, episodes: list[Episode]) -> list[Episode]:
        """The groups of `episodes` with a signal, in order; those left out are filtered."""
        kept = []
        for episode in episodes:
            if has_signal(episode, self.normalize_std, self.step_discount, self.local_weight):
                kept.append(episode)
                self.num_filtered_in_a_row = 0
                continue
            self.num_filtered_in_a_row += 1
            if self.num_filtered_in_a_row >= self.max_filtered_groups:
                raise NoLearningSignal(self._message(episode))
        return kept

    def _message(self, last: Episode) -> str:
        return (
            f"dynamic_sampling filtered the last {self.num_filtered_in_a_row} groups in a row "
            f"(dynamic_sampling_max_filtered_steps {self.max_filtered_steps} steps' worth): none had a nonzero "
            "advantage on a token that trains, so no batch can be filled and the run stopped instead of waiting. "
            f"The last one held {describe_signal(last)}. The reward carries no contrast within a group: a task "
            "solved or hopeless for this policy, scorer.reward_fn_weight 0 with no other scorer's spread, or a "
            "teacher that agrees with the policy token for token (a pinned teacher starts as the policy itself). "
            "Set --no-dynamic-sampling to train on such groups anyway, give the reward a spread (another task, "
            "--scorer.reward-fn-weight, a teacher that differs), or raise --dynamic-sampling-max-filtered-steps "
            "if groups with a signal are only rare."
        )


def describe_signal(episode: Episode) -> str:
    """What a group's advantages are made of, in words: its final rewards, step and token rewards."""
    usable = [c for c in episode.completions if c.status != CompletionStatus.ERRORED]
    rewards = sorted({completion_reward(c) for c in usable})
    parts = [
        f"{len(usable)} usable of {len(episode.completions)} completions",
        f"final rewards all {rewards[0]:g}"
        if len(rewards) == 1
        else f"final rewards {[f'{r:g}' for r in rewards[:4]]}",
    ]
    steps = {r for c in usable for r in c.step_rewards or ()}
    parts.append(
        "no step rewards" if not steps else f"step rewards {'all equal' if len(steps) == 1 else 'that differ'}"
    )
    dense = [abs(r) for c in usable for r, trains in zip(c.token_rewards or (), c.loss_mask) if trains]
    has_dense = any(c.token_rewards is not None for c in usable)
    parts.append(
        "no token rewards" if not has_dense else f"token rewards of at most {max(dense, default=0.0):g} in size"
    )
    return ", ".join(parts)


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
