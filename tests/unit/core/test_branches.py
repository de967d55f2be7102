"""Branch rollouts' core: pivot rules, branch completions, the tree's credit, the data plane's
tree growth (with a stand-in for the generator), metrics and the config's refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.core.advantages import episode_advantages, has_signal, token_advantages
from forge_rl.core.branches import BranchConfig, branch_completion, pick_pivots, token_entropies, tree_token_advantages
from forge_rl.core.buffer import BufferConfig
from forge_rl.core.columns import batch_columns, exact_versions
from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.rollout import EnvironmentConfig
from forge_rl.errors import ConfigError
from forge_rl.observability import metric_names as m
from forge_rl.observability.metrics import batch_metrics
from forge_rl.pipeline.branching import Brancher
from forge_rl.types import Completion, CompletionStatus, Episode, completion_from_dict, completion_to_dict
from tests.support.builders import make_episode

PROMPT = [1, 5, 6]


def sampled(logprobs: list[float], version: int = 0, reward: float = 0.0, kv: int | None = None) -> Completion:
    n = len(logprobs)
    return Completion(
        [20 + i for i in range(n)], logprobs, [version] * n, reward=reward, kv_versions=None if kv is None else [kv] * n
    )


def pivot_function(completion, prompt_token_ids):
    """A user's pivot rule for the tests: the middle token."""
    return [completion.num_tokens // 2]


def failing_pivot_function(completion, prompt_token_ids):
    raise RuntimeError("the verifier is down")


# Pivot rules ---------------------------------------------------------------------------------


def test_token_prob_picks_the_least_likely_tokens_inside_the_margins():
    completion = sampled([-0.1, -3.0, -0.2, -2.0, -0.1, -5.0])
    config = BranchConfig(rule="token_prob", pivots_per_sample=2, min_prefix_tokens=1, min_suffix_tokens=2)
    # Position 5 (the least likely) leaves fewer than 2 tokens after it; 0 is inside the prefix margin.
    assert pick_pivots(completion, config, PROMPT) == [1, 3]


def test_a_threshold_no_token_passes_finds_no_pivot():
    completion = sampled([-0.1, -0.2, -0.3, -0.1])
    config = BranchConfig(rule="token_prob", threshold=0.5)  # p <= 0.5 means logprob <= -0.69
    assert pick_pivots(completion, config, PROMPT) == []
    assert pick_pivots(sampled([-0.1, -1.0, -0.3, -0.1]), config, PROMPT) == [1]


def test_entropy_picks_the_most_uncertain_positions():
    completion = sampled([-0.5] * 5)
    completion.entropies = [0.1, 2.0, 0.3, 1.5, 0.2]
    assert pick_pivots(completion, BranchConfig(rule="entropy", pivots_per_sample=2), PROMPT) == [1, 3]
    assert pick_pivots(completion, BranchConfig(rule="entropy", threshold=1.8), PROMPT) == [1]


def test_a_function_rule_takes_its_positions_and_refuses_one_outside_the_completion():
    config = BranchConfig(rule="function", function="tests.unit.core.test_branches:pivot_function")
    assert pick_pivots(sampled([-0.5] * 6), config, PROMPT, pivot_function) == [3]
    with pytest.raises(ValueError, match=r"returned positions \[9\] outside the completion's candidates 1..5"):
        pick_pivots(sampled([-0.5] * 6), config, PROMPT, lambda c, p: [9])


def test_a_branch_is_pivoted_only_after_its_own_pivot():
    parent = sampled([-5.0, -0.1, -0.1, -0.1, -0.1, -0.1])
    child = branch_completion(parent, 0, 2, sampled([-0.1, -4.0, -0.1, -0.1]))
    config = BranchConfig(rule="token_prob", min_prefix_tokens=1)
    assert pick_pivots(child, config, PROMPT) == [3]  # its context (0, 1) and its first own token are out


def test_token_entropies_of_returned_logprobs_leave_filtered_tokens_out():
    uniform = [math.log(0.25)] * 4
    assert token_entropies([uniform, [0.0, -math.inf]]) == pytest.approx([math.log(4), 0.0])
    # Unnormalized top-k logprobs are renormalized over what was returned.
    assert token_entropies([[math.log(0.1)] * 2]) == pytest.approx([math.log(2)])


def test_config_errors_name_the_field_the_value_and_the_flag():
    with pytest.raises(ValueError, match=r"branch.rule \('deep'\) must be none, entropy, token_prob or function"):
        BranchConfig(rule="deep")
    with pytest.raises(
        ValueError, match=r"branch.branches_per_pivot \(0\) must be >= 1. Set --branch.branches-per-pivot"
    ):
        BranchConfig(rule="entropy", branches_per_pivot=0)
    with pytest.raises(ValueError, match="branch.function .* is set exactly when branch.rule is function"):
        BranchConfig(rule="entropy", function="m:f")
    with pytest.raises(ValueError, match=r"branch.threshold \(2.0\) is a token probability"):
        BranchConfig(rule="token_prob", threshold=2.0)


# Branch completions ------------------------------------------------------------------------


def test_a_branch_holds_its_parents_prefix_as_context_and_its_own_versions():
    parent = sampled([-0.1, -0.2, -0.3, -0.4], version=3, kv=3)
    piece = sampled([-1.0, -1.1, -1.2], version=5, kv=5)
    piece.text = "whole text"
    branch = branch_completion(parent, 0, 2, piece)
    assert branch.token_ids == parent.token_ids[:2] + piece.token_ids
    assert branch.generated == [False, False, True, True, True]
    assert branch.loss_mask == [False, False, True, True, True]  # the prefix trains in its parent only
    assert branch.policy_versions == [5] * 5 and branch.kv_versions == [5] * 5
    assert exact_versions(branch) == [-1, -1, 5, 5, 5]
    assert (branch.parent, branch.fork_at, branch.text) == (0, 2, "whole text")
    assert branch.oldest_policy_version == 5
    assert completion_from_dict(completion_to_dict(branch)) == branch  # checkpoints keep the tree


def test_a_continuation_over_kv_of_older_weights_is_as_old_as_they_are():
    """The engine labels a continuation submitted under version 4 and sampled after a swap to 5
    that kept its KV as [4, 5] by sampler and [4, 4] by dependency: the age bound reads the latter."""
    parent = sampled([-0.1] * 3, version=4, kv=4)
    piece = Completion([30, 31], [-1.0, -1.0], [4, 5], kv_versions=[4, 4])
    branch = branch_completion(parent, 0, 1, piece)
    assert exact_versions(branch) == [-1, 4, 4]
    metrics = batch_metrics([Episode(0, "p", "a", PROMPT, [parent, branch])], train_version=6)
    assert metrics[m.POLICY_AGE_MAX] == 2 and metrics[m.POLICY_AGE_DEPENDENCY_MAX] == 2
    assert metrics[m.POLICY_AGE_DEPENDENCY_MEAN] == 2.0
    assert metrics[m.POLICY_AGE_MEAN] == pytest.approx((3 * 2 + 1 * 2 + 1 * 1) / 5)


# Credit on trees ---------------------------------------------------------------------------


def worked_tree() -> Episode:
    """Two roots with rewards 1 and 0; root 0 branched at token 2 into two branches scoring 0 and 1."""
    roots = [sampled([-0.5] * 4, reward=1.0), sampled([-0.5] * 4, reward=0.0)]
    branches = [branch_completion(roots[0], 0, 2, sampled([-0.5] * 3, reward=r)) for r in (0.0, 1.0)]
    for branch, r in zip(branches, (0.0, 1.0)):
        branch.reward = r
    return Episode(0, "p", "a", PROMPT, roots + branches)


def test_tree_advantages_of_the_documented_worked_example():
    """docs/branches.md's example: leaves [1, 0, 0, 1], sigma 0.5; V(root 0 before the pivot) =
    2/3, V(root 0 after) = 1, V(root 1) = 0, mu = 1/3."""
    w = 0.5
    advantages = tree_token_advantages(worked_tree(), normalize_std=True, local_weight=w)
    sigma = 0.5 + 1e-6
    assert advantages[0] == pytest.approx([(1 / 3) / sigma] * 2 + [(2 / 3 + w / 3) / sigma] * 2)
    assert advantages[1] == pytest.approx([(-1 / 3) / sigma] * 4)
    assert advantages[2] == pytest.approx([0.0] * 2 + [(-1 / 3 - w * 2 / 3) / sigma] * 3)
    assert advantages[3] == pytest.approx([0.0] * 2 + [(2 / 3 + w / 3) / sigma] * 3)
    # The same through the loss's entry point and the trainer's columns.
    assert token_advantages(worked_tree(), True, 1.0, w) == advantages
    columns = batch_columns([worked_tree()], True, 1.0, w)
    assert columns.num_rows == 4 and columns.num_trained_tokens == 4 + 4 + 3 + 3


def test_a_group_without_branches_gets_grpo_advantages():
    episode = make_episode(rewards=(1.0, 0.0, 0.5, 0.25), num_tokens=3)
    per_completion = episode_advantages(episode, normalize_std=True)
    tree = tree_token_advantages(episode, normalize_std=True, local_weight=1.0)
    assert tree == [pytest.approx([a] * 3) for a in per_completion]


def test_a_tree_whose_leaves_all_agree_carries_no_signal_and_one_that_differs_at_a_pivot_does():
    roots = [sampled([-0.5] * 4, reward=1.0), sampled([-0.5] * 4, reward=1.0)]
    same = [branch_completion(roots[0], 0, 2, sampled([-0.5] * 2, reward=1.0))]
    same[0].reward = 1.0
    assert tree_token_advantages(Episode(0, "p", "a", PROMPT, roots + same), True, 1.0) == [
        [0.0] * 4,
        [0.0] * 4,
        [0.0] * 4,
    ]
    assert not has_signal(Episode(0, "p", "a", PROMPT, roots + same))
    differs = [branch_completion(roots[0], 0, 2, sampled([-0.5] * 2, reward=0.0))]
    assert has_signal(Episode(0, "p", "a", PROMPT, roots + differs))  # the roots alone would carry none


def test_an_errored_branch_gets_zeros_and_is_no_leaf():
    tree = worked_tree()
    tree.completions[2].status = CompletionStatus.ERRORED
    advantages = tree_token_advantages(tree, normalize_std=False, local_weight=1.0)
    assert advantages[2] == [0.0] * 5
    # Leaves 1, 0, 1 (no std division): V(root 0 before its pivot) = mean(1, 1), mu = (1 + 0) / 2.
    assert advantages[0][:2] == pytest.approx([1.0 - 0.5] * 2)


# The data plane's growth -------------------------------------------------------------------


class StandInGenerator:
    """A test stand-in for the generator's `generate_branches`: continuations of fixed tokens, their
    logprobs decreasing so token_prob finds a pivot, and a prefix-cache hit for every head."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], int]] = []

    async def __call__(self, episode, heads, n):
        self.calls.append((heads, n))
        return [([sampled([-0.1, -0.2, -3.0, -0.1], version=1) for _ in range(n)], len(PROMPT) + len(h)) for h in heads]


def test_growth_branches_each_round_from_the_rules_pivots_and_counts_them():
    generator = StandInGenerator()
    brancher = Brancher(BranchConfig(rule="token_prob", branches_per_pivot=2, depth=2))
    group = Episode(0, "p", "a", PROMPT, [sampled([-0.1, -4.0, -0.1, -0.1]), sampled([-0.1, -0.1, -0.1, -0.1])])
    tree = asyncio.run(brancher.grow(group, generator))
    # Round 1: one pivot per root (position 1 of root 0; root 1's least likely is its first candidate, 1).
    # Round 2: each of the 4 branches once, at its own least likely token (fork 1 + 2 = position 3).
    assert [heads for heads, _ in generator.calls] == [
        [group.completions[0].token_ids[:1], group.completions[1].token_ids[:1]],
        [tree.completions[i].token_ids[:3] for i in (2, 3, 4, 5)],
    ]
    assert len(tree.completions) == 2 + 4 + 8
    assert [c.parent for c in tree.completions] == [None, None, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert brancher.counts.pivots == 6 and brancher.counts.branches == 12
    metrics = brancher.counts.metrics()
    assert metrics[m.BRANCH_PREFIX_CACHE_HIT_FRACTION] == 1.0 and metrics[m.BRANCH_UNBRANCHED_TOTAL] == 0


def test_a_pivot_function_that_raises_leaves_its_completions_unbranched_counted_and_warned_once(caplog):
    brancher = Brancher(BranchConfig(rule="function", function="tests.unit.core.test_branches:failing_pivot_function"))
    group = make_episode(rewards=(1.0, 0.0), num_tokens=4)
    with caplog.at_level(logging.WARNING):
        tree = asyncio.run(brancher.grow(group, StandInGenerator()))
    assert tree.completions == group.completions
    assert brancher.counts.pivot_errors == 2
    assert sum("the verifier is down" in r.getMessage() for r in caplog.records) == 1


def test_a_rule_that_finds_no_pivot_trains_the_group_as_a_plain_one():
    brancher = Brancher(BranchConfig(rule="token_prob", threshold=0.01))
    group = make_episode(rewards=(1.0, 0.0), num_tokens=4)
    generator = StandInGenerator()
    tree = asyncio.run(brancher.grow(group, generator))
    assert tree.completions == group.completions and generator.calls == []
    assert brancher.counts.unbranched == 2


# The run's config -------------------------------------------------------------------------


def small(**overrides) -> GRPOConfig:
    return GRPOConfig(
        **{"train_batch_size": 8, "group_size": 4, "generator": GeneratorConfig(max_new_tokens=8), **overrides}
    )


def test_entropy_branching_makes_the_generator_record_entropies():
    config = small(branch=BranchConfig(rule="entropy", entropy_top_logprobs=12))
    assert config.generator.record_entropy_top_logprobs == 12
    assert small().generator.record_entropy_top_logprobs == 0


def test_the_buffer_bound_counts_every_completion_a_tree_can_hold():
    branch = BranchConfig(rule="token_prob", pivots_per_sample=2, branches_per_pivot=3, depth=2)
    assert branch.max_completions_per_group(4) == 4 * (1 + 6 + 36)
    config = small(branch=branch)
    assert config.max_episode_tokens == config.max_model_len - 8 + 4 * 43 * 8
    with pytest.raises(
        ConfigError,
        match=rf"buffer.capacity_tokens \(2000\) is below one step's prompts \(2\).*{2 * config.max_episode_tokens}",
    ):
        small(branch=branch, buffer=BufferConfig(capacity_tokens=2000))


def test_branching_is_refused_where_it_cannot_work_naming_the_setting():
    with pytest.raises(ConfigError, match=r"branch.rule \(entropy\) with environment.name \('calculator'\)"):
        small(branch=BranchConfig(rule="entropy"), environment=EnvironmentConfig(name="calculator"))
    with pytest.raises(
        ConfigError,
        match=r"branch.min_prefix_tokens \(5\) \+ branch.min_suffix_tokens \(4\) exceed generator.max_new_tokens \(8\)",
    ):
        small(branch=BranchConfig(rule="entropy", min_prefix_tokens=5, min_suffix_tokens=4))
    with pytest.raises(ConfigError, match="branch.function .*cannot be imported"):
        small(branch=BranchConfig(rule="function", function="no_such_module:pick"))


def test_the_bench_compares_the_tree_with_plain_groups_of_equal_samples_and_of_the_same_roots():
    from forge_rl.bench.branches import variant_changes

    base = small(branch=BranchConfig(rule="token_prob", branches_per_pivot=3))
    changes = variant_changes(base)
    assert changes["branch"] == {}
    equal = dataclasses.replace(base, **changes["plain-equal"])
    assert not equal.branch.enabled and equal.group_size == base.group_size * 4
    assert equal.prompts_per_step == base.prompts_per_step
    assert dataclasses.replace(base, **changes["plain-roots"]).group_size == base.group_size
    with pytest.raises(ConfigError, match="branch.rule is none"):
        variant_changes(small())
