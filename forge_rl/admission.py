"""Admission control: start a rollout only if its episodes can be trained within the age bound,
and only if the buffer will have room for them.

Episodes are trained in the order they were handed out (FIFO), `episodes_per_step` at a time, so
the j-th queued episode will be trained at version `next_train_version + j // episodes_per_step`.
A rollout of `num_new_episodes` generated under `generator_version` is admitted only if the last of
its episodes will then be at most `max_policy_age` versions old. Pausing generation here, instead of
generating and dropping, keeps long completions from being starved (they are the ones a drop would
hit). The buffer still enforces the bound on its own; this gate only avoids wasted work.

Completions finish out of order, so a slow episode can be overtaken by later ones and miss the last
batch that may train it. The train loop therefore also waits (`batch_may_be_sampled`) until every
episode that the coming step is the last chance for has reached the buffer, and the buffer serves
the stalest episodes first. Together: nothing the gate admitted is ever dropped.

That wait must never wait on the buffer itself: an episode that finished but cannot enter a full
buffer is still in flight, and the trainer would wait for it while it waits for the trainer. So the
gate never admits more episodes than the buffer can hold (`max_episodes_queued`, derived in
`GRPOConfig.max_episodes_queued` from the buffer's episode and token capacities): a `put` of an
admitted episode always finds room, by construction.

With `admission="drop"` only that capacity bound applies: generation never waits for the age
bound, and the buffer drops what grows too old (counted, with its lengths).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Literal


def rollout_may_start(
    generator_version: int,
    next_train_version: int,
    num_episodes_queued: int,
    num_new_episodes: int,
    episodes_per_step: int,
    max_policy_age: int,
) -> bool:
    last_position = num_episodes_queued + num_new_episodes - 1
    train_version_of_last = next_train_version + last_position // episodes_per_step
    return train_version_of_last - generator_version <= max_policy_age


def batch_may_be_sampled(in_flight_versions: dict[int, int], train_version: int, max_policy_age: int) -> bool:
    """False while an episode started at a version that this step is the last to accept is still
    being generated (`in_flight_versions`: start version -> episodes in flight)."""
    last_chance_version = train_version - max_policy_age
    return not any(count > 0 and version <= last_chance_version for version, count in in_flight_versions.items())


class AdmissionGate:
    """What the rollout loops and the train loop agree on: versions, episodes queued, episodes in
    flight. Only one event loop touches it, so it needs no locks; every change wakes the waiters.

    A rollout calls `admit` (waits), generates, then `settle`s; the train loop calls
    `wait_for_batch`, takes a batch from the buffer, then `took_batch`.
    """

    def __init__(
        self,
        num_generators: int,
        episodes_per_step: int,
        max_policy_age: int,
        max_episodes_queued: int,
        admission: Literal["pause", "drop"] = "pause",
    ):
        if max_episodes_queued < episodes_per_step:
            raise ValueError(
                f"max_episodes_queued ({max_episodes_queued}) is below one step's episodes ({episodes_per_step}); "
                "the trainer could never take a batch"
            )
        self.episodes_per_step = episodes_per_step
        self.max_policy_age = max_policy_age
        self.max_episodes_queued = max_episodes_queued
        self.admission = admission
        self.generator_versions = [0] * num_generators
        """Policy version each generator serves now."""
        self.next_train_version = 0
        """Version the next batch will be trained at = batches taken so far."""
        self.num_episodes_queued = 0
        """Admitted and not yet taken by the trainer, filtered, or dropped as stale."""
        self.in_flight_versions: collections.Counter[int] = collections.Counter()
        """Generator version at the start of each episode still being generated or scored."""
        self._changed = asyncio.Condition()

    def may_start_rollout(self, generator_index: int, num_new_episodes: int = 1) -> bool:
        if self.num_episodes_queued + num_new_episodes > self.max_episodes_queued:
            return False  # the buffer could not take them: wait for the trainer
        if self.admission == "drop":
            return True
        return rollout_may_start(
            generator_version=self.generator_versions[generator_index],
            next_train_version=self.next_train_version,
            num_episodes_queued=self.num_episodes_queued,
            num_new_episodes=num_new_episodes,
            episodes_per_step=self.episodes_per_step,
            max_policy_age=self.max_policy_age,
        )

    def may_sample_batch(self) -> bool:
        if self.admission == "drop":
            return True  # stragglers that miss their last step are dropped, not waited for
        return batch_may_be_sampled(self.in_flight_versions, self.next_train_version, self.max_policy_age)

    async def admit(self, generator_index: int, num_episodes: int = 1) -> int:
        """Waits until `num_episodes` may start on generator `generator_index`; returns the version
        they start at (hand it back to `settle`)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.may_start_rollout(generator_index, num_episodes))
            self.num_episodes_queued += num_episodes
            start_version = self.generator_versions[generator_index]
            self.in_flight_versions[start_version] += num_episodes
            return start_version

    async def settle(self, start_version: int, num_episodes: int, num_not_queued: int) -> None:
        """`num_episodes` admitted at `start_version` left flight; `num_not_queued` of them did not
        reach the buffer (filtered, dropped at entry, or handed out again after a generator died)."""
        async with self._changed:
            self.in_flight_versions[start_version] -= num_episodes
            if not self.in_flight_versions[start_version]:
                del self.in_flight_versions[start_version]
            self.num_episodes_queued -= num_not_queued
            self._changed.notify_all()

    async def wait_for_batch(self) -> int:
        """Waits until the next batch may be taken; returns the version it trains at."""
        async with self._changed:
            await self._changed.wait_for(self.may_sample_batch)
            return self.next_train_version

    async def took_batch(self, num_episodes: int, num_evicted: int) -> None:
        """The trainer took `num_episodes`, and the buffer evicted `num_evicted` stale ones meanwhile."""
        async with self._changed:
            self.next_train_version += 1
            self.num_episodes_queued -= num_episodes + num_evicted
            self._changed.notify_all()

    async def step_skipped(self) -> None:
        """The batch's step was skipped (non-finite loss): no version was published, so the next
        batch trains at the same version."""
        async with self._changed:
            self.next_train_version -= 1
            self._changed.notify_all()

    async def generator_serves(self, generator_index: int, policy_version: int) -> None:
        async with self._changed:
            self.generator_versions[generator_index] = max(self.generator_versions[generator_index], policy_version)
            self._changed.notify_all()

    def restore(self, policy_version: int, num_episodes_buffered: int) -> None:
        """State after a resume: the trainer is at `policy_version`, the buffer holds episodes."""
        self.next_train_version = policy_version
        self.num_episodes_queued = num_episodes_buffered
