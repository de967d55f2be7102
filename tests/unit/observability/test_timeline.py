import pytest

from forge_rl.observability.timeline import Interval, busy_s, mean_sequences_in_flight, merged


def test_overlapping_calls_count_once_toward_busy_time():
    intervals = [Interval("g", 0.0, 2.0), Interval("g", 1.0, 3.0), Interval("g", 5.0, 6.0), Interval("t", 0.0, 9.0)]
    assert merged([i for i in intervals if i.component == "g"], 0.0, 10.0) == [(0.0, 3.0), (5.0, 6.0)]
    assert busy_s(intervals, "g", 0.0, 10.0) == 4.0


def test_busy_time_is_clipped_to_the_window():
    assert busy_s([Interval("g", 0.0, 10.0)], "g", 2.0, 5.0) == 3.0


def test_occupancy_averages_sequences_over_the_window():
    intervals = [Interval("g", 0.0, 1.0, num_sequences=8), Interval("g", 0.0, 2.0, num_sequences=8)]
    assert mean_sequences_in_flight(intervals, "g", 0.0, 4.0) == pytest.approx((8 + 16) / 4)


def test_running_busy_time_counts_overlapping_calls_once_and_streams_intervals(tmp_path, monkeypatch):
    import forge_rl.observability.timeline as timeline_module
    from forge_rl.observability.timeline import Timeline

    clock = [100.0]
    monkeypatch.setattr(timeline_module.time, "monotonic", lambda: clock[0])
    timeline = Timeline(tmp_path / "timeline.jsonl")

    def advance(seconds):
        clock[0] += seconds

    with timeline.busy("g"):  # 0..4, overlapping 1..2 and 2.5..4
        advance(1.0)
        with timeline.busy("g"):
            advance(1.0)
        advance(0.5)
        with timeline.busy("g", num_sequences=8):
            advance(0.5)
            assert timeline.busy_s("g") == pytest.approx(3.0)  # still busy: counts up to now
            advance(1.0)
    advance(2.0)
    with timeline.busy("t"):
        advance(1.0)
    timeline.close()

    assert timeline.busy_s("g") == pytest.approx(4.0)  # union of [0, 4]
    assert timeline.busy_s("t") == pytest.approx(1.0) and timeline.busy_s("idle") == 0.0
    intervals = Timeline.load(tmp_path / "timeline.jsonl")
    assert [i.component for i in intervals] == ["g", "g", "g", "t"]
    assert busy_s(intervals, "g", 0.0, 10.0) == pytest.approx(timeline.busy_s("g"))
    assert intervals[1].num_sequences == 8
