"""`forge-rl bench distill`'s figures from reward curves (forge_rl/bench/distill.py), and the export
of a run without a checkpoint (forge_rl/run/export.py)."""

import pytest

from forge_rl.bench.distill import compare, steps_to, task_rewards
from forge_rl.errors import ConfigError
from forge_rl.run.export import export_run


def test_steps_to_target_reads_the_smoothed_curve_and_counts_trainer_steps():
    rewards = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert steps_to(rewards, 0.8) == 8  # the mean of steps 4..8 is the first >= 0.8
    assert steps_to(rewards, 1.1) is None


def test_distillation_is_compared_with_grpo_at_the_same_fraction_of_the_teacher():
    teacher = [1.0] * 10
    distill = [0.0] * 2 + [1.0] * 18
    grpo = [0.0] * 10 + [1.0] * 10
    figures = compare(teacher, distill, grpo, threshold=0.9)
    assert figures["student_reward_vs_teacher"] == 1.0
    assert (figures["distill_steps_to_target"], figures["grpo_steps_to_target"]) == (7, 15)
    assert figures["steps_vs_grpo"] == pytest.approx(7 / 15) and not figures["steps_vs_grpo_is_upper_bound"]
    # GRPO that never gets there: the run's length bounds its steps, so the ratio is an upper bound.
    figures = compare(teacher, distill, [0.0] * 20, threshold=0.9)
    assert figures["steps_vs_grpo"] == pytest.approx(7 / 20) and figures["steps_vs_grpo_is_upper_bound"]


def test_the_distilled_students_task_reward_is_its_verifier_component():
    assert task_rewards([{"reward/mean": 0.0, "reward/components/reward_fn": 0.75}, {"reward/mean": 0.5}]) == [
        0.75,
        0.5,
    ]


def test_exporting_a_run_without_a_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint.*--checkpoint.enabled true"):
        export_run(tmp_path, tmp_path / "out")
