"""Busy intervals of each component, for idle fractions, pipeline bounds and Gantt charts.

The controller records an interval around every call it makes to a component (a generator's
`generate`, the scorer, the trainer's step, a weight update). Times are seconds since the origin
(the start of the run's loops) on the controller's monotonic clock. Concurrent calls on one
component overlap; busy time is the length of their union.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Interval:
    component: str
    start_s: float
    end_s: float
    num_sequences: int = 0
    """Sequences the call decoded (generators only): the batch occupancy it contributed."""


class Timeline:
    def __init__(self) -> None:
        self.origin = time.monotonic()
        self.origin_unix_time = time.time()
        """The origin on the wall clock, to relate the timeline to events timed elsewhere."""
        self.intervals: list[Interval] = []

    def now(self) -> float:
        return time.monotonic() - self.origin

    @contextlib.contextmanager
    def busy(self, component: str, num_sequences: int = 0) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.intervals.append(Interval(component, start, self.now(), num_sequences))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([asdict(i) for i in self.intervals]))

    @staticmethod
    def load(path: Path) -> list[Interval]:
        return [Interval(**i) for i in json.loads(path.read_text())]


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
