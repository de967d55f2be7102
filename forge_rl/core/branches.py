"""Branch rollouts: pivots inside sampled completions, the branches that continue from them, and
credit on the tree they make. Plain Python.

A group starts as G completions of its prompt (the roots' children). A branch continues one of
them from a pivot, a position t of its tokens: its sequence is the parent's tokens before t, held
as context (`Completion.generated` False: they are the parent's to train), then a continuation
sampled afresh from there. K branches per pivot, up to `pivots_per_sample` pivots per completion,
and with `depth` > 1 branches of branches, make the group a tree; it stays one episode, so the
buffer, the admission gate, the age bound, the accounting and checkpoints see it as one unit.

- `BranchConfig`: where and how often to branch.
- `pivot_candidates`, `pick_pivots`: the positions a rule picks in one completion.
- `branch_completion`: a branch's completion from its parent, its pivot and the continuation.
- `turn_starts`, `pick_turn_pivots`, `fork_completion`: the same for environment episodes, whose
  pivots are the starts of turns and whose forks replay the turns before them
  (`forge_rl.envs.forks`).
- `tree_token_advantages`: the credit of every token of a tree (formulas in docs/branches.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from forge_rl.types import Completion, CompletionStatus, Episode

PivotRule = Literal["none", "entropy", "token_prob", "function"]

PivotFunction = Callable[[Completion, list[int]], Iterable[int]]
"""A user's pivot rule (`BranchConfig.function`): (the completion, its prompt's token ids) ->
positions in the completion's tokens to branch from."""

_STD_EPS = 1e-6
"""As core/advantages.py's: a tree whose leaves all score the same gets advantage 0."""


@dataclass(frozen=True)
class BranchConfig:
    """Branch rollouts (docs/branches.md). `rule: none` (the default) samples plain groups."""

    rule: PivotRule = "none"
    """Where a completion is branched: entropy (the positions whose sampled distribution had the
    highest entropy, estimated from the `entropy_top_logprobs` most likely tokens), token_prob (the
    sampled tokens of lowest probability), function (`function` picks them), none (no branching)."""
    pivots_per_sample: int = 1
    """At most this many pivots per completion, the highest-scoring first."""
    branches_per_pivot: int = 2
    """K: continuations sampled from each pivot."""
    depth: int = 1
    """Rounds of branching: 1 branches the group's completions; 2 also branches those branches
    (each only after its own pivot); and so on."""
    threshold: float | None = None
    """A position is a pivot only past it: entropy at least `threshold` nats (entropy), sampled
    token probability at most `threshold` (token_prob). None: no bar, the best positions are taken."""
    min_prefix_tokens: int = 1
    """A pivot leaves at least this many tokens of the completion's own before it."""
    min_suffix_tokens: int = 1
    """A pivot leaves at least this many tokens of the completion after it (the pivot's token
    included): a pivot at the very end would resample almost nothing."""
    function: str | None = None
    """rule function: 'package.module:function' called as f(completion, prompt_token_ids) and
    returning positions in `completion.token_ids`; one that raises or returns a position outside
    the completion's own tokens leaves that completion unbranched, and is counted."""
    entropy_top_logprobs: int = 20
    """rule entropy: the most likely tokens per position whose (renormalized) distribution gives
    the entropy; exact when the sampler's kept set fits in them (top_k <= this)."""

    def __post_init__(self) -> None:
        if self.rule not in ("none", "entropy", "token_prob", "function"):
            raise ValueError(
                f"branch.rule ({self.rule!r}) must be none, entropy, token_prob or function. Set --branch.rule."
            )
        for name in (
            "pivots_per_sample",
            "branches_per_pivot",
            "depth",
            "min_prefix_tokens",
            "min_suffix_tokens",
            "entropy_top_logprobs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"branch.{name} ({getattr(self, name)}) must be >= 1. Set --branch.{name.replace('_', '-')}."
                )
        if (self.rule == "function") != (self.function is not None):
            raise ValueError(
                f"branch.function ({self.function!r}) is set exactly when branch.rule is function ({self.rule!r}). "
                "Set both (--branch.rule function --branch.function package.module:function) or neither."
            )
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ValueError(f"branch.threshold ({self.threshold}) must be finite, or unset. Set --branch.threshold.")
        if self.rule == "token_prob" and self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ValueError(
                f"branch.threshold ({self.threshold}) is a token probability with rule token_prob: it must be in (0, 1]. "
                "Set --branch.threshold."
            )

    @property
    def enabled(self) -> bool:
        return self.rule != "none"

    def max_completions_per_group(self, group_size: int) -> int:
        """Most completions a tree of `group_size` roots can hold: each round adds at most
        pivots_per_sample x branches_per_pivot branches to every completion of the round before."""
        fan_out = self.pivots_per_sample * self.branches_per_pivot if self.enabled else 0
        return group_size * sum(fan_out**round_ for round_ in range(self.depth + 1 if self.enabled else 1))


