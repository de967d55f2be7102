"""What runs a scorer on a run's episodes (`ScoreWriter`): the scores written onto the completions,
every failure turned into an ERRORED completion with its reason and counted, never raised."""

from __future__ import annotations

import asyncio
import sys

from forge_rl.core.advantages import overlong_penalty
from forge_rl.scoring.scorers import Score, ScoreFailure, Scorer, guarded_group
from forge_rl.scoring.teacher import center_on_group
from forge_rl.types import Completion, CompletionStatus, Episode


def _center_token_rewards(episode: Episode) -> None:
    """The group baseline of dense rewards (`center_on_group`), taken over the usable completions
    only: an ERRORED completion is never trained, so its rewards are no baseline for the others."""
    usable = [c for c in episode.completions if c.status != CompletionStatus.ERRORED and c.token_rewards is not None]
    centered = center_on_group(
        [c.token_rewards for c in usable if c.token_rewards is not None], [c.generated_mask for c in usable]
    )
    for completion, rewards in zip(usable, centered):
        completion.token_rewards = rewards


class ScoreWriter:
    """Runs a scorer on a run's episodes and writes the outcome onto their completions: reward
    (plus DAPO's overlong penalty when `overlong_buffer` is set), components, step and token
    rewards, or ERRORED with the reason; a completion that arrives ERRORED (an environment's
    error) is left as it is, never scored. With `token_baseline` "group" (scorer.teacher.baseline),
    each group's token rewards, every scorer's added up, are then centered on the group's other
    usable completions (`center_on_group`). Counts what it did (`stats`)."""

    def __init__(
        self, scorer: Scorer, overlong_buffer: int | None = None, max_new_tokens: int = 0, token_baseline: str = "none"
    ):
        if token_baseline not in ("group", "none"):
            raise ValueError(f"token_baseline ({token_baseline!r}) must be 'group' or 'none'")
        self.scorer = scorer
        self.overlong_buffer = overlong_buffer
        self.max_new_tokens = max_new_tokens
        self.token_baseline = token_baseline
        self.num_scored = 0
        self.num_overlong_penalized = 0
        self.num_errored = 0
        self.num_timed_out = 0
        self._logged_error_kinds: set[str] = set()
        """Failure kinds already printed: the first of each in full, the rest only counted, since a
        broken verifier fails on every completion."""

    async def score(self, episodes: list[Episode]) -> list[Episode]:
        groups = await asyncio.gather(*(guarded_group(self.scorer, e) for e in episodes))
        for episode, results in zip(episodes, groups):
            for completion, result in zip(episode.completions, results):
                if completion.status == CompletionStatus.ERRORED:  # never trained: its error stays
                    continue
                self.num_scored += 1
                if isinstance(result, ScoreFailure):
                    self._fail(completion, result)
                else:
                    self._apply(completion, result)
            if self.token_baseline == "group":
                _center_token_rewards(episode)
        return episodes

    def _apply(self, completion: Completion, score: Score) -> None:
        completion.reward = score.reward + self._overlong_penalty(completion.num_tokens)
        completion.reward_components = dict(score.components)
        completion.step_ends = None if score.step_ends is None else list(score.step_ends)
        completion.step_rewards = None if score.step_rewards is None else list(score.step_rewards)
        completion.token_rewards = None if score.token_rewards is None else list(score.token_rewards)

    def _fail(self, completion: Completion, failure: ScoreFailure) -> None:
        completion.status = CompletionStatus.ERRORED
        completion.error = failure.error
        self.num_errored += 1
        self.num_timed_out += failure.timed_out
        if failure.kind not in self._logged_error_kinds:
            self._logged_error_kinds.add(failure.kind)
            print(
                f"[forge-rl] scorer: completion ERRORED: {failure.error} (later {failure.kind} errors are "
                "counted in completions/errored and scorer/*, not printed)",
                file=sys.stderr,
                flush=True,
            )

    def _overlong_penalty(self, num_tokens: int) -> float:
        if self.overlong_buffer is None:
            return 0.0
        penalty = overlong_penalty(num_tokens, self.max_new_tokens, self.overlong_buffer)
        self.num_overlong_penalized += penalty < 0
        return penalty

    def stats(self) -> dict[str, float]:
        return {
            "scorer/completions": self.num_scored,
            "scorer/errored": self.num_errored,
            "scorer/timed_out": self.num_timed_out,
            "scorer/overlong_penalized": self.num_overlong_penalized,
            **{f"scorer/{key}": value for key, value in self.scorer.stats().items()},
        }

    def close(self) -> None:
        self.scorer.close()
