"""Branch rollouts in the data plane: a sampled group grown into a tree before it is scored
(forge_rl/core/branches.py holds the rules, the branch completions and the tree's credit).

The rollouts' process calls `Brancher.grow` on each plain group its generator returned; the
branches are sampled on the same generator, so a pivot's prefix is still in its prefix cache
when the weights that encoded it are still served. The tree is one episode from here on: scored,
admitted, buffered, aged and checkpointed as a group is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from forge_rl.core.branches import BranchConfig, PivotFunction, branch_completion, pick_pivots
from forge_rl.observability import metrics as m
from forge_rl.tasks.rewards import import_function
from forge_rl.types import Completion, Episode

_logger = logging.getLogger(__name__)

ContinueFn = Callable[[Episode, list[list[int]], int], Awaitable[list[tuple[list[Completion], int]]]]
"""(the group's prompt episode, heads, K) -> per head its K continuations and its prefix-cache hits:
the generator's `generate_branches`."""


@dataclasses.dataclass
class BranchCounts:
    """Totals since the run (this process) started; reported as `branch/*` metrics."""

    pivots: int = 0
    branches: int = 0
    unbranched: int = 0
    """Completions offered to the rule that got no pivot (they train as plain samples)."""
    pivot_errors: int = 0
    """Completions whose pivot function raised or named a position outside them (unbranched)."""
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
        self._warned = False

    async def grow(self, episode: Episode, continue_from: ContinueFn) -> Episode:
        """`episode` (a sampled group) with its branches: `depth` rounds, each branching the
        completions the round before added (the group's own, first), at the rule's pivots."""
        completions = list(episode.completions)
        frontier = list(range(len(completions)))
        for _ in range(self.config.depth):
            forks = [(i, pivot) for i in frontier for pivot in self._pivots(completions[i], episode.prompt_token_ids)]
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

    def _pivots(self, completion: Completion, prompt_token_ids: list[int]) -> list[int]:
        try:
            pivots = pick_pivots(completion, self.config, prompt_token_ids, self.function)
        except Exception as e:  # a user's function: that completion stays unbranched, the run goes on
            self.counts.pivot_errors += 1
            if not self._warned:
                self._warned = True
                _logger.warning(
                    "branch.function %r failed on a completion (%s: %s): that completion trains unbranched, and so "
                    "does every later one it fails on (counted as %s; this warning is shown once).",
                    self.config.function, type(e).__name__, e, m.BRANCH_PIVOT_ERRORS_TOTAL,
                )
            return []
        if not pivots:
            self.counts.unbranched += 1
        return pivots
