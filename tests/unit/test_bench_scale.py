"""What `forge-rl bench scale` reads from a run (forge_rl/bench/scale.py), on hand-made inputs."""

from __future__ import annotations

import collections
import json

import pytest

from forge_rl.bench.scale import _CountingActor, max_concurrent_sequences
from forge_rl.timeline import Interval


def test_concurrent_sequences_peak_where_calls_of_all_generators_overlap(tmp_path):
    intervals = [
        Interval("generator0", 0.0, 2.0, 8),
        Interval("generator1", 1.0, 3.0, 8),
        Interval("generator0", 1.5, 2.5, 8),  # same generator, second rollout loop
        Interval("trainer", 0.0, 3.0, 0),
        Interval("generator1", 3.0, 4.0, 8),  # starts as the other ends: never 4 at once
    ]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(i.__dict__) for i in intervals))
    assert max_concurrent_sequences(tmp_path) == 24


class FakeEndpoint:
    def call_one(self, *args):
        return ("one", args)

    def call(self, *args):
        return ("all", args)


class FakeActor:
    generate = FakeEndpoint()
    put = FakeEndpoint()


def test_counting_handles_count_each_call_by_endpoint_and_pass_it_through():
    counts = collections.Counter()
    actor = _CountingActor(FakeActor(), counts, "generators")
    assert actor.generate.call_one(1, 2) == ("one", (1, 2))
    actor.generate.call_one(3)
    assert actor.put.call() == ("all", ())
    assert counts == {"generators.generate": 2, "generators.put": 1}
    with pytest.raises(AttributeError):
        actor.missing
