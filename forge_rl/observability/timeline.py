"""Busy intervals of each component, for idle fractions, pipeline bounds and Gantt charts.

The controller records an interval around every call it makes to the trainer (and the
teacher's refreshes), the rollouts' process (`forge_rl.pipeline.rollouts`) around every call to a
generator, the scoring stage or a weight update; both append to RUN_DIR/timeline.jsonl, in whole
lines: each process gathers its ended intervals and appends them in one write to a file opened
for appending (so the two never cut into each other's lines) at most every FLUSH_EVERY_S, and when
it closes the timeline. (A write per interval, line-buffered, would cost the rollouts' process a
noticeable share of its time at 128 generators.) Times are seconds since the
origin (the start of the run's loops), which the rollouts take from the controller's wall clock.
Concurrent calls on one component overlap; busy time is the length of their union.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Interval:
    component: str
    start_s: float
    end_s: float
    num_sequences: int = 0
    """Sequences the call decoded (generators only): the batch occupancy it contributed."""


FLUSH_EVERY_S = 1.0
"""Longest a process holds ended intervals before it appends them to the file."""


class Timeline:
    """Records busy intervals as they end: appended to a JSON-lines file (when given a path), and
    summed per component in memory, so a run of any length keeps constant memory and computes its
    idle fractions in constant time per step (a list of every interval, re-merged every step, grew
    without bound and made each step slower than the last)."""

    def __init__(self, path: Path | None = None, origin_unix_time: float | None = None) -> None:
        """`origin_unix_time`: another process's timeline's origin (its `origin_unix_time`), so
        both write on one clock; None: now."""
        now_monotonic, now_unix = time.monotonic(), time.time()
        self.origin_unix_time = now_unix if origin_unix_time is None else origin_unix_time
        self.origin = now_monotonic - (now_unix - self.origin_unix_time)
        """The origin on the wall clock, to relate the timeline to events timed elsewhere."""
        self._fd = None if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[str] = []
        """Ended intervals' lines not yet appended."""
        self._flushed_at = time.monotonic()
        self._active: dict[str, int] = {}
        """Calls in progress per component."""
        self._busy_since: dict[str, float] = {}
        """When each component with calls in progress became busy."""
        self._busy_total_s: dict[str, float] = {}
        """Busy time (union of intervals) of each component up to its last idle moment."""

    def now(self) -> float:
        return time.monotonic() - self.origin

    @contextlib.contextmanager
    def busy(self, component: str, num_sequences: int = 0) -> Iterator[None]:
        start = self.now()
        if not self._active.get(component):
            self._busy_since[component] = start
        self._active[component] = self._active.get(component, 0) + 1
        try:
            yield
        finally:
            end = self.now()
            self._active[component] -= 1
            if not self._active[component]:
                self._busy_total_s[component] = (
                    self._busy_total_s.get(component, 0.0) + end - self._busy_since[component]
                )
            self._write(Interval(component, start, end, num_sequences))

    def record(self, component: str, start_s: float, end_s: float) -> None:
        """A busy interval of `component` timed elsewhere and known only once it has ended (the
        trainer's step: from when its batch left the buffer to its reply). Such intervals of one
        component must not overlap each other or a `busy` one."""
        self._busy_total_s[component] = self._busy_total_s.get(component, 0.0) + max(end_s - start_s, 0.0)
        self._write(Interval(component, start_s, end_s, 0))

    def _write(self, interval: Interval) -> None:
        """Queue `interval`'s line for the file; the queue goes out in one write every FLUSH_EVERY_S."""
        if self._fd is None:
            return
        self._pending.append(json.dumps(asdict(interval)) + "\n")
        if time.monotonic() - self._flushed_at >= FLUSH_EVERY_S:
            self.flush()

    def num_active(self, component: str) -> int:
        """Calls of `component` in progress now."""
        return self._active.get(component, 0)

    def busy_s(self, component: str) -> float:
        """Busy time of `component` from the origin until now (overlapping calls count once)."""
        total = self._busy_total_s.get(component, 0.0)
        if self._active.get(component):
            total += self.now() - self._busy_since[component]
        return total

    def flush(self) -> None:
        """Append the ended intervals to the file, in one write."""
        if self._fd is not None and self._pending:
            data = "".join(self._pending).encode()
            self._pending = []
            while data:  # a regular file takes it whole; the loop only guards a short write
                data = data[os.write(self._fd, data) :]
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def load(path: Path) -> list[Interval]:
        """The intervals a run wrote (RUN_DIR/timeline.jsonl), in the order they ended."""
        return [Interval(**json.loads(line)) for line in path.read_text().splitlines() if line]


def idle_fraction(busy_s: Sequence[float], elapsed_s: float) -> float:
    """The one definition of idle, for the run's metrics and every benchmark: the fraction of the
    components' available time that none of their calls covered, 1 - sum(busy_s) / (len(busy_s) *
    elapsed_s). For several generators it is generator-seconds idle over generator-seconds."""
    return 1.0 - sum(busy_s) / max(len(busy_s) * elapsed_s, 1e-9)


def merged(intervals: list[Interval], start_s: float, end_s: float) -> list[tuple[float, float]]:
    """Union of the intervals clipped to [start_s, end_s], as sorted disjoint (start, end) pairs."""
    spans = sorted((max(i.start_s, start_s), min(i.end_s, end_s)) for i in intervals)
    union: list[tuple[float, float]] = []
    for start, end in spans:
        if end <= start:
            continue
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def busy_s(intervals: list[Interval], component: str, start_s: float, end_s: float) -> float:
    own = [i for i in intervals if i.component == component]
    return sum(end - start for start, end in merged(own, start_s, end_s))


def mean_sequences_in_flight(intervals: list[Interval], component: str, start_s: float, end_s: float) -> float:
    """Time-averaged number of sequences a generator was decoding over the window."""
    total = sum(
        (min(i.end_s, end_s) - max(i.start_s, start_s)) * i.num_sequences
        for i in intervals
        if i.component == component and i.end_s > start_s and i.start_s < end_s
    )
    return total / max(end_s - start_s, 1e-9)


LAG_PROBE_PERIOD_S = 0.010
"""Period of `watch_event_loop_lag`'s timer."""


async def watch_event_loop_lag(samples: list[tuple[float, float]]) -> None:
    """Until cancelled, how late a timer fires on the running event loop, every
    LAG_PROBE_PERIOD_S: appends (wall time, seconds late) to `samples`. What delays the timer delays
    every message the loop handles."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LAG_PROBE_PERIOD_S
        await asyncio.sleep(LAG_PROBE_PERIOD_S)
        samples.append((time.time(), max(0.0, loop.time() - due)))
