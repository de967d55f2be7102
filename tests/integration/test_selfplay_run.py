"""Proposer/solver self-play through a whole run (configs/selfplay_tiny_cpu.yaml): one policy plays
both seats of forge_rl/envs/selfplay.py on the real engine and trainer, each episode a graph of a
proposer and its solvers, trained with per-seat credit within the age bound, every prompt
accounted for."""

from __future__ import annotations

import pytest

from tests.support.helpers import assert_every_prompt_accounted_for, run_config_file
from tests.support.workers import REPO

pytestmark = pytest.mark.integration

NUM_STEPS = 6


@pytest.fixture(scope="module")
def selfplay_run(tmp_path_factory):
    return run_config_file(
        REPO / "configs/selfplay_tiny_cpu.yaml", tmp_path_factory.mktemp("runs"), "selfplay", steps=NUM_STEPS
    )


def test_each_step_trains_both_seats_with_a_reward_of_their_own(selfplay_run):
    summary, metrics, config = selfplay_run
    assert summary["steps"] == NUM_STEPS and len(metrics) == NUM_STEPS
    for step in metrics:
        # A proposer's turn is its task or none (-1); the solvers of a task earn 0 or 1 each.
        assert -1.0 <= step["reward/by_seat/proposer"] <= 1.0
    assert any("reward/by_seat/solver" in step for step in metrics)
    assert max(step["episodes/agents_mean"] for step in metrics) > 1  # proposers wrote tasks, solvers answered


def test_no_trained_token_is_older_than_the_bound_and_every_prompt_is_accounted_for(selfplay_run):
    summary, metrics, config = selfplay_run
    assert max(step["policy_age/max"] for step in metrics) <= config.buffer.max_policy_age
    assert_every_prompt_accounted_for(summary["accounting"], trained=NUM_STEPS * config.prompts_per_step)
