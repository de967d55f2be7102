from forge_rl.core.accounting import PromptAccounting
from tests.support.builders import make_episode


def test_counts_add_up_and_a_prompt_trained_twice_is_reported():
    accounting = PromptAccounting(handed_out=5)
    accounting.count_trained([make_episode(0), make_episode(1)])
    accounting.count_trained([make_episode(3), make_episode(1)])
    summary = accounting.summary(num_dropped=1)
    assert summary["trained"] == 3
    assert summary["unfinished_at_stop"] == 1
    assert summary["trained_more_than_once"] == 1


def test_prompts_filtered_by_dynamic_sampling_are_accounted_for():
    accounting = PromptAccounting(handed_out=5)
    accounting.count_filtered([make_episode(2), make_episode(3)])
    accounting.count_trained([make_episode(0), make_episode(1)])
    summary = accounting.summary(num_dropped=0)
    assert summary["filtered_zero_advantage"] == 2
    assert summary["unfinished_at_stop"] == 1
