"""Reward-model shell: serves a sequence-classification model (forge_rl/reward_model.py) on its own
processes, gathering concurrent requests into batches.

`score(texts)` is a concurrent endpoint: every scorer call in flight joins the batcher, and one
forward serves them all. The scorer reaches it through `RewardModelScorer(client=actor.score.call_one)`.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.reward_model import RewardBatcher, RewardModelConfig, SequenceClassifier


class RewardModelActor(Actor):
    def __init__(self, config: RewardModelConfig):
        self.config = config
        self.batcher: RewardBatcher | None = None

    @endpoint
    async def setup(self) -> dict:
        started = time.perf_counter()
        model = SequenceClassifier(Path(self.config.path), self.config.output, self.config.num_threads)
        self.batcher = RewardBatcher(model.forward, self.config.max_batch_size, self.config.max_wait_ms / 1000)
        return {"reward_model_setup_s": time.perf_counter() - started, "pid": os.getpid(), "hostname": socket.gethostname()}

    @concurrent_endpoint
    async def score(self, texts: list[str]) -> list[float]:
        """The model's score of each text, in order (NaN stays NaN: the scorer marks it ERRORED)."""
        return await self.batcher.score(texts)

    @endpoint
    async def stats(self) -> dict:
        return {"batches": self.batcher.num_batches, "texts": self.batcher.num_texts}
