"""The mismatch alarm (forge_rl/observability/health.py) on fabricated per-step metrics."""

import pytest

from forge_rl.observability.health import MismatchAlarm, MismatchAlarmConfig, token_versions_by_generator
from tests.support.builders import make_episode


def step_metrics(**kl_by_generator: float) -> dict:
    """The fresh mismatch KL (exact tokens of the trainer's version) the alarm watches, per generator."""
    return {f"mismatch_kl_fresh/generator/{name.removeprefix('g')}": kl for name, kl in kl_by_generator.items()}


def versions_of(generator: int, policy_version: int) -> dict[int, str]:
    """What the rollouts report of a one-episode batch of `generator` sampled at `policy_version`."""
    episode = make_episode(policy_version=policy_version)
    episode.generator_index = generator
    return token_versions_by_generator([episode])


def test_a_generator_whose_mismatch_jumps_above_the_others_is_named_with_its_versions():
    alarm = MismatchAlarm(MismatchAlarmConfig())
    assert alarm.observe(1, step_metrics(g0=2e-3, g1=2.1e-3), versions_of(1, 0), train_version=1) == []
    (warning,) = alarm.observe(2, step_metrics(g0=2e-3, g1=0.5), versions_of(1, 1), train_version=2)
    assert "step 2: generator 1's sampler mismatch KL 0.5" in warning
    assert "policy versions 1 (trained at 2)" in warning


def test_a_single_generator_is_compared_with_its_own_running_level_after_warmup():
    alarm = MismatchAlarm(MismatchAlarmConfig(warmup_steps=2))
    assert alarm.observe(1, step_metrics(g0=0.5), {}, 1) == []  # nothing to compare with yet
    for step in (2, 3):
        assert alarm.observe(step, step_metrics(g0=2e-3), {}, step) == []
    assert alarm.observe(4, step_metrics(g0=3e-3), {}, 4) == []  # noise, not a jump
    assert len(alarm.observe(5, step_metrics(g0=0.2), {}, 5)) == 1


def test_the_policy_lag_of_older_tokens_never_raises_the_alarm():
    """The calculator recipe (max_policy_age 1), steps 345-347: the all-token KL of one-version-old
    tokens sits at numerics after a step without gradient, then jumps 1e7x with the next real
    update. That is the update's size, not a generator serving other weights; the fresh KL stays put."""
    alarm = MismatchAlarm(MismatchAlarmConfig(warmup_steps=2))
    lagged = [4e-4, 3e-4, 5e-4, 1e-9, 7.7e-2]
    for step, kl in enumerate(lagged, start=1):
        metrics = {"mismatch_kl/generator/0": kl, "policy_age/max": 1} | step_metrics(g0=5e-9)
        assert alarm.observe(step, metrics, {}, step) == []


def test_a_generator_that_keeps_serving_old_weights_is_caught_on_its_exact_tokens():
    """An update that silently did not apply: tokens labelled with the trainer's version were
    sampled by weights one, then two, then three updates old."""
    alarm = MismatchAlarm(MismatchAlarmConfig(warmup_steps=2))
    for step in (1, 2, 3):
        assert alarm.observe(step, step_metrics(g0=5e-9), {}, step) == []
    assert alarm.observe(4, step_metrics(g0=4e-4), {}, 4) == []  # below min_kl: not yet told from noise
    (warning,) = alarm.observe(5, step_metrics(g0=3e-3), {}, 5)
    assert "generator 0's sampler mismatch KL 0.003 on tokens of the trainer's own version" in warning


def test_a_step_without_exact_tokens_leaves_the_running_level_alone():
    alarm = MismatchAlarm(MismatchAlarmConfig(warmup_steps=2))
    for step in (1, 2):
        assert alarm.observe(step, step_metrics(g0=5e-9), {}, step) == []
    assert alarm.observe(3, {"mismatch_kl/generator/0": 0.05}, {}, 3) == []  # every token one version old
    assert len(alarm.observe(4, step_metrics(g0=0.05), {}, 4)) == 1


def test_without_exact_tokens_a_generator_is_compared_with_the_others_lagged_by_the_same_updates():
    """Single-turn async batches are taken ahead of the step: no token is of the trainer's version.
    Every generator's KL then carries the same updates' lag; one far above the others stands out."""
    alarm = MismatchAlarm(MismatchAlarmConfig())
    lagged = {"mismatch_kl/generator/0": 2e-3, "mismatch_kl/generator/1": 3e-3, "mismatch_kl/generator/2": 0.2}
    (warning,) = alarm.observe(1, lagged, {}, 1)
    assert "generator 2's sampler mismatch KL 0.2 on all its tokens is" in warning


def test_kl_at_numerical_noise_never_warns_and_factor_0_turns_the_alarm_off():
    alarm = MismatchAlarm(MismatchAlarmConfig())
    assert alarm.observe(1, step_metrics(g0=1e-12, g1=1e-8), {}, 1) == []  # 10000x, but below min_kl
    off = MismatchAlarm(MismatchAlarmConfig(factor=0))
    assert off.observe(1, step_metrics(g0=1e-3, g1=1.0), {}, 1) == []


def test_a_factor_that_cannot_mean_a_jump_is_refused():
    with pytest.raises(ValueError, match=r"log.mismatch_alarm.factor \(0.5\) must be > 1"):
        MismatchAlarmConfig(factor=0.5)
