"""`placement.yield_this_process` (how a simulated generator's process yields the cores:
`SimEngineConfig.idle_priority`), called in an actor's constructor as GeneratorActor does, runs
every thread of the process under SCHED_IDLE: Monarch's threads already running, and the threads
started afterwards. A process that does not call it runs as its parent does."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
from monarch.actor import Actor, endpoint, this_host

from forge_rl.plumbing.cpu_affinity import yield_this_process
from forge_rl.plumbing.proc_main import spawn_procs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's"),
]


class ThreadPolicies(Actor):
    def __init__(self, yields: bool):
        if yields:
            yield_this_process()

    @endpoint
    async def policies(self) -> tuple[list[int], int]:
        """The scheduling policy of each thread of this process, and that of a thread started now."""
        started: list[int] = []
        thread = threading.Thread(target=lambda: started.append(os.sched_getscheduler(0)))
        thread.start()
        thread.join()
        return [os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")], started[0]


@pytest.mark.parametrize("yields, expected", [(True, os.SCHED_IDLE), (False, os.SCHED_OTHER)])
def test_every_thread_of_a_process_that_yields_runs_at_idle_priority(yields, expected):
    async def policies() -> tuple[list[int], int]:
        procs = spawn_procs(this_host(), "cpu_policy")
        try:
            return await procs.spawn("threads", ThreadPolicies, yields).policies.call_one()
        finally:
            await procs.stop()

    running, started_later = asyncio.run(policies())
    assert len(running) > 1, "Monarch's threads should be there too"
    assert set(running) == {expected}
    assert started_later == expected
