"""`forge-rl bench eval-overhead`'s arithmetic on fabricated run directories (the runs themselves are
real recipe runs; the bench's figures are read from what they write)."""

import json

import pytest

from forge_rl.bench.eval_overhead import EvalOverheadArgs, analyze, interleaved, main
from forge_rl.errors import ConfigError


def fabricated_run(path, tokens_per_step: int, step_s: float, evaluations: list[dict] | None = None):
    """A run directory as a finished run leaves it: its steps, its summary, its evaluations."""
    path.mkdir(parents=True)
    steps = [
        {"step": s, "num_tokens": tokens_per_step, "wall_time_s": s * step_s, "reward/mean": 0.5} for s in range(1, 11)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    summary = {} if evaluations is None else {"evaluations": {"evaluated": len(evaluations), "failed": 1, "dropped": 0}}
    (path / "summary.json").write_text(json.dumps(summary))
    if evaluations is not None:
        (path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    return path


def test_a_runs_trained_tokens_per_second_count_its_train_loop_and_its_evaluations_are_read_back(tmp_path):
    plain = analyze(fabricated_run(tmp_path / "off", tokens_per_step=100, step_s=0.5))
    assert plain["trained_tokens_per_s"] == pytest.approx(10 * 100 / 5.0)
    assert (plain["evaluations"], plain["eval_seconds_mean"]) == (0, None)
    evaluated = analyze(
        fabricated_run(
            tmp_path / "own",
            100,
            0.5,
            [{"eval/seconds": 1.0, "eval/held_out/pass@1": 0.25}, {"eval/seconds": 3.0, "eval/held_out/pass@1": 0.5}],
        )
    )
    assert (evaluated["evaluations"], evaluated["eval_failed"], evaluated["eval_seconds_mean"]) == (2, 1, 2.0)
    assert evaluated["final_eval_pass@1"] == 0.5


def test_modes_are_interleaved_so_a_drift_of_the_machines_load_falls_on_each_alike():
    assert interleaved(("off", "own", "shared"), 2) == ["off", "own", "shared", "shared", "own", "off"]
    assert interleaved(("off", "own"), 3) == ["off", "own", "own", "off", "off", "own"]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(placements=("elsewhere",)), "must name own, shared or both"),
        (dict(steps=5, every_n_steps=10), "must reach"),
    ],
)
def test_bad_bench_arguments_are_refused_before_any_run(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        main(EvalOverheadArgs(out_dir=tmp_path, **fields))
