"""forge_rl/plumbing/native_heap.py: the trim's schedule, and the trim itself on this machine's C library."""

from __future__ import annotations

import sys

import pytest

from forge_rl.plumbing import native_heap
from forge_rl.plumbing.native_heap import HeapTrimmer, trim_native_heap


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_trimmer_trims_at_most_once_per_interval_and_never_at_its_first_call():
    clock, trims = FakeClock(), []
    trimmer = HeapTrimmer(every_s=60.0, clock=clock, trim=lambda: trims.append(clock.now) or True)
    assert not trimmer.trim_if_due()  # the first call starts the clock: a run's start is not steady
    clock.now += 59.0
    assert not trimmer.trim_if_due()
    clock.now += 1.0
    assert trimmer.trim_if_due()
    assert not trimmer.trim_if_due()  # the interval counts from the last trim
    clock.now += 60.0
    assert trimmer.trim_if_due()
    assert trims == [160.0, 220.0] and trimmer.num_trims == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)")
def test_the_trim_reaches_glibc_on_linux():
    """Not a no-op here: the soak's figures depend on it (docs/benchmarks/README.md, "soak")."""
    assert native_heap._MALLOC_TRIM is not None
    blocks = [bytearray(200_000) for _ in range(200)]
    del blocks[::2]  # free chunks between live ones
    assert isinstance(trim_native_heap(), bool)
