"""What the scorer's and the frozen models' supervisors share: they own the proc meshes of a
restartable part of the run (`forge_rl.scoring.restarts.RestartingScorer` decides what a death
does to the calls in flight and to the restart budget) and notice deaths two ways.

Monarch reports a failed mesh to its owner (`__supervise__`, in each subclass: which report names
the serving incarnation depends on its meshes), and this actor polls the OS pids of the serving
incarnation's processes on its host every POLL_INTERVAL_S, acting on a death within that instead of
waiting for Monarch's slower report. A dead incarnation's meshes are stopped in the background, never awaited (stopping
a damaged mesh can hang).
"""

from __future__ import annotations

import asyncio

from monarch.actor import Actor, ProcMesh, concurrent_endpoint, endpoint

from forge_rl.actors.generator_pool import POLL_INTERVAL_S, is_alive, stop_quietly
from forge_rl.scoring.restarts import RestartingScorer, ScorerState


class RestartingOwner(Actor):
    """Subclasses set `self.restarts` (its handles carry `pids`) and `self.what_exited` (the
    reason a pid poll records) in __init__, after calling `super().__init__()`."""

    restarts: RestartingScorer
    what_exited: str

    def __init__(self) -> None:
        self._watchdog: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        """Stops of dead meshes, not waited for; held because the event loop keeps only weak references."""

    @endpoint
    async def start(self) -> dict:
        """Spawn the first incarnation's processes and start it."""
        handle = await self.restarts.start()
        self._watchdog = asyncio.create_task(self._watch_processes())
        return {"pids": handle.pids}

    @concurrent_endpoint
    async def processes(self) -> list[int]:
        """OS pids of the serving incarnation on this host (crash tests kill them)."""
        return list((await self.restarts.serving()).handle.pids)

    @concurrent_endpoint
    async def recovery_events(self) -> list[dict]:
        return list(self.restarts.recoveries)

    @concurrent_endpoint
    async def wait_until_serving(self) -> int:
        """Returns once an incarnation serves, with the number of restarts so far."""
        await self.restarts.serving()
        return self.restarts.num_restarts

    def _stop_watching(self) -> None:
        """The run is stopping: deaths from now on are not restarted."""
        self.restarts.stop()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _stop_in_background(self, procs: ProcMesh) -> None:
        self._in_background(stop_quietly(procs))

    def _in_background(self, work) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_processes(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            incarnation = self.restarts.current
            if (
                self.restarts.state == ScorerState.SERVING
                and incarnation is not None
                and not all(is_alive(p) for p in incarnation.handle.pids)
            ):
                self.restarts.lost(incarnation, self.what_exited)
