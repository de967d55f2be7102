import pytest
import torch

from forge_rl.advantages import (
    episode_advantages,
    filter_zero_advantage_groups,
    group_advantages,
    overlong_penalty,
)
from forge_rl.types import CompletionStatus

from .builders import make_episode


def test_group_advantages_are_zero_mean_unit_std_and_zero_for_uniform_groups():
    advantages = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    assert advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([1.0, 1.0, 1.0], normalize_std=True) == [0.0, 0.0, 0.0]


def test_dr_grpo_advantages_keep_the_reward_scale():
    advantages = group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False)
    assert advantages == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_group_advantages_match_the_tensor_formula():
    rewards = [0.3, 1.0, 0.0, 0.7, 0.7, 0.1, 0.9, 0.25]
    rewards_G = torch.tensor(rewards, dtype=torch.float64)
    centered_G = rewards_G - rewards_G.mean()
    expected = (centered_G / (rewards_G.std(unbiased=False) + 1e-6)).tolist()
    assert group_advantages(rewards, normalize_std=True) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_errored_completions_get_zero_and_stay_out_of_the_group_statistics():
    episode = make_episode(rewards=(1.0, 0.0, 5.0))
    episode.completions[2].status = CompletionStatus.ERRORED
    assert episode_advantages(episode, normalize_std=False) == pytest.approx([0.5, -0.5, 0.0])


def test_dynamic_sampling_filters_groups_whose_rewards_are_all_equal():
    signal, all_right, all_wrong, one_usable = (
        make_episode(0, rewards=(1.0, 0.0)),
        make_episode(1, rewards=(1.0, 1.0)),
        make_episode(2, rewards=(0.0, 0.0)),
        make_episode(3, rewards=(1.0, 0.0)),
    )
    one_usable.completions[1].status = CompletionStatus.ERRORED
    kept, filtered = filter_zero_advantage_groups([signal, all_right, all_wrong, one_usable])
    assert [e.episode_id for e in kept] == [0]
    assert [e.episode_id for e in filtered] == [1, 2, 3]


@pytest.mark.parametrize(
    "num_tokens,expected",
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (15, -0.75), (16, -1.0)],
)
def test_overlong_penalty_ramps_from_zero_to_minus_one_over_the_buffer(num_tokens, expected):
    assert overlong_penalty(num_tokens, max_new_tokens=16, overlong_buffer=4) == pytest.approx(expected)


def test_overlong_penalty_refuses_what_the_engine_cannot_produce():
    """No buffer would penalize only lengths above the budget, which the engine never samples."""
    with pytest.raises(ValueError, match=r"overlong_buffer \(0\) must be in \[1"):
        overlong_penalty(16, max_new_tokens=16, overlong_buffer=0)
    with pytest.raises(ValueError, match="a completion of 17 tokens cannot exist"):
        overlong_penalty(17, max_new_tokens=16, overlong_buffer=4)


def test_overlong_buffer_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match=r"overlong_buffer \(20\) must be in \[1, max_new_tokens \(16\)\]"):
        overlong_penalty(3, max_new_tokens=16, overlong_buffer=20)
