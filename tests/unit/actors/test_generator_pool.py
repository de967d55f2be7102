"""The generator pool (forge_rl/actors/generator_pool.py) with hung generators: a call past its
timeout is handled like a dead generator, and the dead incarnation's weight-store leases are dropped.

The pool's endpoints run in this process, on named fakes of the host it spawns generators on and
of the store index (tests/support/fakes.py); no Monarch runtime. A hung endpoint never returns (by
construction), so the timeout under test is the only thing that ends its call; endpoints that
answer do so at once. tests/integration/test_hung_generator.py holds a real vLLM engine instead.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from forge_rl.actors.generator_pool import GeneratorPlacement, GeneratorPool
from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.runner import ContextExhausted
from forge_rl.errors import GeneratorLost
from tests.support.fakes import FakeGeneratorHost, FakePrompts, endpoints
from tests.support.helpers import HANG_S, wait_until_async

TIMEOUT_S = 0.5
"""Each of the pool's timeouts (generate, update, start): what a hung endpoint runs past."""


class PoolUnderTest:
    """A one-generator pool on `host`, and the reader ids it asked the store index to drop."""

    def __init__(self, host: FakeGeneratorHost, worker: str | None = None):
        self.dropped_readers: list[str] = []

        async def drop_reader(reader: str) -> list[str]:
            self.dropped_readers.append(reader)
            return []

        self.pool = GeneratorPool(
            GeneratorConfig(start_timeout_s=TIMEOUT_S),
            "/nowhere",
            64,
            1,
            endpoints(drop_reader=drop_reader),
            [GeneratorPlacement(host, (), worker=worker)],
            generate_timeout_s=TIMEOUT_S,
            update_timeout_s=TIMEOUT_S,
        )

    async def call(self, endpoint: str, *args):
        """Endpoint `endpoint`'s body, run here as Monarch runs it on the actor (a concurrent
        endpoint's wraps it in a task that answers on a port: unwrapped here)."""
        body = inspect.unwrap(getattr(GeneratorPool, endpoint)._method)
        return await body(self.pool, *args)


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), HANG_S))


def test_a_generate_call_past_its_timeout_loses_the_generator_and_a_replacement_serves():
    host = FakeGeneratorHost(hang={"generator0-r1": {"generate"}})
    under_test = PoolUnderTest(host)

    async def scenario():
        prompts = FakePrompts().next_episodes(1)
        await under_test.call("start")
        with pytest.raises(GeneratorLost, match=r"hung: a generate call ran past generator.generate_timeout_s"):
            await under_test.call("generate", 0, prompts, 2)
        assert await under_test.call("wait_until_serving", 0) == 0
        [episode] = await under_test.call("generate", 0, prompts, 2)
        assert len(episode.completions) == 2
        [event] = await under_test.call("recovery_events")
        assert event["reason"].startswith("hung: a generate call")
        await wait_until_async(lambda: host.meshes[0].stopped, "the hung incarnation's mesh stopped")
        await wait_until_async(lambda: under_test.dropped_readers, "the hung incarnation's leases dropped")
        await under_test.call("shutdown")

    run(scenario)
    assert [procs.name for procs in host.meshes] == ["generator0-r1", "generator0-r2"]
    assert not host.meshes[1].stopped
    assert under_test.dropped_readers == ["generator0-r1"]


def test_a_turn_comes_back_as_sampled_and_a_full_context_as_the_runners_own_error():
    """ContextExhausted reaches the controller's runner unwrapped (it ends the episode truncated);
    it is no fault of the generator."""
    under_test = PoolUnderTest(FakeGeneratorHost())

    async def scenario():
        await under_test.call("start")
        turn = await under_test.call("generate_turn", 0, [1, 5], 8)
        assert (turn.token_ids, turn.policy_versions) == ([2], [0])
        with pytest.raises(ContextExhausted, match="the prefix has 64 tokens"):
            await under_test.call("generate_turn", 0, [5] * 64, 8)
        assert await under_test.call("recovery_events") == []
        await under_test.call("shutdown")

    run(scenario)


def test_a_turn_past_its_timeout_loses_the_generator_as_a_hung_generate_call_does():
    under_test = PoolUnderTest(FakeGeneratorHost(hang={"generator0-r1": {"generate_turn"}}))

    async def scenario():
        await under_test.call("start")
        with pytest.raises(GeneratorLost, match=r"hung: a generate_turn call ran past generator.generate_timeout_s"):
            await under_test.call("generate_turn", 0, [1, 5], 8)
        await under_test.call("wait_until_serving", 0)
        turn = await under_test.call("generate_turn", 0, [1, 5], 8)  # the replacement serves
        assert turn.token_ids == [2]
        await under_test.call("shutdown")

    run(scenario)


