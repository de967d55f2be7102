"""Branch rollouts in the data plane: a sampled group grown into a tree before it is scored
(`forge_rl.core.branches` holds the rules, the branch completions and the tree's credit).
A group of environment episodes grows by forks instead: each forked at the starts of turns,
replayed up to there on a fresh environment (`forge_rl.envs.forks`) and played on.

The rollouts' process calls `Brancher.grow` on each plain group its generator returned; the
branches are sampled on the same generator, so a pivot's prefix is still in its prefix cache
when the weights that encoded it are still served. The tree is one episode from here on: scored,
admitted, buffered, aged and checkpointed as a group is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from forge_rl.core.branches import (
    BranchConfig,
    PivotFunction,
    ReplayDiverged,
    branch_completion,
    fork_completion,
    pick_pivots,
    pick_turn_pivots,
)
from forge_rl.observability import metric_names as m
from forge_rl.tasks.rewards import import_function
from forge_rl.types import Completion, Episode

_logger = logging.getLogger(__name__)

ContinueFn = Callable[[Episode, list[list[int]], int], Awaitable[list[tuple[list[Completion], int]]]]
"""(the group's prompt episode, heads, K) -> per head its K continuations and its prefix-cache hits:
the generator's `generate_branches`."""


ForkFn = Callable[[Completion, int, int], Awaitable[list[Completion]]]
"""(an episode's completion, a turn start in it, K) -> K completions of that episode replayed up
to there and played on from it (ReplayDiverged when a replay does): the rollouts' `_forks`."""


@dataclasses.dataclass
class BranchCounts:
    """Totals since the run (this process) started; reported as `branch/*` metrics."""

    pivots: int = 0
    branches: int = 0
    unbranched: int = 0
    """Completions offered to the rule that got no pivot (they train as plain samples)."""
    pivot_errors: int = 0
    """Completions whose pivot function raised or named a position outside them (unbranched), and
    episode forks whose replay did not reach the episode's state (dropped)."""
    prefix_tokens: int = 0
    """Prompt and head tokens of the branch requests: what a resample from scratch would prefill."""
    prefix_cached_tokens: int = 0
    """Of those, read from the generator's prefix cache (encoded by the weights serving the
    request: the parent's, or with K > 1 the first continuation's, as vLLM counts them)."""
    branch_tokens: int = 0
    """Tokens the branches sampled."""

    def metrics(self) -> dict:
        return {
            m.BRANCH_PIVOTS_TOTAL: self.pivots,
            m.BRANCH_COMPLETIONS_TOTAL: self.branches,
            m.BRANCH_UNBRANCHED_TOTAL: self.unbranched,
            m.BRANCH_PIVOT_ERRORS_TOTAL: self.pivot_errors,
            m.BRANCH_PREFIX_CACHE_HIT_FRACTION: self.prefix_cached_tokens / max(self.prefix_tokens, 1),
            m.BRANCH_TOKENS_TOTAL: self.branch_tokens,
        }


class Brancher:
    """Grows plain groups into trees by `config`'s rule."""

    def __init__(self, config: BranchConfig):
        self.config = config
        self.function: PivotFunction | None = (
            import_function(config.function, "branch.function") if config.function is not None else None
        )
        self.counts = BranchCounts()
        self._warned: set[str] = set()
        """What has failed, and been warned of once."""

    async def grow(self, episode: Episode, continue_from: ContinueFn) -> Episode:
        """`episode` (a sampled group) with its branches: `depth` rounds, each branching the
        completions the round before added (the group's own, first), at the rule's pivots."""
        completions = list(episode.completions)
        frontier = list(range(len(completions)))

        def pick(completion: Completion) -> list[int]:
            return pick_pivots(completion, self.config, episode.prompt_token_ids, self.function)

        for _ in range(self.config.depth):
            forks = [(i, pivot) for i in frontier for pivot in self._pivots(completions[i], pick)]
            if not forks:
                break
            heads = [completions[i].token_ids[:pivot] for i, pivot in forks]
            continued = await continue_from(episode, heads, self.config.branches_per_pivot)
            frontier = []
            for (i, pivot), (pieces, cached) in zip(forks, continued, strict=True):
                self.counts.pivots += 1
                self.counts.prefix_tokens += len(episode.prompt_token_ids) + pivot
                self.counts.prefix_cached_tokens += cached
                for piece in pieces:
                    frontier.append(len(completions))
                    completions.append(branch_completion(completions[i], i, pivot, piece))
                    self.counts.branches += 1
                    self.counts.branch_tokens += piece.num_tokens
        return dataclasses.replace(episode, completions=completions)

    async def fork(self, episode: Episode, play_forks: ForkFn) -> Episode:
        """`episode` (a group of environment episodes) with its forks: K per pivot, the rule's turn
        starts in each completion (`pick_turn_pivots`), all played at once. A fork whose replay
        diverged is dropped with the others of its pivot, counted, and the run goes on."""
        K = self.config.branches_per_pivot

        async def forked(i: int, pivot: int) -> list[Completion]:
            parent = episode.completions[i]
            try:
                played = await play_forks(parent, pivot, K)
                return [fork_completion(parent, i, pivot, p) for p in played]
            except ReplayDiverged as e:
                self._count_error("a fork's replay", e, "that pivot's forks are dropped")
                return []

        forks = [(i, pivot) for i, c in enumerate(episode.completions) for pivot in self._pivots(c, self._turn_pivots)]
        grown = await asyncio.gather(*(forked(i, pivot) for i, pivot in forks))
        completions = list(episode.completions)
        for (_, pivot), branches in zip(forks, grown, strict=True):
            if not branches:
                continue
            self.counts.pivots += 1
            self.counts.branches += len(branches)
            self.counts.branch_tokens += sum(sum(b.generated_mask[pivot:]) for b in branches)
            completions += branches
        return dataclasses.replace(episode, completions=completions)

    def _pivots(self, completion: Completion, pick: Callable[[Completion], list[int]]) -> list[int]:
        try:
            pivots = pick(completion)
        except Exception as e:  # a user's function: that completion stays unbranched, the run goes on
            self._count_error(f"branch.function {self.config.function!r}", e, "that completion trains unbranched")
            return []
        if not pivots:
            self.counts.unbranched += 1
        return pivots

    def _turn_pivots(self, completion: Completion) -> list[int]:
        return pick_turn_pivots(completion, self.config, self.function)

    def _count_error(self, what: str, e: Exception, outcome: str) -> None:
        self.counts.pivot_errors += 1
        if what not in self._warned:
            self._warned.add(what)
            _logger.warning(
                "%s failed (%s: %s): %s, and so on for every later one (counted as %s; this warning is shown once).",
                what,
                type(e).__name__,
                e,
                outcome,
                m.BRANCH_PIVOT_ERRORS_TOTAL,
            )
