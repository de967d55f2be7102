"""forge_rl/plumbing/proc_main.py, the entry point of every process forge_rl spawns: torchmonarch's races
are mended there (forge_rl/plumbing/monarch_mends.py) before any actor runs."""

from __future__ import annotations

import asyncio

import pytest
from monarch._src.actor import pickle as monarch_pickle
from monarch.actor import Actor, endpoint, this_host

from forge_rl.plumbing.proc_main import spawn_procs

pytestmark = pytest.mark.integration


class MendsInstalled(Actor):
    @endpoint
    async def torch_pickling_is_locked(self) -> bool:
        return getattr(monarch_pickle._ensure_torch_pickle, "forge_rl_locked", False)


def test_every_process_forge_rl_spawns_has_the_mend_before_any_actor_runs():
    async def ask() -> bool:
        procs = spawn_procs(this_host(), "mends")
        try:
            return await procs.spawn("mends", MendsInstalled).torch_pickling_is_locked.call_one()
        finally:
            await procs.stop()

    assert asyncio.run(ask())