def pivot_candidates(completion: Completion, config: BranchConfig) -> range:
    """The positions of `completion` a pivot may take: within its own sampled tokens (after its
    own pivot, for a branch), `min_prefix_tokens` in and `min_suffix_tokens` before the end."""
    return range(completion.fork_at + config.min_prefix_tokens, completion.num_tokens - config.min_suffix_tokens + 1)


def pick_pivots(
    completion: Completion, config: BranchConfig, prompt_token_ids: list[int], function: PivotFunction | None = None
) -> list[int]:
    """Where to branch `completion`, in increasing order: the `pivots_per_sample` candidates that
    score highest under the rule and pass its threshold (ties: the earliest). None found: [].
    A `function` rule's positions are taken as given (deduplicated, at most pivots_per_sample);
    ValueError when it names a position that is no candidate (the caller counts it)."""
    candidates = pivot_candidates(completion, config)
    if not candidates or completion.status == CompletionStatus.ERRORED:
        return []
    if config.rule == "function":
        if function is None:
            raise ValueError("branch.rule function needs the function itself (the caller resolves branch.function)")
        chosen = sorted({int(t) for t in function(completion, prompt_token_ids)})
        outside = [t for t in chosen if t not in candidates]
        if outside:
            raise ValueError(
                f"branch.function {config.function!r} returned positions {outside[:5]} outside the completion's "
                f"candidates {candidates.start}..{candidates.stop - 1} (its own tokens, min_prefix_tokens and "
                "min_suffix_tokens in from its ends)"
            )
        return chosen[: config.pivots_per_sample]
    if config.rule == "entropy":
        if completion.entropies is None:
            raise ValueError("branch.rule entropy needs Completion.entropies: the generator records them with it")
        scores = completion.entropies
        passes = (lambda s: True) if config.threshold is None else (lambda s: s >= config.threshold)
    elif config.rule == "token_prob":
        scores = [-lp for lp in completion.logprobs]  # surprise: -log p, highest for the least likely token
        bar = None if config.threshold is None else -math.log(config.threshold)
        passes = (lambda s: True) if bar is None else (lambda s: s >= bar)
    else:
        return []
    ranked = sorted((t for t in candidates if passes(scores[t])), key=lambda t: (-scores[t], t))
    return sorted(ranked[: config.pivots_per_sample])


def branch_completion(parent: Completion, parent_index: int, pivot: int, piece: Completion) -> Completion:
    """The branch that continues `parent` (completion `parent_index` of its group) from `pivot`
    with `piece` (the continuation as sampled, its text already the whole sequence's). The
    parent's tokens before the pivot are context here, as the prompt is: trained once, in the
    parent, with the credit that belongs to them (`tree_token_advantages`). Each continuation
    token keeps the versions the engine recorded: the one that sampled it, and in `kv_versions`
    the oldest weights whose KV it attended to (the prefix's KV was reused only if encoded by the
    weights serving the request, and encoded afresh otherwise: engines/vllm_engine.py `prompt`)."""
    if not parent.fork_at <= pivot < parent.num_tokens:
        raise ValueError(f"pivot {pivot} is outside the parent's own tokens [{parent.fork_at}, {parent.num_tokens})")
    first_version = piece.policy_versions[0] if piece.policy_versions else parent.policy_versions[pivot]
    support: list[list[int]] | None = None
    if piece.sampling_support is not None:
        support = [[] for _ in range(pivot)] + piece.sampling_support
    kv = None if piece.kv_versions is None else [first_version] * pivot + piece.kv_versions
    entropies = None if piece.entropies is None else [0.0] * pivot + piece.entropies
    return Completion(
        parent.token_ids[:pivot] + piece.token_ids,
        [0.0] * pivot + piece.logprobs,
        # A context token carries the version of the generated token after it (Completion.generated).
        [first_version] * pivot + piece.policy_versions,
        text=piece.text,
        status=piece.status,
        sampling_support=support,
        num_truncated_support=piece.num_truncated_support,
        generated=[False] * pivot + [True] * piece.num_tokens,
        kv_versions=kv,
        entropies=entropies,
        parent=parent_index,
        fork_at=pivot,
    )


def turn_starts(completion: Completion) -> list[int]:
    """Where each of an environment trajectory's turns starts in its completion: the first token
    of every run of generated tokens (a turn is followed by the environment's observation, context)."""
    generated = completion.generated or [True] * completion.num_tokens
    return [t for t, g in enumerate(generated) if g and (t == 0 or not generated[t - 1])]


