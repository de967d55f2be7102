"""`forge-rl bench faults`: what its two runs differ in, and the arguments it refuses (no run)."""

from pathlib import Path

import pytest

from forge_rl.bench.faults import FaultsBenchArgs, main, run_config
from forge_rl.config import GRPOConfig
from forge_rl.yaml_config import load_yaml_config

REPO = Path(__file__).resolve().parents[3]


def test_the_two_runs_differ_only_in_segments():
    args = FaultsBenchArgs(out_dir=Path("/tmp/unused"))
    base = load_yaml_config(GRPOConfig, REPO / args.config)
    reissue, migrate = run_config(base, args, "reissue"), run_config(base, args, "migrate")
    assert reissue.generator.segment_tokens is None and migrate.generator.segment_tokens == args.segment_tokens
    assert migrate.task.completion_lengths == "long_tail" and migrate.generator.max_new_tokens == args.max_new_tokens
    assert (reissue.run_name, migrate.run_name) == ("reissue", "migrate")
    as_reissue = migrate.__class__(**{**migrate.__dict__, "run_name": "reissue", "generator": reissue.generator})
    assert as_reissue == reissue


@pytest.mark.parametrize("steps, every", [(7, 4), (8, 0)])
def test_a_run_too_short_for_its_kills_is_refused_naming_both_flags(steps, every, tmp_path):
    with pytest.raises(ValueError, match="--kill-every-steps .* --steps"):
        main(FaultsBenchArgs(out_dir=tmp_path, steps=steps, kill_every_steps=every))
