import pytest

from forge_rl.timeline import Interval, busy_s, mean_sequences_in_flight, merged


def test_overlapping_calls_count_once_toward_busy_time():
    intervals = [Interval("g", 0.0, 2.0), Interval("g", 1.0, 3.0), Interval("g", 5.0, 6.0), Interval("t", 0.0, 9.0)]
    assert merged([i for i in intervals if i.component == "g"], 0.0, 10.0) == [(0.0, 3.0), (5.0, 6.0)]
    assert busy_s(intervals, "g", 0.0, 10.0) == 4.0


def test_busy_time_is_clipped_to_the_window():
    assert busy_s([Interval("g", 0.0, 10.0)], "g", 2.0, 5.0) == 3.0


def test_occupancy_averages_sequences_over_the_window():
    intervals = [Interval("g", 0.0, 1.0, num_sequences=8), Interval("g", 0.0, 2.0, num_sequences=8)]
    assert mean_sequences_in_flight(intervals, "g", 0.0, 4.0) == pytest.approx((8 + 16) / 4)