def pick_turn_pivots(completion: Completion, config: BranchConfig, function: PivotFunction | None = None) -> list[int]:
    """Where to fork an environment episode's completion, in increasing order: the starts of its
    turns after the first (a fork there replays the turns before it and samples that turn afresh),
    the `pivots_per_sample` that score highest: a turn scores its least likely sampled token's
    surprise (-log p, rule token_prob; `threshold` bars it as a probability); a `function` rule's
    positions are taken as given, and must be turn starts (ValueError otherwise, the caller counts
    it). No pivot where the turns cannot be told apart (a turn not followed by context)."""
    starts = turn_starts(completion)
    if completion.status == CompletionStatus.ERRORED or len(starts) != completion.num_turns:
        return []
    candidates = starts[1:]
    if not candidates:
        return []
    if config.rule == "function":
        if function is None:
            raise ValueError("branch.rule function needs the function itself (the caller resolves branch.function)")
        chosen = sorted({int(t) for t in function(completion, [])})
        outside = [t for t in chosen if t not in candidates]
        if outside:
            raise ValueError(
                f"branch.function {config.function!r} returned positions {outside[:5]} that start no turn but the "
                f"first: an environment episode forks at the start of a turn ({candidates[:5]})"
            )
        return chosen[: config.pivots_per_sample]
    if config.rule != "token_prob":
        raise ValueError(
            f"branch.rule {config.rule} picks no turn of an environment episode (token_prob or function do)"
        )
    ends = starts[1:] + [completion.num_tokens]
    generated = completion.generated or [True] * completion.num_tokens
    scores = {
        start: max(-completion.logprobs[t] for t in range(start, end) if generated[t])
        for start, end in zip(starts, ends)
        if start in candidates
    }
    bar = None if config.threshold is None else -math.log(config.threshold)
    ranked = sorted((t for t in candidates if bar is None or scores[t] >= bar), key=lambda t: (-scores[t], t))
    return sorted(ranked[: config.pivots_per_sample])


class ReplayDiverged(Exception):
    """An episode fork's replay did not come back to the episode's state: the environment answered
    a replayed turn otherwise, or ended the episode before the pivot (`forge_rl.envs.forks`)."""


def fork_completion(parent: Completion, parent_index: int, pivot: int, played: Completion) -> Completion:
    """A fork of environment episode `parent` (completion `parent_index` of its group) at turn
    start `pivot`, from `played`: the completion of the episode replayed up to the pivot and played
    on from there. Its tokens before the pivot must be the parent's (the replay reached the same
    state; ReplayDiverged naming the first difference otherwise) and become context, as a branch's
    prefix is (`branch_completion`); what follows is its own, with its reward, turns and status."""
    if played.token_ids[:pivot] != parent.token_ids[:pivot]:
        differs = next(
            (t for t, (a, b) in enumerate(zip(played.token_ids, parent.token_ids)) if a != b), len(played.token_ids)
        )
        raise ReplayDiverged(
            f"the replayed episode differs from the one it forks at token {differs} (of the {pivot} before the "
            "pivot): the environment did not come back to the same state"
        )
    if played.num_tokens <= pivot:
        raise ReplayDiverged(f"the forked episode ended before its pivot ({played.num_tokens} tokens, pivot {pivot})")
    generated = played.generated or [True] * played.num_tokens
    first_version = next(
        (v for v, g in zip(played.policy_versions[pivot:], generated[pivot:]) if g), played.policy_versions[pivot]
    )
    support: list[list[int]] | None = None
    if played.sampling_support is not None:
        support = [[] for _ in range(pivot)] + played.sampling_support[pivot:]
    return dataclasses.replace(
        played,
        logprobs=[0.0] * pivot + played.logprobs[pivot:],
        policy_versions=[first_version] * pivot + played.policy_versions[pivot:],
        generated=[False] * pivot + generated[pivot:],
        sampling_support=support,
        kv_versions=None if played.kv_versions is None else [first_version] * pivot + played.kv_versions[pivot:],
        parent=parent_index,
        fork_at=pivot,
    )


def is_tree(episode: Episode) -> bool:
    return any(c.parent is not None for c in episode.completions)


