"""The replay buffer's actor shell on a real Monarch process: what `put` and `sample` report."""

from __future__ import annotations

import asyncio

import pytest
from monarch.actor import this_host

from forge_rl.actors.buffer import ReplayBufferActor
from forge_rl.buffer import BufferConfig
from tests.unit.builders import make_episode

pytestmark = pytest.mark.integration


def test_an_episode_dropped_at_put_while_sample_waits_is_reported_once():
    """`put` reports the drop to its caller; `sample` must not report it again as an eviction, or
    the controller subtracts it twice and the admission gate admits too much."""

    async def scenario():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            buffer = procs.spawn("buffer", ReplayBufferActor, BufferConfig(max_policy_age=0))
            sample = asyncio.ensure_future(buffer.sample.call_one(1, 2))  # waits: the buffer is empty
            # `sample` sets the version staleness is measured against on entry, then waits.
            while (await buffer.stats.call_one())["buffer/trainer_version"] != 2:
                assert not sample.done()
            num_stale = await buffer.put.call_one([make_episode(episode_id=0, policy_version=0)])
            assert num_stale == 1  # version 0 is two versions behind the trainer's 2
            assert await buffer.put.call_one([make_episode(episode_id=1, policy_version=2)]) == 0
            batch, evicted_versions, waited_s = await asyncio.wait_for(sample, 60)
            assert [episode.episode_id for episode in batch] == [1]
            assert evicted_versions == []
            assert waited_s > 0  # it waited for episode 1
        finally:
            await procs.stop()

    asyncio.run(scenario())

