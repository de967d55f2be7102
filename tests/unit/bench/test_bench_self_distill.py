"""`forge-rl bench self-distill`'s figures from reward curves (forge_rl/bench/self_distill.py), and
the seeding and reuse of runs it shares with the other benchmarks (forge_rl/bench/common.py)."""

import dataclasses

import pytest
import yaml

from forge_rl.bench import common
from forge_rl.bench.common import reuse_or_run_variant, seeded, smoothed
from forge_rl.bench.self_distill import SelfDistillArgs, min_after_reaching, over_seeds, run_figures
from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.run.run_dir import config_to_dict

LEARNS = [0.0] * 5 + [1.0] * 15
"""Smoothed: reaches 0.8 at step 9, then 1.0."""
COLLAPSES = [0.0] * 5 + [1.0] * 10 + [0.1] * 10
"""Reaches 0.8 at step 9, then a fixed wrong answer: smoothed down to 0.1."""
DIPS = [0.0] * 5 + [1.0] * 10 + [0.4] * 3 + [1.0] * 7
"""Reaches 0.8, dips to a smoothed 0.64 (three steps of 0.4 in a window of 5) and recovers."""


def test_the_lowest_reward_after_reaching_the_target_is_read_from_the_smoothed_curve():
    assert smoothed([0.0, 0.5, 1.0, 1.0, 1.0, 0.0]) == [0.7, 0.7]
    assert min_after_reaching(DIPS, 0.8) == pytest.approx(0.64)
    assert min_after_reaching(COLLAPSES, 0.8) == pytest.approx(0.1)
    assert min_after_reaching([0.0] * 20, 0.8) is None


@pytest.mark.parametrize(
    "rewards,steps,lowest,collapsed",
    [
        (LEARNS, 9, 0.8, False),  # the crossing step itself counts
        (DIPS, 9, 0.64, False),  # above collapse_below 0.5: a dip, not a collapse
        (COLLAPSES, 9, 0.1, True),  # reached, then fell below 0.5
        ([0.3] * 20, None, None, True),  # never learned: ends below 0.5
        ([0.6] * 20, None, None, False),  # never reached 0.8 but ends above 0.5: slow, not collapsed
    ],
)
def test_a_run_collapses_when_it_falls_or_ends_below_the_threshold(rewards, steps, lowest, collapsed):
    figures = run_figures(rewards, target=0.8, collapse_below=0.5)
    assert figures["steps_to_target"] == steps and figures["collapsed"] is collapsed
    assert figures["peak_reward"] == pytest.approx(max(smoothed(rewards)))
    assert figures["min_after_target"] == (None if lowest is None else pytest.approx(lowest))


def test_a_variant_is_summed_up_over_its_seeds():
    runs = [run_figures(r, target=0.8, collapse_below=0.5) for r in (LEARNS, COLLAPSES, [0.3] * 20)]
    figures = over_seeds(runs)
    assert figures["runs"] == 3 and figures["collapses"] == 2 and figures["reached_target"] == 2
    assert figures["final_reward_mean"] == pytest.approx((1.0 + 0.1 + 0.3) / 3)
    assert figures["final_reward_stdev"] == pytest.approx(0.4726, abs=1e-4)
    assert (figures["final_reward_min"], figures["final_reward_max"]) == (pytest.approx(0.1), 1.0)
    assert figures["peak_reward_mean"] == pytest.approx((1.0 + 1.0 + 0.3) / 3)
    # Steps and lowest reward are means over the runs that reached the target (the first two).
    assert figures["steps_to_target_mean"] == 9 and figures["min_after_target_mean"] == pytest.approx(0.45)


def test_one_seed_has_no_spread_and_a_variant_that_never_reaches_the_target_has_no_steps():
    figures = over_seeds([run_figures([0.3] * 20, target=0.8, collapse_below=0.5)])
    assert figures["final_reward_stdev"] == 0.0
    assert figures["steps_to_target_mean"] is None and figures["min_after_target_mean"] is None


def test_a_climb_that_falls_back_short_of_the_target_shows_in_the_peak():
    rewards = [0.0] * 5 + [0.65] * 10 + [0.3] * 10
    figures = run_figures(rewards, target=0.8, collapse_below=0.6)
    assert figures["peak_reward"] == pytest.approx(0.65) and figures["final_reward"] == pytest.approx(0.3)
    assert figures["collapsed"] and figures["steps_to_target"] is None


def test_runs_shorter_than_the_smoothing_window_have_figures_too():
    figures = over_seeds([run_figures([0.0, 1.0, 1.0], target=0.8, collapse_below=0.6)])  # the smoke form
    assert figures["final_reward_mean"] == pytest.approx(2 / 3) and figures["peak_reward_mean"] is None


@pytest.mark.parametrize(
    "changes,message",
    [({"seeds": ()}, "--seeds"), ({"seeds": (1, 1)}, "--seeds"), ({"collapse_below": 0.9}, "--collapse-below")],
)
def test_bad_arguments_are_refused_naming_the_flag(changes, message):
    with pytest.raises(ValueError, match=message):
        SelfDistillArgs(**changes)


def test_a_seed_is_the_trainers_the_prompts_and_the_generators_but_not_the_initial_models():
    config = seeded(GRPOConfig(), 7)
    assert (config.trainer.seed, config.task.seed, config.generator.seed) == (7, 7, 7)
    assert config.model == GRPOConfig().model


def _finished_run(config: GRPOConfig, steps_logged: int) -> None:
    """What a run of `config` leaves in its directory: config.yaml and a metrics line per step."""
    path = config.run_dir / config.run_name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    (path / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, steps_logged + 1)))


def test_a_finished_run_of_the_same_config_is_read_and_anything_else_is_refused(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(
        common, "run_variant", lambda base, out_dir, name, **changes: ran.append(name) or out_dir / name
    )
    base = GRPOConfig(steps=6)
    _finished_run(dataclasses.replace(seeded(base, 0), run_dir=tmp_path, run_name="grpo-seed0"), 6)

    assert reuse_or_run_variant(seeded(base, 0), tmp_path, "grpo-seed0") == tmp_path / "grpo-seed0"
    assert ran == []  # read, not run again
    reuse_or_run_variant(seeded(base, 1), tmp_path, "grpo-seed1")
    assert ran == ["grpo-seed1"]  # no directory yet: run
    with pytest.raises(ConfigError, match="another run.*--out-dir"):
        reuse_or_run_variant(seeded(base, 1), tmp_path, "grpo-seed0")  # another seed in that directory
    _finished_run(GRPOConfig(steps=6, run_dir=tmp_path, run_name="cut-short"), 4)
    with pytest.raises(ConfigError, match="did not finish its 6 steps"):
        reuse_or_run_variant(base, tmp_path, "cut-short")