def tree_token_advantages(episode: Episode, normalize_std: bool, local_weight: float) -> list[list[float]]:
    """Per completion of a branched group, the advantage of each of its tokens, [N][T].

    A completion's own tokens (after its pivot, for a branch) are cut into segments at the
    pivots its branches took. V(s), a segment's value, is the mean reward of the leaves that
    share it: the completion itself and every branch (with its own branches) forking at or after
    the segment's end. A token of segment s gets

        A(s) = (V(s) - mu) / sigma + local_weight * (V(s) - V(parent(s))) / sigma

    mu: the mean over the group's G root completions of V(their first segment) (each root's
    subtree counted once, as GRPO counts each sample once); sigma: the standard deviation of the
    rewards of all usable leaves (+ eps; 1 without `normalize_std`); parent(s): the segment just
    before s's fork (the same completion's previous segment, or the parent's segment ending at a
    branch's pivot). A root's first segment has no fork above it but the prompt: its local term
    is 0, so a group without branches gets GRPO's advantages. The local term is DEEP-GRPO's and
    TreeRL's local advantage: a continuation judged against its siblings at the same pivot. Context
    tokens (a branch's copy of its parent's prefix) get 0; ERRORED completions get zeros and are
    no leaves. Step and dense rewards are `core/advantages.py`'s to add (`token_advantages`)."""
    completions = episode.completions
    usable = {i for i, c in enumerate(completions) if c.status != CompletionStatus.ERRORED}
    rewards = {i: completions[i].reward for i in usable}
    result = [[0.0] * c.num_tokens for c in completions]
    if not usable or max(rewards.values()) == min(rewards.values()):
        return result
    children: dict[int, list[int]] = {}
    for i, completion in enumerate(completions):
        if completion.parent is not None:
            if not 0 <= completion.parent < len(completions) or completions[completion.parent].parent == i:
                raise ValueError(
                    f"completion {i}'s parent ({completion.parent}) is not another completion of its group"
                )
            children.setdefault(completion.parent, []).append(i)

    subtree_cache: dict[int, list[int]] = {}

    def subtree(i: int) -> list[int]:
        if i not in subtree_cache:
            subtree_cache[i] = [i] + [leaf for c in children.get(i, ()) for leaf in subtree(c)]
        return subtree_cache[i]

    def boundaries(i: int) -> list[int]:
        """Start of each segment of completion i's own tokens."""
        forks = {completions[c].fork_at for c in children.get(i, ())}
        return [completions[i].fork_at] + sorted(f for f in forks if f > completions[i].fork_at)

    def value(i: int, end: int) -> float | None:
        """Mean reward of the usable leaves sharing completion i's tokens before `end`."""
        leaves = [i] + [leaf for c in children.get(i, ()) if completions[c].fork_at >= end for leaf in subtree(c)]
        scored = [rewards[leaf] for leaf in leaves if leaf in usable]
        return math.fsum(scored) / len(scored) if scored else None

    roots = [i for i, c in enumerate(completions) if c.parent is None]
    root_values = [v for v in (value(i, _first_end(boundaries(i), completions[i])) for i in roots) if v is not None]
    mu = math.fsum(root_values) / len(root_values)
    leaf_rewards = list(rewards.values())
    mean = math.fsum(leaf_rewards) / len(leaf_rewards)
    sigma = (
        math.sqrt(math.fsum((r - mean) ** 2 for r in leaf_rewards) / len(leaf_rewards)) + _STD_EPS
        if normalize_std
        else 1.0
    )

    for i in usable:
        completion = completions[i]
        starts = boundaries(i)
        ends = starts[1:] + [completion.num_tokens]
        previous = None  # V of the segment before this one in the same completion
        if completion.parent is not None:  # the parent's segment that ends at this branch's pivot
            previous = value(completion.parent, completion.fork_at)
        for start, end in zip(starts, ends):
            v = value(i, end)
            assert v is not None  # i is usable and one of the leaves sharing its tokens
            advantage = (v - mu) / sigma
            if previous is not None:
                advantage += local_weight * (v - previous) / sigma
            result[i][start:end] = [advantage] * (end - start)
            previous = v
    return result


def _first_end(starts: list[int], completion: Completion) -> int:
    return starts[1] if len(starts) > 1 else completion.num_tokens


def token_entropies(position_logprobs: Iterable[Iterable[float]]) -> list[float]:
    """Per position, the entropy in nats of the distribution given by the logprobs returned for
    it (the most likely tokens, renormalized; -inf entries, filtered by top-k/top-p, left out)."""
    out = []
    for logprobs in position_logprobs:
        finite = [lp for lp in logprobs if lp > -math.inf]
        if not finite:
            out.append(0.0)
            continue
        top = max(finite)
        weights = [math.exp(lp - top) for lp in finite]
        total = math.fsum(weights)
        out.append(-math.fsum(w / total * ((lp - top) - math.log(total)) for w, lp in zip(weights, finite)))
    return out
