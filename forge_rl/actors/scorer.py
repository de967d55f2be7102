"""Scores completions: the actor shell around forge_rl/scorers.py's `ScoringStage`.

Today's scorer is the task's reward function, run in sandboxed worker processes
(`RewardFunctionScorer`). A reward function that raises, returns a non-finite value, exceeds
`scorer.reward_timeout_s` or crashes its process marks that completion ERRORED (never trained,
counted in `stats`), logs the reason on stderr, and the run goes on. With `scorer.overlong_buffer`
set, DAPO's soft overlong penalty is added to each reward.
"""

from __future__ import annotations

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.scorers import RewardFunctionScorer, ScoringStage
from forge_rl.scoring import ScorerConfig
from forge_rl.types import Episode


class ScorerActor(Actor):
    def __init__(self, config: ScorerConfig = ScorerConfig(), reward: str = "leading_number", max_new_tokens: int = 0):
        self.stage = ScoringStage(RewardFunctionScorer(reward, config), config.overlong_buffer, max_new_tokens)

    @concurrent_endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """Sets each completion's reward (and its components, step and token rewards), or its
        ERRORED status and error."""
        return await self.stage.score(episodes)

    @endpoint
    async def stats(self) -> dict:
        return self.stage.stats()

    @endpoint
    async def shutdown(self) -> None:
        """Stops the scorers' processes (reward workers also die with this process)."""
        self.stage.close()
