"""Replay buffer shell: backpressure for producers, blocking sample for the trainer."""

from __future__ import annotations

import asyncio
import time

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.buffer import BufferConfig, ReplayBuffer
from forge_rl.types import Episode


class ReplayBufferActor(Actor):
    def __init__(self, config: BufferConfig):
        self.buffer = ReplayBuffer(config)
        self.trainer_version = 0
        """Version the next sampled batch trains at; staleness is measured against it."""
        self.changed = asyncio.Condition()

    @concurrent_endpoint
    async def put(self, episodes: list[Episode]) -> int:
        """Adds episodes, waiting while the buffer is full; returns how many were too stale to keep."""
        num_stale = 0
        async with self.changed:
            for episode in episodes:
                await self.changed.wait_for(lambda: self.buffer.has_room(episode))
                num_stale += not self.buffer.put(episode, self.trainer_version)
            self.changed.notify_all()
        return num_stale

    @concurrent_endpoint
    async def sample(self, num_episodes: int, trainer_version: int) -> tuple[list[Episode], list[int], float]:
        """Waits until `num_episodes` groups trainable at `trainer_version` are available.

        Returns the batch, the `schedule_version` of each held episode this call evicted as stale
        (the admission gate's bookkeeping), and the seconds it waited for episodes to arrive (the
        train loop's data wait). Episodes that `put` refused meanwhile are not among the evicted:
        `put` reports those to its own caller, and counting them twice would make the admission
        gate admit too much.
        """
        evicted: list[Episode] = []
        waited_s = 0.0
        async with self.changed:
            self.trainer_version = trainer_version
            while True:
                evicted += self.buffer.evict_stale(trainer_version)
                batch = self.buffer.sample(num_episodes, trainer_version)
                if batch is not None:
                    break
                self.changed.notify_all()  # eviction may have freed room for waiting producers
                wait_start = time.perf_counter()
                await self.changed.wait()
                waited_s += time.perf_counter() - wait_start
            self.changed.notify_all()
        return batch, [e.schedule_version for e in evicted], waited_s

    @endpoint
    async def state_dict(self, include_episodes: bool) -> dict:
        """The buffer's tallies, and its held episodes if `include_episodes` (for a checkpoint)."""
        return self.buffer.state_dict(include_episodes)

    @endpoint
    async def load_state_dict(self, state: dict, trainer_version: int) -> list[int]:
        """Restore a checkpoint's buffer; returns the `schedule_version` of each episode it holds now."""
        async with self.changed:
            self.buffer.load_state_dict(state)
            self.trainer_version = trainer_version
            self.changed.notify_all()
        return self.buffer.schedule_versions()

    @endpoint
    async def stats(self) -> dict:
        dropped = self.buffer.dropped
        return {
            "buffer/size": len(self.buffer),
            "buffer/trainer_version": self.trainer_version,
            "buffer/tokens": self.buffer.num_tokens,
            "buffer/dropped_episodes": dropped.episodes,
            "buffer/dropped_completions": dropped.completions,
            "buffer/dropped_tokens": dropped.tokens,
            **dropped.length_metrics("buffer/dropped_"),
            **self.buffer.trained.length_metrics("buffer/trained_"),
        }
