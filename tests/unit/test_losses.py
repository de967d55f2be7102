import math

import pytest
import torch

from forge_rl.advantages import group_normalized_advantages
from forge_rl.losses.grpo import GRPOLossConfig, grpo_loss


def reference_grpo_loss(logprobs, behaviour, advantages, mask, eps_low, eps_high):
    """Independent scalar loop of the clipped surrogate, token-level mean."""
    total, count = 0.0, 0
    for i in range(len(logprobs)):
        for j in range(len(logprobs[i])):
            if not mask[i][j]:
                continue
            ratio = math.exp(logprobs[i][j] - behaviour[i][j])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            total += -min(ratio * advantages[i], clipped * advantages[i])
            count += 1
    return total / count


def test_grpo_loss_matches_the_reference_formula_on_hand_made_tensors():
    logprobs = [[0.0, -0.1, -2.0, -0.3], [0.0, -1.5, -0.2, -0.9]]
    behaviour = [[0.0, -0.5, -1.0, -0.3], [0.0, -1.0, -0.9, -0.1]]
    advantages = [1.5, -0.7]
    mask = [[False, True, True, True], [False, True, True, False]]
    config = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, _ = grpo_loss(
        torch.tensor(logprobs), torch.tensor(behaviour), torch.tensor(advantages), torch.tensor(mask), config
    )
    expected = reference_grpo_loss(logprobs, behaviour, advantages, mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_ratio_is_taken_against_behaviour_logprobs_not_a_detached_copy():
    """With behaviour != current, the gradient must carry the ratio: d/dlogp [r * A] = r * A."""
    current = torch.tensor([[0.0, -0.4]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -0.9]])  # the generator's older, different policy
    mask = torch.tensor([[False, True]])
    loss, metrics = grpo_loss(current, behaviour, torch.tensor([1.0]), mask, GRPOLossConfig(0.2, 5.0))
    loss.backward()
    ratio = math.exp(-0.4 + 0.9)
    assert metrics["loss/mean_ratio"] == pytest.approx(ratio, rel=1e-5)
    # A detached-copy bug would give ratio 1 and gradient -1 regardless of behaviour.
    assert current.grad[0, 1].item() == pytest.approx(-ratio, rel=1e-5)


def test_clipping_stops_the_push_beyond_the_trust_region():
    current = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -1.0]])  # ratio e ~ 2.7 > 1.2
    loss, metrics = grpo_loss(current, behaviour, torch.tensor([1.0]), torch.tensor([[False, True]]), GRPOLossConfig())
    loss.backward()
    assert current.grad[0, 1].item() == 0.0
    assert metrics["loss/clip_fraction"] == 1.0


def test_mismatch_kl_is_zero_on_policy_and_positive_off_policy():
    mask = torch.tensor([[True, True]])
    same = torch.tensor([[-0.3, -1.2]])
    _, on_policy = grpo_loss(same, same, torch.tensor([1.0]), mask, GRPOLossConfig())
    _, off_policy = grpo_loss(same, same - 0.5, torch.tensor([1.0]), mask, GRPOLossConfig())
    assert on_policy["loss/mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert off_policy["loss/mismatch_kl"] > 0.0


def test_group_advantages_are_zero_mean_unit_std_and_zero_for_uniform_groups():
    advantages = group_normalized_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert advantages.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_normalized_advantages(torch.tensor([1.0, 1.0, 1.0])).abs().max().item() == 0.0


def test_invalid_clip_names_the_flag():
    with pytest.raises(ValueError, match="trainer.loss.clip_eps_low"):
        GRPOLossConfig(clip_eps_low=0.0)


def test_nan_at_masked_positions_never_reaches_the_loss():
    current = torch.tensor([[0.0, -0.4]], requires_grad=True)
    behaviour = torch.tensor([[float("nan"), -0.4]])
    loss, _ = grpo_loss(current, behaviour, torch.tensor([1.0]), torch.tensor([[False, True]]), GRPOLossConfig())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(current.grad).all()
