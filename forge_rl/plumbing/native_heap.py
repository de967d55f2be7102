"""Give the native heap's free memory back to the system now and then (glibc's `malloc_trim`).

A long run's processes allocate and free large native buffers over and over: the trainer's rank
gathers and snapshots the whole model every step, its publish thread frees the snapshot, torch's
temporaries come and go. glibc's `free` returns memory to the system only from the top of an
arena; free chunks in the middle stay resident. In the soak (docs/benchmarks/README.md,
"soak") the trainer's rank keeps growing without a trim while its live native allocations
(`mallinfo2`'s in-use bytes) barely do: the rest is free memory its arenas keep.
`malloc_trim(0)` returns the free pages of every arena; with it now and then the rank's anonymous
memory stays flat over the soak.

A trim takes milliseconds, more on a fragmented heap, so `trim_native_heap_if_due` does it at most once a minute
per process (the heap is the process's, whichever of its actors calls), from the call sites that
run every step. Where the C library is not glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _glibc_malloc_trim()

TRIM_EVERY_S = 60.0
"""Default seconds between two trims of one process."""


def trim_native_heap() -> bool:
    """Return every free page of the native heap to the system; True if glibc released any."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class HeapTrimmer:
    """`trim_if_due()` trims the native heap if `every_s` passed since its last trim (the first
    call only starts the clock). Call it where a process does its steady work, between steps."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        trim: Callable[[], bool] = trim_native_heap,
    ):
        self.every_s = every_s
        self._clock = clock
        self._trim = trim
        self._last: float | None = None
        self.num_trims = 0

    def trim_if_due(self) -> bool:
        """Trims if due; returns whether it trimmed."""
        now = self._clock()
        if self._last is None:
            self._last = now
            return False
        if now - self._last < self.every_s:
            return False
        self._trim()
        self._last = self._clock()
        self.num_trims += 1
        return True


_PROCESS_TRIMMER = HeapTrimmer()
"""This process's schedule: every actor of the process shares it."""


def trim_native_heap_if_due() -> bool:
    """Trim this process's native heap if a minute passed since its last trim (the first call in
    a process starts the clock); returns whether it trimmed. Cheap when not due: call it each step."""
    return _PROCESS_TRIMMER.trim_if_due()
