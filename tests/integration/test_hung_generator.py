"""A generator whose vLLM engine hangs mid-request is replaced like a dead one (forge_rl/actors/generator_pool.py).

A real pool with one real generator, whose engine is held by construction
(tests/support/held_generator.py): the generate call never returns, so only the pool's
generate timeout ends it. Checks: the caller gets GeneratorLost (the loop re-queues on it), the
replacement serves on a fresh mesh, and the hung incarnation leaves no process behind and no lease
in the weight store (one is planted under its reader id before the hang: a lease it held mid-update).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import psutil
import pytest
from monarch.actor import this_host

from forge_rl.actors.generator_pool import GeneratorPlacement, GeneratorPool
from forge_rl.engines.config import GeneratorConfig
from forge_rl.errors import GeneratorLost, raised_by_actor
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.store.actors import StoreIndexActor
from forge_rl.store.index import version_key
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode
from tests.support.held_generator import HeldGeneratorActor, held_episode
from tests.support.helpers import HANG_S, POLL_S

pytestmark = pytest.mark.integration

CONFIG = GeneratorConfig(max_new_tokens=4)
GENERATE_TIMEOUT_S = 30.0
"""What the held call runs past. The replacement's own call (2 samples of 4 tokens of a tiny
model, well under a second on an idle machine) must finish within it too, on a machine whose cores
other work keeps busy, where the engine's threads get a fraction of them."""
PLANTED = version_key(1)
"""A snapshot leased under the hung incarnation's reader id before the hang."""


@dataclasses.dataclass
class HungAndReplaced:
    lost: BaseException | None
    recoveries: list[dict]
    served: list[Episode]
    processes_before: list[int]
    processes_after: list[int]
    hung_processes_left: list[int]
    """The hung incarnation's processes still running once the replacement served and they had
    HANG_S to exit."""
    planted_holders_before: dict
    planted_holders_after: dict


async def holders_once_empty(index, key: str) -> dict:
    """The holders of `key` once it has none (the pool drops them in the background), or after HANG_S."""
    deadline = time.monotonic() + HANG_S
    while (holders := (await index.describe.call_one())[key]["holders"]) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return holders


def still_running(pids: list[int]) -> list[int]:
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(processes, timeout=HANG_S)
    return [process.pid for process in alive]


@pytest.fixture(scope="module")
def hung_and_replaced(model_dir) -> HungAndReplaced:
    tokenizer = PromptTokenizer(model_dir)

    def episode(episode_id: int, forced_length: int | None = None) -> Episode:
        return Episode(episode_id, "M12=", "2", tokenizer.encode_prompt("M12="), forced_length=forced_length)

    async def scenario() -> HungAndReplaced:
        services = spawn_procs(this_host(), "hung_generator_services")
        try:
            index = services.spawn("store_index", StoreIndexActor)
            pool = services.spawn(
                "generators",
                GeneratorPool,
                CONFIG,
                str(model_dir),
                128,
                1,
                index,
                [GeneratorPlacement(None, (0,))],
                generate_timeout_s=GENERATE_TIMEOUT_S,
                update_timeout_s=600.0,
                generator_class=HeldGeneratorActor,
            )
            await pool.start.call_one()
            [processes_before] = await pool.processes.call_one()
            await index.begin.call_one(PLANTED, "nowhere:/dev/shm/none")
            await index.commit.call_one(PLANTED, 0, {})
            await index.acquire.call_one("generator0-r1", PLANTED)
            holders_before = (await index.describe.call_one())[PLANTED]["holders"]

            held_call = [held_episode(0), episode(1, forced_length=CONFIG.max_new_tokens)]
            lost = None  # stays None if the held call returned
            try:
                await asyncio.wait_for(pool.generate.call_one(0, held_call, 2), HANG_S)
            except asyncio.TimeoutError:
                lost = AssertionError(f"the held generate call was still running after {HANG_S:.0f} s")
            except Exception as e:
                lost = raised_by_actor(e)
            await pool.wait_until_serving.call_one(0)
            served = await pool.generate.call_one(0, [episode(2)], 2)
            [processes_after] = await pool.processes.call_one()
            result = HungAndReplaced(
                lost,
                await pool.recovery_events.call_one(),
                served,
                processes_before,
                processes_after,
                await asyncio.to_thread(still_running, processes_before),
                holders_before,
                await holders_once_empty(index, PLANTED),
            )
            await pool.shutdown.call_one()
            return result
        finally:
            await services.stop()

    return asyncio.run(scenario())


def test_a_generate_call_past_its_timeout_loses_the_generator(hung_and_replaced):
    assert isinstance(hung_and_replaced.lost, GeneratorLost)
    assert f"hung: a generate call ran past generator.generate_timeout_s ({GENERATE_TIMEOUT_S:g} s)" in str(
        hung_and_replaced.lost
    )
    [event] = hung_and_replaced.recoveries
    assert event["generator"] == 0 and event["reason"].startswith("hung: a generate call")


def test_the_replacement_serves_from_a_fresh_process(hung_and_replaced):
    [episode] = hung_and_replaced.served
    assert len(episode.completions) == 2
    assert episode.generator_index == 0
    assert set(hung_and_replaced.processes_after).isdisjoint(hung_and_replaced.processes_before)


def test_the_hung_incarnation_leaves_no_process_and_no_lease(hung_and_replaced):
    assert hung_and_replaced.planted_holders_before == {"generator0-r1": 1}
    assert hung_and_replaced.planted_holders_after == {}
    assert hung_and_replaced.hung_processes_left == []
