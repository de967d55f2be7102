"""A process spawned with the idle CPU policy (forge_rl/proc_main.py, how a simulated generator's
process yields the cores: `SimEngineConfig.idle_priority`) runs every thread under it, Monarch's
threads included; one spawned without it runs as its parent does."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from monarch.actor import Actor, endpoint, this_host

from forge_rl.proc_main import CPU_POLICY_ENV, spawn_procs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's"),
]


class ThreadPolicies(Actor):
    @endpoint
    async def policies(self) -> list[int]:
        """The scheduling policy of each thread of this process."""
        return [os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")]


@pytest.mark.parametrize("env, expected", [({CPU_POLICY_ENV: "idle"}, os.SCHED_IDLE), ({}, os.SCHED_OTHER)])
def test_every_thread_of_the_process_runs_under_the_policy_it_was_spawned_with(env, expected):
    async def policies() -> list[int]:
        procs = spawn_procs(this_host(), "cpu_policy", env=env)
        try:
            return await procs.spawn("threads", ThreadPolicies).policies.call_one()
        finally:
            await procs.stop()

    found = asyncio.run(policies())
    assert len(found) > 1, "Monarch's threads should be there too"
    assert set(found) == {expected}
