"""The async-vs-sync benchmark says when its speedup is not a steady-state figure."""

from forge_rl.bench.async_vs_sync import MIN_STEADY_STEPS, caveats


def test_a_long_run_within_the_overlap_bound_has_no_caveat():
    assert caveats(speedup=1.2, overlap_bound=1.25, steps=MIN_STEADY_STEPS) == []


def test_a_short_run_above_the_overlap_bound_is_flagged_twice():
    found = caveats(speedup=2.18, overlap_bound=1.25, steps=12)
    assert len(found) == 2
    assert "only 12 steps" in found[0] and f"--steps {MIN_STEADY_STEPS}" in found[0]
    assert "2.18 exceeds the overlap bound 1.25" in found[1]