def test_a_weight_update_past_its_timeout_is_retried_on_fresh_meshes_until_one_loads_the_newest_version():
    """Incarnation 1 hangs in the update; its replacement 2 hangs in its catch-up load (a failed
    start attempt); 3 loads the version. Both hung incarnations are stopped and their leases dropped."""
    hung_update = {"update_weights"}
    host = FakeGeneratorHost(hang={"generator0-r1": hung_update, "generator0-r2": hung_update})
    under_test = PoolUnderTest(host)

    async def scenario():
        await under_test.call("start")
        with pytest.raises(GeneratorLost, match=r"hung: a weight update ran past generator.update_timeout_s"):
            await under_test.call("update_weights", 0, 3)
        assert await under_test.call("wait_until_serving", 0) == 3
        await wait_until_async(lambda: host.meshes[1].stopped, "the second hung incarnation's mesh stopped")
        await wait_until_async(lambda: len(under_test.dropped_readers) == 2, "both hung incarnations' leases dropped")
        await under_test.call("shutdown")

    run(scenario)
    assert [procs.name for procs in host.meshes] == ["generator0-r1", "generator0-r2", "generator0-r3"]
    assert [procs.stopped for procs in host.meshes] == [True, True, False]
    assert under_test.dropped_readers == ["generator0-r1", "generator0-r2"]


def test_a_first_start_past_its_timeout_fails_naming_the_flag():
    under_test = PoolUnderTest(FakeGeneratorHost(hang={"generator0-r1": {"start"}}))

    async def scenario():
        with pytest.raises(
            TimeoutError, match=r"did not start within generator.start_timeout_s \(0.5 s\).*--generator.start-timeout-s"
        ):
            await under_test.call("start")

    run(scenario)


def test_a_replacement_whose_start_hangs_is_retried_on_a_fresh_mesh():
    """Incarnation 1 hangs in a generate call; its replacement 2 hangs while starting (a failed
    attempt, not a slot recovering forever); 3 serves."""
    host = FakeGeneratorHost(hang={"generator0-r1": {"generate"}, "generator0-r2": {"start"}})
    under_test = PoolUnderTest(host)

    async def scenario():
        prompts = FakePrompts().next_episodes(1)
        await under_test.call("start")
        with pytest.raises(GeneratorLost):
            await under_test.call("generate", 0, prompts, 2)
        assert await under_test.call("wait_until_serving", 0) == 0
        [episode] = await under_test.call("generate", 0, prompts, 2)
        assert len(episode.completions) == 2
        await wait_until_async(lambda: host.meshes[1].stopped, "the hung start's mesh stopped")
        await under_test.call("shutdown")

    run(scenario)
    assert [procs.name for procs in host.meshes] == ["generator0-r1", "generator0-r2", "generator0-r3"]
    assert [procs.stopped for procs in host.meshes] == [True, True, False]


def test_a_generator_whose_hosts_worker_stops_answering_is_lost_and_not_replaced_there(monkeypatch):
    """A host lost whole: its worker's port (a listener here) closes with it. The generator is taken
    for lost once the port has refused connections for HOST_LOST_AFTER_S, and no replacement is
    spawned on a host whose worker does not answer: the slot fails at once, naming the worker."""
    import socket

    import forge_rl.actors.generator_pool as generator_pool
    from forge_rl.errors import GeneratorFailed

    monkeypatch.setattr(generator_pool, "HOST_CHECK_INTERVAL_S", 0.05)
    monkeypatch.setattr(generator_pool, "HOST_LOST_AFTER_S", 0.2)
    listener = socket.create_server(("127.0.0.1", 0))
    worker = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    host = FakeGeneratorHost()
    under_test = PoolUnderTest(host, worker=worker)

    async def scenario():
        await under_test.call("start")
        assert under_test.pool.slots[0].state.value == "serving"
        listener.close()  # the host goes: nothing accepts on its worker's port any more
        slot = under_test.pool.slots[0]
        await wait_until_async(lambda: slot.state.value != "serving", "the pool to take the generator for lost")
        with pytest.raises(GeneratorFailed, match=rf"its host's worker {worker} does not answer: the host is lost"):
            await under_test.call("wait_until_serving", 0)
        [event] = under_test.pool.recoveries
        assert "has accepted no connection" in event["reason"] and "serving_at" not in event
        await under_test.call("shutdown")

    run(scenario)
    assert [procs.name for procs in host.meshes] == ["generator0-r1"]  # nothing spawned on the lost host
