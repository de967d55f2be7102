"""A scorer whose processes may die: restarted on fresh ones, the scoring calls it lost scored again.

    SERVING ──(a scorer-side process died: a call failed, Monarch reported it, or a pid is gone)──▶
        RESTARTING ──(fresh processes serve)──▶ SERVING
    RESTARTING, when the scorer already died max_restarts + 1 times ──▶ FAILED (the run stops)

A scoring call carries episodes that are generated already, and the caller (the supervisor, which
sent the scorer a copy) still holds them untouched: a call in flight on the dead scorer, or made
while it restarts, waits for the replacement and sends them again. Nothing is generated again,
nothing is marked ERRORED for a death no completion caused, and each episode comes back once, so
the rollout loop sees one slow call and its prompt accounting (`forge_rl.core.accounting`) needs no
new case. Calls in flight on the dead incarnation are cancelled when the death is detected, so a
lost call never waits for Monarch's own (slower) report.

Counters (`stats`): the scorer's counters die with it, so the supervisor keeps, per incarnation,
the last counters it read (once per train step); a restart adds the dead incarnation's last read
to the carried total. A completion is counted by the incarnation that returned it, so one
rescored after a death is counted once, by the replacement; completions the dead one scored after
its last read are missing from the counters (at most one step's worth), never counted twice.

The same core restarts the frozen models that score tokens (the reference model, a distillation
teacher: `forge_rl.actors.frozen_model_supervisor`), whose calls (per-token logprobs of generated
episodes) are sent again just the same; `role`, `budget_flag` and `restarts_metric` name the
model in the progress lines, the final error and the counter.

No Monarch here: the actor shell (`forge_rl.actors.scorer_supervisor`) supplies `start` (spawn
fresh processes, return a handle) and `retire` (stop them without waiting), and turns a dead
process into ScorerLost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

from forge_rl.errors import ScorerFailed, ScorerLost
from forge_rl.observability.metrics import progress

Handle = TypeVar("Handle")
Result = TypeVar("Result")


class ScorerState(enum.Enum):
    STARTING = "starting"
    """The first incarnation is starting; calls wait for it."""
    SERVING = "serving"
    """Calls are forwarded to the current incarnation."""
    RESTARTING = "restarting"
    """An incarnation died; a fresh one is starting, calls wait for it."""
    FAILED = "failed"
    """It died more than max_restarts times; every call raises ScorerFailed."""


@dataclasses.dataclass
class Incarnation(Generic[Handle]):
    number: int
    handle: Handle
    in_flight: set[asyncio.Task] = dataclasses.field(default_factory=set)
    loss: dict | None = None
    """Its recovery event, once it died."""
    last_stats: dict[str, float] = dataclasses.field(default_factory=dict)
    """Its counters as last read."""


class RestartingScorer(Generic[Handle]):
    def __init__(
        self,
        start: Callable[[int], Awaitable[Handle]],
        retire: Callable[[Handle], None],
        max_restarts: int,
        role: str = "scorer",
        budget_flag: str = "scorer.max_restarts",
        restarts_metric: str = "scorer/restarts",
    ):
        self._start = start
        """Starts incarnation `number` on fresh processes; cleans up after itself if it raises."""
        self._retire = retire
        """Lets go of a dead incarnation's processes (not awaited: stopping a damaged mesh can hang)."""
        self.max_restarts = max_restarts
        self.role = role
        """What restarts, in progress lines and the final error ("scorer", "reference model", "teacher")."""
        self.budget_flag = budget_flag
        """The config field of `max_restarts`, named in the final error with its CLI flag."""
        self.restarts_metric = restarts_metric
        """`stats`' key for the number of restarts."""
        self.state = ScorerState.STARTING
        self.current: Incarnation[Handle] | None = None
        self.num_restarts = 0
        self.recoveries: list[dict] = []
        """One event per death: role, reason, detected_at, restart_started_at, serving_at, episodes_rescored."""
        self.failure: str | None = None
        self._serving = asyncio.Event()
        self._restart: asyncio.Task | None = None
        """The restart under way; held here because the event loop keeps only weak references to tasks."""
        self._carried_stats: dict[str, float] = {}
        self._stopping = False

    async def start(self) -> Handle:
        """The first incarnation; a failure here is the run's (nothing to restart yet)."""
        self.current = Incarnation(1, await self._start(1))
        self.state = ScorerState.SERVING
        self._serving.set()
        return self.current.handle

    async def call(self, request: Callable[[Handle], Awaitable[Result]], num_episodes: int) -> Result:
        """`request(handle)` on the serving incarnation; if that one dies first (ScorerLost, or the
        call cancelled by `lost`), the same request again on its replacement. Raises ScorerFailed
        once the scorer is FAILED; any other error of `request` reaches the caller unchanged."""
        while True:
            incarnation = await self.serving()
            try:
                return await self._in_flight_on(incarnation, request)
            except ScorerLost as e:
                self.lost(incarnation, f"a scoring call failed: {e}")  # ignored if `lost` already knew
                if incarnation.loss is None:
                    raise  # the run is stopping: nothing replaces it
            incarnation.loss["episodes_rescored"] += num_episodes

    async def _in_flight_on(
        self, incarnation: Incarnation[Handle], request: Callable[[Handle], Awaitable[Result]]
    ) -> Result:
        """`request(handle)` as one of `incarnation`'s calls in flight, which its death (`lost`)
        cancels: that cancellation is raised as ScorerLost, the caller's own as itself."""
        task = asyncio.ensure_future(request(incarnation.handle))
        incarnation.in_flight.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if task.cancelled() and incarnation.loss is not None:
                raise ScorerLost(f"{self.role} incarnation {incarnation.number} died during the call") from None
            raise  # the caller was cancelled, not the dead incarnation's call
        finally:
            incarnation.in_flight.discard(task)

    async def serving(self) -> Incarnation[Handle]:
        """The serving incarnation, once there is one; raises ScorerFailed when there never will be."""
        await self._serving.wait()
        if self.state == ScorerState.FAILED:
            raise ScorerFailed(self.failure)
        assert self.current is not None  # _serving is set only once an incarnation is current
        return self.current

    def lost(self, incarnation: Incarnation[Handle], reason: str) -> None:
        """`incarnation` died: cancel its calls in flight (they are sent again) and start a
        replacement. A report about an incarnation already replaced is ignored."""
        if self._stopping or incarnation is not self.current or self.state != ScorerState.SERVING:
            return
        self.state = ScorerState.RESTARTING
        self._serving.clear()
        incarnation.loss = {"role": self.role, "reason": reason, "detected_at": time.time(), "episodes_rescored": 0}
        self.recoveries.append(incarnation.loss)
        self._carried_stats = _added(self._carried_stats, incarnation.last_stats)
        progress(f"{self.role} died ({reason}); restarting it, its calls in flight will be sent again")
        for task in list(incarnation.in_flight):
            task.cancel()
        self._retire(incarnation.handle)
        self._restart = asyncio.create_task(self._replace(incarnation))

    async def _replace(self, dead: Incarnation[Handle]) -> None:
        event = dead.loss
        assert event is not None  # lost() records the death before it starts the replacement
        number, last_error = dead.number, event["reason"]
        while self.num_restarts < self.max_restarts:
            self.num_restarts += 1
            number += 1
            event["restart_started_at"] = time.time()
            try:
                handle = await self._start(number)
            except Exception as e:  # a start that fails counts as a death: try fresh processes again
                last_error = f"restart {self.num_restarts} failed: {type(e).__name__}: {e}"
                progress(f"{self.role}: {last_error}")
                continue
            self.current = Incarnation(number, handle)
            self.state = ScorerState.SERVING
            event["serving_at"] = time.time()
            self._serving.set()
            progress(f"{self.role} restarted ({self.num_restarts} of at most {self.max_restarts} restarts)")
            return
        self.state = ScorerState.FAILED
        flag = "--" + self.budget_flag.replace("_", "-")
        self.failure = (
            f"the {self.role}'s processes died and {self.budget_flag} ({self.max_restarts}) restarts are used up "
            f"(last: {last_error}), so the run stopped: a {self.role} that keeps dying has a bug or too little "
            f"memory (its log above says which). If its deaths are rare and unrelated, raise {flag}."
        )
        self._serving.set()  # wakes the waiting calls, which raise ScorerFailed

    async def read_stats(self, read: Callable[[Handle], Awaitable[Mapping[str, float]]]) -> None:
        """Read the serving incarnation's counters with `read(handle)`. A read its incarnation's
        death interrupts (cancelled by `lost`, or ScorerLost) leaves that incarnation's last read
        standing: the watchdog restarts it, and the read is not sent again (the next step reads)."""
        incarnation = self.current
        if self.state != ScorerState.SERVING or incarnation is None:
            return
        try:
            self.observed_stats(incarnation, await self._in_flight_on(incarnation, read))
        except ScorerLost:
            pass

    def observed_stats(self, incarnation: Incarnation[Handle], stats: Mapping[str, float]) -> None:
        """`stats` were just read from `incarnation` (ignored if it has died since)."""
        if incarnation.loss is None:
            incarnation.last_stats = dict(stats)

    def stats(self) -> dict[str, float]:
        """The counters of every incarnation, each as last read, and the number of restarts."""
        current = {} if self.current is None or self.current.loss is not None else self.current.last_stats
        return {**_added(self._carried_stats, current), self.restarts_metric: self.num_restarts}

    def stop(self) -> None:
        """The run is stopping: deaths from now on are the shutdown itself, not faults to repair."""
        self._stopping = True


def _added(total: Mapping[str, float], more: Mapping[str, float]) -> dict[str, float]:
    return {key: total.get(key, 0) + more.get(key, 0) for key in {**total, **more}}
