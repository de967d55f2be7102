"""`forge-rl bench lora-sync`'s verdict on the demo's final reward, full fine-tuning vs LoRA."""

import pytest

from forge_rl.bench.lora_sync import MIN_REWARD_NOISE, rewards_agree


def test_seeds_within_twice_the_standard_error_agree():
    verdict = rewards_agree([0.95, 0.91], [0.93, 0.89])
    assert verdict["rewards_agree"] and verdict["final_reward_gap_lora_minus_full"] == pytest.approx(-0.02)
    # Each side: stdev 0.0283 over 2 seeds, se 0.02; the difference's se: 0.02 * sqrt(2).
    assert verdict["final_reward_noise_se"] == pytest.approx(0.02 * 2**0.5)


def test_a_gap_beyond_the_noise_disagrees():
    verdict = rewards_agree([0.95, 0.94], [0.60, 0.62])
    assert not verdict["rewards_agree"]


def test_one_seed_each_uses_the_noise_floor():
    assert rewards_agree([0.95], [0.95 - 1.5 * MIN_REWARD_NOISE])["rewards_agree"]
    verdict = rewards_agree([0.95], [0.95 - 2.5 * MIN_REWARD_NOISE])
    assert not verdict["rewards_agree"] and verdict["final_reward_noise_se"] == MIN_REWARD_NOISE


def test_the_format_base_is_refused_for_another_task_naming_the_flag(tmp_path):
    import pytest

    from forge_rl.bench.lora_sync import pretrain_format_base
    from forge_rl.config import GRPOConfig
    from forge_rl.tasks import TaskConfig

    config = GRPOConfig(task=TaskConfig(name="copy_digit"))
    with pytest.raises(ValueError, match="task 'copy_digit'.*--reward-pretrain-steps 0"):
        pretrain_format_base(config, tmp_path / "base", steps=1)
