"""Scores completions with a verifier. A reward function that raises marks that completion ERRORED
(counted, never trained) instead of failing the run."""

from __future__ import annotations

import traceback

from monarch.actor import Actor, endpoint

from forge_rl.tasks.synthetic import leading_number_reward
from forge_rl.types import CompletionStatus, Episode


class ScorerActor(Actor):
    def __init__(self) -> None:
        self.reward_fn = leading_number_reward

    @endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        for episode in episodes:
            for completion in episode.completions:
                try:
                    completion.reward = float(self.reward_fn(completion.text, episode.answer))
                except Exception as e:  # any verifier bug: count it, keep the run going
                    completion.status = CompletionStatus.ERRORED
                    completion.error = "".join(traceback.format_exception_only(e)).strip()
        return episodes
