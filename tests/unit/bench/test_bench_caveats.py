"""The async-vs-sync benchmark says when its speedup is not a steady-state figure, and pins the
roles apart on request."""

import os

import pytest

from forge_rl.bench.async_vs_sync import MIN_STEADY_STEPS, caveats, pinned_apart
from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError


def test_a_long_run_within_the_overlap_bound_has_no_caveat():
    assert caveats(speedup=1.2, overlap_bound=1.25, steps=MIN_STEADY_STEPS) == []


def test_a_short_run_above_the_overlap_bound_is_flagged_twice():
    found = caveats(speedup=2.18, overlap_bound=1.25, steps=12)
    assert len(found) == 2
    assert "only 12 steps" in found[0] and f"--steps {MIN_STEADY_STEPS}" in found[0]
    assert "2.18 exceeds the overlap bound 1.25" in found[1]


def test_pin_cores_places_the_generators_and_the_trainer_on_cores_of_their_own(monkeypatch):
    base = GRPOConfig()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7})
    placement = pinned_apart(base).launch.placement
    assert (placement.generator_cpus, placement.trainer_cpus) == ((3,), (5,))
    assert base.launch.placement.generator_cpus is None  # the unpinned runs stay unpinned
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ConfigError, match=r"--pin-cores needs two cores.*may use 1 \(\[0\]\). Drop --pin-cores"):
        pinned_apart(base)
