"""Scores completions with the task's reward function, run in worker processes (forge_rl/scoring.py).

A reward function that raises, returns a non-finite value, exceeds `scorer.reward_timeout_s` or
crashes its process marks that completion ERRORED (never trained, counted in `stats`), logs the
reason on stderr, and the run goes on. With `scorer.overlong_buffer` set, DAPO's soft overlong
penalty is added to each reward.
"""

from __future__ import annotations

import sys

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.advantages import overlong_penalty
from forge_rl.scoring import RewardResult, RewardWorkerPool, ScorerConfig
from forge_rl.types import CompletionStatus, Episode


class ScorerActor(Actor):
    def __init__(self, config: ScorerConfig = ScorerConfig(), reward: str = "leading_number", max_new_tokens: int = 0):
        self.pool = RewardWorkerPool(reward, config)
        self.overlong_buffer = config.overlong_buffer
        self.max_new_tokens = max_new_tokens
        self.num_scored = 0
        self.num_overlong_penalized = 0
        self.num_errored = 0
        self.num_timed_out = 0
        self._logged_error_kinds: set[str] = set()
        """Error kinds (exception type, timeout, dead worker) already logged: the first of each is
        printed in full, the rest only counted, since a broken verifier fails on every completion."""

    @concurrent_endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """Sets each completion's reward, or its ERRORED status and error; one worker per call."""
        completions = [(c, e.answer) for e in episodes for c in e.completions]
        results = await self.pool.score([(c.text, answer) for c, answer in completions])
        for (completion, _), result in zip(completions, results):
            self.num_scored += 1
            if result.error is None:
                completion.reward = result.reward + self._overlong_penalty(completion.num_tokens)
                continue
            completion.status = CompletionStatus.ERRORED
            completion.error = result.error
            self.num_errored += 1
            self.num_timed_out += result.timed_out
            self._log(result)
        return episodes

    def _overlong_penalty(self, num_tokens: int) -> float:
        if self.overlong_buffer is None:
            return 0.0
        penalty = overlong_penalty(num_tokens, self.max_new_tokens, self.overlong_buffer)
        self.num_overlong_penalized += penalty < 0
        return penalty

    def _log(self, result: RewardResult) -> None:
        if result.error_kind in self._logged_error_kinds:
            return
        self._logged_error_kinds.add(result.error_kind)
        print(
            f"[forge-rl] scorer: completion ERRORED: {result.error} (later {result.error_kind} errors are "
            "counted in completions/errored and scorer/*, not printed)",
            file=sys.stderr,
            flush=True,
        )

    @endpoint
    async def stats(self) -> dict:
        return {
            "scorer/completions": self.num_scored,
            "scorer/errored": self.num_errored,
            "scorer/timed_out": self.num_timed_out,
            "scorer/worker_restarts": self.pool.num_worker_restarts,
            "scorer/overlong_penalized": self.num_overlong_penalized,
        }

    @endpoint
    async def shutdown(self) -> None:
        """Stops the worker processes (they also die with this process)."""
        self.pool.close()
