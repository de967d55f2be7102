"""Per-step metrics and the run summary (forge_rl/metrics.py)."""

from forge_rl.buffer import BufferConfig, ReplayBuffer
from forge_rl.metrics import POLICY_AGE_HISTOGRAM, POLICY_AGE_MAX, batch_metrics, final_reward, run_summary
from tests.unit.builders import make_completion, make_episode


def test_policy_age_counts_only_tokens_that_reach_the_loss():
    """With drop_policy mask_tokens, tokens older than max_policy_age stay in the batch but are
    never trained: they must not show up as ages above the bound."""
    episode = make_episode(rewards=(1.0, 0.0))
    episode.completions = [make_completion(policy_version=[0, 2, 2]), make_completion(policy_version=[2, 2, 2])]
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, drop_policy="mask_tokens"))
    assert buffer.put(episode, trainer_version=3)
    (trained,) = buffer.sample(1, trainer_version=3)

    step = batch_metrics([trained], train_version=3)

    assert step[POLICY_AGE_MAX] == 1
    assert step[POLICY_AGE_HISTOGRAM] == {"1": 5}  # the masked age-3 token is not counted
    assert step["completions/mean_tokens"] == 3  # lengths still count every token


def test_the_final_reward_is_the_mean_of_the_last_five_steps_in_the_run_and_the_benchmarks():
    history = [
        {"reward/mean": r, "policy_age/max": 0, "buffer/dropped_completions": 0, "completions/errored": 0,
         "wall_time_s": float(i), "idle_fraction/trainer": 0.5, "idle_fraction/generators": 0.25}
        for i, r in enumerate([0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ]
    assert final_reward(history) == sum([0.2, 0.4, 0.6, 0.8, 1.0]) / 5
    summary = run_summary(history)
    assert summary["final_mean_reward"] == final_reward(history)
    assert summary["steps"] == 7 and summary["loop_time_s"] == 6.0
    assert summary["trainer_idle_fraction"] == 0.5 and summary["generator_idle_fraction"] == 0.25
