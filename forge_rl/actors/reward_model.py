"""Reward-model shell: serves a sequence-classification model (`forge_rl.scoring.reward_model`) on its own
processes, gathering concurrent requests into batches.

`score(texts)` is a concurrent endpoint: every scorer call in flight joins the batcher, and one
forward serves them all. The actor mesh has scorer.reward_model.replicas processes, each a copy of
the model; the scorer reaches them through `LeastBusyReplica(mesh, replicas, "score")`.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.scoring.reward_model import RewardBatcher, RewardModelConfig, SequenceClassifier


class RewardModelActor(Actor):
    def __init__(self, config: RewardModelConfig):
        self.config = config
        self.batcher: RewardBatcher | None = None

    @endpoint
    async def setup(self) -> dict:
        started = time.perf_counter()
        if self.config.path is None:
            raise ValueError(
                "scorer.reward_model.path is unset: there is no reward model to serve. Set --scorer.reward-model.path."
            )
        model = SequenceClassifier(Path(self.config.path), self.config.output, self.config.num_threads)
        self.batcher = RewardBatcher(model.forward, self.config.max_batch_size, self.config.max_wait_ms / 1000)
        return {
            "reward_model_setup_s": time.perf_counter() - started,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    @concurrent_endpoint
    async def score(self, texts: list[str]) -> list[float]:
        """The model's score of each text, in order (NaN stays NaN: the scorer marks it ERRORED)."""
        assert self.batcher is not None  # built by setup, which the scorer's supervisor awaits first
        return await self.batcher.score(texts)

    @endpoint
    async def stats(self) -> dict:
        assert self.batcher is not None  # built by setup, which the scorer's supervisor awaits first
        return {"batches": self.batcher.num_batches, "texts": self.batcher.num_texts}


class LeastBusyReplica:
    """`endpoint` of an actor mesh whose processes are replicas (`procs` dimension): each call goes
    to the replica with the fewest calls in flight, the lowest index among equals. One replica:
    every call goes to it."""

    def __init__(self, mesh, num_replicas: int, endpoint: str):
        self._replicas = [getattr(mesh.slice(procs=i), endpoint) for i in range(num_replicas)]
        self._in_flight = [0] * num_replicas
        self.calls = [0] * num_replicas
        """Calls sent to each replica so far (a running total): how the load spread."""

    def stats(self, prefix: str) -> dict[str, float]:
        """`<prefix>/calls/replica<i>`, each replica's `calls`; nothing for a single replica."""
        if len(self.calls) == 1:
            return {}
        return {f"{prefix}/calls/replica{i}": float(n) for i, n in enumerate(self.calls)}

    async def __call__(self, *args):
        index = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
        self._in_flight[index] += 1
        self.calls[index] += 1
        try:
            return await self._replicas[index].call_one(*args)
        finally:
            self._in_flight[index] -= 1
