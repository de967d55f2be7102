"""Branch rollouts through a whole run (configs/grpo_branch_tiny_cpu.yaml): every group grows into a
tree on the real engine, sampled across the trainer's weight swaps, trained as prefix trees with
tree credit, and no trained token is older than the bound by either of its versions: the one that
sampled it and the one whose KV its context came from."""

from __future__ import annotations

import pytest

from forge_rl.core.branches import BranchConfig
from forge_rl.observability import metric_names as m
from tests.support.helpers import assert_every_prompt_accounted_for, run_config_file
from tests.support.workers import REPO

pytestmark = pytest.mark.integration

NUM_STEPS = 6


@pytest.fixture(scope="module")
def branch_run(tmp_path_factory):
    return run_config_file(
        REPO / "configs/grpo_branch_tiny_cpu.yaml", tmp_path_factory.mktemp("runs"), "branch", steps=NUM_STEPS
    )


def test_every_step_trains_trees_whose_tokens_are_within_the_age_bound_by_both_versions(branch_run):
    summary, metrics, config = branch_run
    bound = config.buffer.max_policy_age
    assert summary["steps"] == NUM_STEPS and len(metrics) == NUM_STEPS
    assert summary["max_policy_age_seen"] <= bound and summary["max_dependency_age_seen"] <= bound
    assert all(step[m.POLICY_AGE_DEPENDENCY_MAX] <= bound for step in metrics)
    assert_every_prompt_accounted_for(summary["accounting"], trained=NUM_STEPS * config.prompts_per_step)


def test_each_pivot_grows_k_continuations_and_the_shared_prefixes_are_computed_once(branch_run):
    _, metrics, config = branch_run
    last = metrics[-1]
    assert last[m.BRANCH_PIVOTS_TOTAL] > 0 and last[m.BRANCH_PIVOT_ERRORS_TOTAL] == 0
    assert last[m.BRANCH_COMPLETIONS_TOTAL] == config.branch.branches_per_pivot * last[m.BRANCH_PIVOTS_TOTAL]
    # The trainer lays each tree out once: its prompt and every pivot's prefix are shared slots.
    assert all(step["shared_token_fraction"] > 0.3 for step in metrics)


@pytest.fixture(scope="module")
def fork_run(tmp_path_factory):
    """The calculator recipe (configs/grpo_tool_tiny_cpu.yaml) with its episodes forked at turns."""
    return run_config_file(
        REPO / "configs/grpo_tool_tiny_cpu.yaml",
        tmp_path_factory.mktemp("runs"),
        "forks",
        steps=NUM_STEPS,
        branch=BranchConfig(rule="token_prob", branches_per_pivot=2),
    )


def test_environment_episodes_fork_at_turns_replayed_on_fresh_environments(fork_run):
    """Every fork's replay reaches its episode's state on the real calculator (none diverged), and
    the forks train within the age bound with every prompt accounted for."""
    summary, metrics, config = fork_run
    last = metrics[-1]
    assert summary["steps"] == NUM_STEPS
    assert last[m.BRANCH_PIVOTS_TOTAL] > 0 and last[m.BRANCH_PIVOT_ERRORS_TOTAL] == 0
    assert last[m.BRANCH_COMPLETIONS_TOTAL] == config.branch.branches_per_pivot * last[m.BRANCH_PIVOTS_TOTAL]
    assert summary["max_dependency_age_seen"] <= config.buffer.max_policy_age
    assert_every_prompt_accounted_for(summary["accounting"], trained=NUM_STEPS * config.prompts_per_step)
