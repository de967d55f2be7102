"""Per-step metrics and the run summary (forge_rl/observability/metrics.py)."""

import pytest

from forge_rl.core.buffer import BufferConfig, ReplayBuffer
from forge_rl.observability import metric_names as m
from forge_rl.observability import metrics
from forge_rl.observability.metric_names import POLICY_AGE_HISTOGRAM, POLICY_AGE_MAX
from forge_rl.observability.metrics import batch_metrics, final_reward, run_summary
from tests.support.builders import make_completion, make_episode


def test_policy_age_counts_only_tokens_that_reach_the_loss():
    """With drop_policy mask_tokens, tokens older than max_policy_age stay in the batch but are
    never trained: they must not show up as ages above the bound."""
    episode = make_episode(rewards=(1.0, 0.0))
    episode.completions = [make_completion(policy_version=[0, 2, 2]), make_completion(policy_version=[2, 2, 2])]
    episode.completions[0].kv_versions = [0, 2, 2]  # its swap re-encoded the KV: version 2's tokens depend on 2 alone
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, drop_policy="mask_tokens"))
    assert buffer.put(episode, trainer_version=3)
    (trained,) = buffer.sample(1, trainer_version=3)

    step = batch_metrics([trained], train_version=3)

    assert step[POLICY_AGE_MAX] == 1
    assert step[POLICY_AGE_HISTOGRAM] == {"1": 5}  # the masked age-3 token is not counted
    assert step["completions/mean_tokens"] == 3  # lengths still count every token


def test_the_final_reward_is_the_mean_of_the_last_five_steps_in_the_run_and_the_benchmarks():
    history = [
        {
            "reward/mean": r,
            "policy_age/max": 0,
            "buffer/dropped_completions": 0,
            "completions/errored": 0,
            "wall_time_s": float(i),
            "idle_fraction/trainer": 0.5,
            "idle_fraction/generators": 0.25,
        }
        for i, r in enumerate([0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ]
    assert final_reward(history) == sum([0.2, 0.4, 0.6, 0.8, 1.0]) / 5
    summary = run_summary(history)
    assert summary["final_mean_reward"] == final_reward(history)
    assert summary["steps"] == 7 and summary["loop_time_s"] == 6.0
    assert summary["trainer_idle_fraction"] == 0.5 and summary["generator_idle_fraction"] == 0.25
    assert "mean_turns_per_episode" not in summary  # a run without an environment


def test_a_run_on_an_environment_reports_turns_per_episode_over_the_final_window_weighted_by_episodes():
    step = {
        "reward/mean": 1.0,
        "policy_age/max": 0,
        "buffer/dropped_completions": 0,
        "completions/errored": 0,
        "wall_time_s": 1.0,
        "idle_fraction/trainer": 0.5,
        "idle_fraction/generators": 0.25,
        m.GENERATORS_IDLE_ON_ENV_FRACTION: 0.1,
    }
    history = [
        step | {m.TURNS_PER_EPISODE: turns, m.EPISODES_PLAYED: played}
        for turns, played in [(9.0, 100), (1.0, 8), (2.0, 24), (0.0, 0), (3.0, 8), (1.0, 0)]
    ]
    summary = run_summary(history)
    assert summary["mean_turns_per_episode"] == (8 * 1 + 24 * 2 + 8 * 3) / 40  # the first step is outside the window
    assert summary["generator_idle_waiting_on_env_fraction"] == 0.1


def test_the_trainer_overhead_fraction_is_overhead_over_compute_plus_overhead_data_wait_excluded():
    step = {
        m.TRAINER_DATA_WAIT_S: 5.0,  # generation's share: not the trainer's overhead
        m.TRAINER_FORWARD_S: 1.0, m.TRAINER_BACKWARD_S: 2.0, m.TRAINER_OPTIMIZER_S: 0.5,
        m.TRAINER_BATCHING_S: 0.1, m.TRAINER_PUBLISH_S: 0.2, m.TRAINER_OVERHEAD_S: 0.5,
    }  # fmt: skip
    summary = metrics.trainer_overhead_summary([step, step])
    assert summary["trainer_overhead_fraction"] == pytest.approx(1.0 / (7.0 + 1.0))
    assert summary["trainer_time_s"] == {
        "data_wait": 10.0, "forward": 2.0, "backward": 4.0, "optimizer": 1.0, "batching": 0.2, "publish": 0.4, "overhead": 1.0,
    }  # fmt: skip
    assert metrics.trainer_overhead_summary([{m.STEP: 1}]) == {}  # a simulated trainer reports no breakdown


def test_the_generators_time_splits_into_forward_other_busy_and_idle_summed_over_generators():
    last = {m.WALL_TIME_S: 10.0, m.GENERATORS_IDLE_FRACTION: 0.25}  # 2 generators: 20 s, 15 s busy
    summary = metrics.generator_time_summary([last], [{"forward_s": 4.0}, {"forward_s": 5.0}])
    assert summary["generator_time_s"] == {"forward": 9.0, "busy_other": 6.0, "idle": 5.0}
    assert summary["generator_forward_fraction"] == pytest.approx(9.0 / 20.0)
    # A generator not serving at the end (or a simulated one) reports none: no split then.
    assert metrics.generator_time_summary([last], [{"forward_s": 4.0}, {}]) == {}


def test_zero_advantage_fraction_counts_groups_without_a_nonzero_advantage_on_a_trained_token():
    """Equal final rewards with a teacher's token rewards is a group with signal; unequal rewards
    whose tokens were all masked for their age is one without."""
    dense = make_episode(0, rewards=(0.0, 0.0))
    for completion, rewards in zip(dense.completions, ([0.3, -0.1], [-0.3, 0.1])):
        completion.token_rewards = rewards
    masked = make_episode(1, rewards=(1.0, 0.0))
    for completion in masked.completions:
        completion.trainable = [False] * completion.num_tokens
    plain = make_episode(2, rewards=(1.0, 0.0))
    assert batch_metrics([dense], 0)[m.ZERO_ADVANTAGE_FRACTION] == 0.0
    assert batch_metrics([masked], 0)[m.ZERO_ADVANTAGE_FRACTION] == 1.0
    assert batch_metrics([dense, masked, plain], 0)[m.ZERO_ADVANTAGE_FRACTION] == pytest.approx(1 / 3)
