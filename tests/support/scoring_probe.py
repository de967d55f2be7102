"""A RolloutsActor whose scoring stage and generate calls a test can watch and hold
(tests/integration/test_judge_run.py).

The scoring stage and the generate calls run in the rollouts' process (forge_rl/pipeline/rollouts.py), so a
test in the controller reaches them through endpoints: which episodes are being scored now, every
episode the stage returned, a gate that holds new scoring calls back until those in flight have
returned, and a generate call held open (its reply kept from its rollout) until released. The
stage and the pool are the run's real ones; this only wraps them. Imported by the rollouts'
process, by module path, when the test spawns it in place of RolloutsActor.
"""

from __future__ import annotations

import asyncio

from monarch.actor import concurrent_endpoint

from forge_rl.actors.rollouts import RolloutsActor
from forge_rl.types import Episode

EVENT_BOUND_S = 120.0
"""Longest wait for the calls in flight to return: a broken test fails instead of hanging."""


class ScoringCalls:
    """The stage's `score`: every episode it returned, the calls in flight, and a gate."""

    def __init__(self, score):
        self.score = score
        self.returned: list[Episode] = []
        self.in_flight: dict[int, list[int]] = {}
        self.num_calls = 0
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()

    async def __call__(self, episodes, timeline):
        await self.open.wait()
        self.num_calls += 1
        call = self.num_calls
        self.in_flight[call] = [e.episode_id for e in episodes]
        self.idle.clear()
        try:
            scored = await self.score(episodes, timeline)
        finally:
            del self.in_flight[call]
            if not self.in_flight:
                self.idle.set()
        self.returned.extend(scored)
        return scored


class HeldGenerateCalls:
    """The generator pool's handle, one of whose generate calls can be held open: armed, the next
    generate call to return keeps its reply until released, so the call is in progress (its
    interval on the timeline open) for as long as the test wants."""

    def __init__(self, pool):
        self.pool = pool
        self.armed = False
        self.held = asyncio.Event()
        self.released = asyncio.Event()
        self.generate = self  # `generate.call_one(...)` below; every other endpoint is the pool's

    def __getattr__(self, name):
        return getattr(self.pool, name)

    async def call_one(self, *args):
        result = await self.pool.generate.call_one(*args)
        if self.armed:
            self.armed = False
            self.held.set()
            await self.released.wait()
        return result


class ProbedRolloutsActor(RolloutsActor):
    def __init__(self, *args):
        super().__init__(*args)
        self.scoring = ScoringCalls(self.rollouts.actors.score)
        self.rollouts.actors.score = self.scoring
        self.generate_calls = HeldGenerateCalls(self.rollouts.actors.generators)
        self.rollouts.actors.generators = self.generate_calls
        self.batches: list[list[Episode]] = []
        """Each step's batch as it left the buffer for the trainer, in order."""
        next_batch = self.rollouts.next_batch

        async def next_batch_kept(step: int):
            batch = await next_batch(step)
            if batch is not None:
                self.batches.append(batch.episodes)
            return batch

        self.rollouts.next_batch = next_batch_kept

    @concurrent_endpoint
    async def hold_a_generate_call(self) -> None:
        """Returns once a generate call (begun before this returns) is held open."""
        calls = self.generate_calls
        calls.held.clear()
        calls.released.clear()
        calls.armed = True
        await asyncio.wait_for(calls.held.wait(), EVENT_BOUND_S)

    @concurrent_endpoint
    async def release_the_generate_call(self) -> None:
        self.generate_calls.released.set()

    @concurrent_endpoint
    async def hold_scoring(self) -> None:
        """New scoring calls wait from now on; returns once none is in flight."""
        self.scoring.open.clear()
        await asyncio.wait_for(self.scoring.idle.wait(), EVENT_BOUND_S)

    @concurrent_endpoint
    async def release_scoring(self) -> None:
        self.scoring.open.set()

    @concurrent_endpoint
    async def scoring_in_flight(self) -> set[int]:
        return {episode_id for ids in self.scoring.in_flight.values() for episode_id in ids}

    @concurrent_endpoint
    async def scoring_returned(self) -> list[Episode]:
        return list(self.scoring.returned)

    @concurrent_endpoint
    async def stop_loops(self, finish_updates: bool) -> dict:
        """The rollouts' report at the stop, with every episode the stage returned and every batch
        handed to the trainer."""
        return {
            **await self.rollouts.stop_loops(finish_updates),
            "scoring_returned": list(self.scoring.returned),
            "batches": list(self.batches),
        }
