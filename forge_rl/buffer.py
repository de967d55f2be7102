"""The replay buffer: bounded, version-aware, group-preserving. Plain Python (no Monarch).

Invariant: no episode whose oldest token is more than `max_policy_age` versions behind the trainer
ever leaves `sample()`. It is checked where episodes enter (`put`) and again where they leave
(`sample`), because the trainer's version advances while episodes wait. Whatever is dropped is
counted, with its length, since dropping stale work biases training toward short completions.

The buffer never grows past `capacity_episodes`: `put` on a full buffer raises `BufferFull`, and the
actor shell turns that into backpressure (the producer waits for room).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal

from forge_rl.types import Episode


class BufferFull(RuntimeError):
    """Raised by `put` when the buffer holds `capacity_episodes`; the producer must wait."""


@dataclass(frozen=True)
class BufferConfig:
    max_policy_age: int = 1
    """Largest allowed (trainer version - token version) of any trained token. 0 = synchronous RL."""
    capacity_episodes: int = 64
    """Most episodes (prompt groups) held at once; producers are paced when it is full."""
    sampling: Literal["fifo", "freshest"] = "fifo"
    """Which episodes a batch takes first: the oldest (fifo) or the newest (freshest)."""

    def __post_init__(self) -> None:
        if self.max_policy_age < 0:
            raise ValueError(
                f"buffer.max_policy_age ({self.max_policy_age}) must be >= 0. "
                "Use --buffer.max-policy-age 0 for synchronous RL."
            )
        if self.capacity_episodes < 1:
            raise ValueError(
                f"buffer.capacity_episodes ({self.capacity_episodes}) must be >= 1. "
                "Set --buffer.capacity-episodes to at least one step's prompts."
            )


@dataclass
class DropStats:
    """What the staleness bound threw away."""

    episodes: int = 0
    completions: int = 0
    tokens: int = 0
    completion_lengths: list[int] = field(default_factory=list)
    episode_ids: list[int] = field(default_factory=list)


class ReplayBuffer:
    def __init__(self, config: BufferConfig):
        self.config = config
        self._episodes: collections.deque[Episode] = collections.deque()
        self.dropped = DropStats()

    def __len__(self) -> int:
        return len(self._episodes)

    @property
    def num_free_slots(self) -> int:
        return self.config.capacity_episodes - len(self._episodes)

    def is_fresh(self, episode: Episode, trainer_version: int) -> bool:
        return trainer_version - episode.oldest_policy_version <= self.config.max_policy_age

    def put(self, episode: Episode, trainer_version: int) -> bool:
        """Add an episode; returns False if it was already too stale to keep (it is counted)."""
        if not self.is_fresh(episode, trainer_version):
            self._drop(episode)
            return False
        if self.num_free_slots <= 0:
            raise BufferFull(f"replay buffer holds {len(self._episodes)} episodes (its capacity)")
        self._episodes.append(episode)
        return True

    def evict_stale(self, trainer_version: int) -> int:
        """Drop every episode that trainer_version made too old; returns how many."""
        keep = [e for e in self._episodes if self.is_fresh(e, trainer_version)]
        for episode in self._episodes:
            if not self.is_fresh(episode, trainer_version):
                self._drop(episode)
        num_dropped = len(self._episodes) - len(keep)
        self._episodes = collections.deque(keep)
        return num_dropped

    def sample(self, num_episodes: int, trainer_version: int) -> list[Episode] | None:
        """Take `num_episodes` whole groups trainable at `trainer_version`, or None if too few."""
        self.evict_stale(trainer_version)
        if len(self._episodes) < num_episodes:
            return None
        if self.config.sampling == "freshest":
            self._episodes = collections.deque(
                sorted(self._episodes, key=lambda e: e.oldest_policy_version, reverse=True)
            )
        return [self._episodes.popleft() for _ in range(num_episodes)]

    def _drop(self, episode: Episode) -> None:
        self.dropped.episodes += 1
        self.dropped.episode_ids.append(episode.episode_id)
        for completion in episode.completions:
            self.dropped.completions += 1
            self.dropped.tokens += completion.num_tokens
            self.dropped.completion_lengths.append(completion.num_tokens)
