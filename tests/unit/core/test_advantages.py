import pytest
import torch

from forge_rl.core.advantages import DynamicSampling, episode_advantages, group_advantages, has_signal, overlong_penalty
from forge_rl.errors import NoLearningSignal
from forge_rl.types import CompletionStatus
from tests.support.builders import make_episode


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


def dynamic_sampling_split(episodes):
    """(kept, filtered) by a run's dynamic sampling, with a stop far off."""
    kept = DynamicSampling(max_filtered_steps=100, prompts_per_step=1).filter(episodes)
    return kept, [e for e in episodes if all(e is not k for k in kept)]


def test_dynamic_sampling_filters_groups_whose_rewards_are_all_equal():
    signal, all_right, all_wrong, one_usable = (
        make_episode(0, rewards=(1.0, 0.0)),
        make_episode(1, rewards=(1.0, 1.0)),
        make_episode(2, rewards=(0.0, 0.0)),
        make_episode(3, rewards=(1.0, 0.0)),
    )
    one_usable.completions[1].status = CompletionStatus.ERRORED
    kept, filtered = dynamic_sampling_split([signal, all_right, all_wrong, one_usable])
    assert [e.episode_id for e in kept] == [0]
    assert [e.episode_id for e in filtered] == [1, 2, 3]


def test_a_group_whose_rewards_are_all_equal_has_exactly_zero_advantages_whatever_the_value():
    """0.7 three times has a float mean that is not 0.7: the advantages must still be 0, not rounding."""
    assert group_advantages([0.7, 0.7, 0.7], normalize_std=True) == [0.0, 0.0, 0.0]
    assert group_advantages([0.1] * 6, normalize_std=False) == [0.0] * 6


def test_dynamic_sampling_keeps_a_group_whose_signal_is_in_its_token_rewards_alone():
    """Equal final rewards (a teacher alone, scorer.reward_fn_weight 0), differing token rewards."""
    episode = make_episode(rewards=(0.0, 0.0))
    episode.completions[0].token_rewards = [0.5, -0.5]
    episode.completions[1].token_rewards = [-0.5, 0.5]
    kept, filtered = dynamic_sampling_split([episode])
    assert kept == [episode] and filtered == []


def test_dynamic_sampling_keeps_a_group_whose_signal_is_in_its_step_or_turn_rewards_alone():
    episode = make_episode(rewards=(1.0, 1.0), num_tokens=2)
    for completion, step_rewards in zip(episode.completions, ([1.0, 0.0], [0.0, 0.0])):
        completion.step_ends, completion.step_rewards = [1, 2], step_rewards
    assert has_signal(episode, normalize_std=True, step_discount=0.0)
    assert dynamic_sampling_split([episode])[0] == [episode]


def test_a_group_whose_only_nonzero_advantages_fall_on_tokens_that_do_not_train_has_no_signal():
    """The first completion's tokens are all masked (mask_tokens) and the second's advantage
    cancels: nothing that trains would move."""
    episode = make_episode(rewards=(1.0, 0.0, 0.5))
    episode.completions[0].trainable = [False, False]
    episode.completions[1].trainable = [False, False]
    assert not has_signal(episode)
    episode.completions[1].trainable = [True, False]
    assert has_signal(episode)


def test_dynamic_sampling_stops_the_run_after_n_steps_of_groups_all_filtered_naming_the_cause():
    """Two steps' worth (2 x 3 prompts per step) of groups in a row without signal: the sixth
    raises, naming the setting, what the groups held and the fix; a group with signal resets the count."""
    sampling = DynamicSampling(max_filtered_steps=2, prompts_per_step=3)
    uniform = [make_episode(i, rewards=(0.0, 0.0)) for i in range(5)]
    assert sampling.filter(uniform[:4]) == []
    signal = make_episode(9, rewards=(1.0, 0.0))
    assert sampling.filter([signal, uniform[4]]) == [signal]  # the count starts again after it
    assert sampling.filter(uniform[:4]) == []
    with pytest.raises(NoLearningSignal) as error:
        sampling.filter(uniform[:2])
    message = str(error.value)
    assert "dynamic_sampling filtered the last 6 groups in a row (dynamic_sampling_max_filtered_steps 2" in message
    assert "final rewards all 0" in message and "no token rewards" in message
    assert "--no-dynamic-sampling" in message and "--dynamic-sampling-max-filtered-steps" in message


@pytest.mark.parametrize("num_tokens,expected", [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (15, -0.75), (16, -1.0)])
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
