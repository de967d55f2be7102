"""The cores a process runs on: pinned to a placement's cores (`launch.placement`), or yielded to
the processes beside it (a simulated generator's SCHED_IDLE), every thread of it."""

from __future__ import annotations

import os
from collections.abc import Callable


def pin_this_process(cpus: tuple[int, ...] | None) -> list[int]:
    """Every thread of this process on `cpus` (None: leave it as it is); the threads and
    processes it starts later inherit it. os.sched_setaffinity(0, ...) alone would pin only the
    calling thread on Linux, not the runtime's threads already running. Returns the cores this
    process's main thread may run on now."""
    if cpus is not None:
        _for_every_thread(lambda thread: os.sched_setaffinity(thread, cpus))
    return sorted(os.sched_getaffinity(0))


def yield_this_process() -> None:
    """Every thread of this process under Linux's SCHED_IDLE policy: it runs only when a core has
    nothing else to run. As with `pin_this_process`, each thread already running is set (a runtime's
    threads included); the threads it starts later inherit their creator's policy. Not Linux: the
    lowest priority the platform gives a process (nice 19)."""
    if not hasattr(os, "SCHED_IDLE"):
        os.nice(19)
        return
    _for_every_thread(lambda thread: os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0)))


def _for_every_thread(apply: Callable[[int], None]) -> None:
    """`apply(thread id)` for each thread of this process running now (Linux's /proc)."""
    for thread in os.listdir("/proc/self/task"):
        try:
            apply(int(thread))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
