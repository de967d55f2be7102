"""`forge-rl bench soak`'s growth slopes (no run)."""

import pytest

from forge_rl.bench.soak import growth_slopes


def test_a_steady_leak_is_fitted_and_projected_over_a_day_and_noise_is_not():
    mb = 2**20
    samples = [
        {"t_s": 600.0 * i, "rss_by_role": {"engine": (1000 + 10 * i + (3 if i % 2 else -3)) * mb, "flat": 500 * mb}}
        for i in range(7)  # an hour: +60 MB/h on the engine, with +-3 MB of noise
    ]
    samples[-1]["rss_by_role"]["late"] = 100 * mb  # seen once: not fitted
    figures = growth_slopes(samples)
    assert figures["rss_slope_mb_per_hour_by_role"]["engine"] == pytest.approx(60, abs=3)
    assert figures["rss_slope_mb_per_hour_by_role"]["flat"] == pytest.approx(0)
    assert figures["rss_24h_projection_fraction_by_role"]["engine"] == pytest.approx(60 * 24 / 997, rel=0.06)
    assert "late" not in figures["rss_slope_mb_per_hour_by_role"]
    assert figures["rss_24h_projection_fraction_max"] == figures["rss_24h_projection_fraction_by_role"]["engine"]
