"""Every loss and correction against an independent scalar-loop formula, value and gradient."""

import math

import pytest
import torch

from forge_rl.training.losses.policy import LossConfig, num_loss_units, policy_loss

LOSS_NAMES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
LENGTH_NORMALIZER = 8  # dr_grpo's constant in these tests


def make_config(name: str, **overrides) -> LossConfig:
    if name == "dr_grpo":
        overrides.setdefault("length_normalizer", LENGTH_NORMALIZER)
    return LossConfig(name=name, **overrides)


def reference_loss_and_grad(config, logprobs, behaviour, advantages, mask, reference=None):
    """Plain-Python loops of each loss as the papers write it, and d loss / d logprobs by hand
    (stop-gradient factors, CISPO's weight and the TIS factor, are constants to the gradient)."""
    lo, hi, cap = 1 - config.eps_low, 1 + config.eps_high, config.is_cap
    rows = range(len(logprobs))
    cols = [[j for j in range(len(logprobs[i])) if mask[i][j]] for i in rows]
    delta = [[logprobs[i][j] - behaviour[i][j] for j in range(len(logprobs[i]))] for i in rows]
    keep = [[mask[i][j] for j in range(len(logprobs[i]))] for i in rows]
    for i in rows:
        for j in cols[i]:
            if config.correction == "mis" and not 1 / cap <= math.exp(delta[i][j]) <= cap:
                keep[i][j] = False
        geo_mean = math.exp(sum(delta[i][j] for j in cols[i]) / max(len(cols[i]), 1))
        if config.seq_mask_geo_mean and not 1 / config.seq_mask_geo_mean <= geo_mean <= config.seq_mask_geo_mean:
            keep[i] = [False] * len(keep[i])
    num_tokens = sum(len(c) for c in cols)
    num_sequences = sum(1 for c in cols if c)
    loss, grad = 0.0, [[0.0] * len(logprobs[i]) for i in rows]
    for i in rows:
        kept = [j for j in cols[i] if keep[i][j]]
        seq_ratio = math.exp(sum(delta[i][j] for j in kept) / max(len(kept), 1))
        a = advantages[i]
        for j in kept:
            if config.name == "cispo":
                weight = min(max(math.exp(delta[i][j]), lo), hi)
                value, dvalue = -weight * a * logprobs[i][j], -weight * a
            else:
                weight = seq_ratio if config.name == "gspo" else math.exp(delta[i][j])
                clipped = (a > 0 and weight > hi) or (a < 0 and weight < lo)
                value = -min(weight * a, min(max(weight, lo), hi) * a)
                dvalue = 0.0 if clipped else -weight * a
            if config.correction == "tis":
                factor = min(1.0, cap / weight)
                value, dvalue = value * factor, dvalue * factor
            if config.kl_beta:
                x = reference[i][j] - logprobs[i][j]
                value += config.kl_beta * (math.exp(x) - x - 1)
                dvalue += config.kl_beta * (1 - math.exp(x))
            if config.name == "gspo":
                normalizer = len(cols[i]) * num_sequences
            elif config.name == "dr_grpo":
                normalizer = config.length_normalizer * num_sequences
            else:
                normalizer = num_tokens
            loss += value / normalizer
            grad[i][j] = dvalue / normalizer
    return loss, grad


# Hand-made: three completions of different lengths, ratios on both sides of every clip and cap.
LOGPROBS = [[0.0, -0.1, -2.0, -0.3, -0.2], [0.0, -1.5, -0.2, -0.9, -0.4], [0.0, -0.7, -0.05, -1.1, -0.6]]
BEHAVIOUR = [[0.0, -0.5, -1.0, -0.3, -0.25], [0.0, -1.0, -0.9, -0.1, -0.4], [0.0, -2.0, -0.1, -1.0, -0.65]]
REFERENCE = [[0.0, -0.3, -1.5, -0.2, -0.3], [0.0, -1.2, -0.5, -0.6, -0.3], [0.0, -0.9, -0.2, -1.0, -0.5]]
ADVANTAGES = [1.5, -0.7, 0.4]
MASK = [[False, True, True, True, True], [False, True, True, True, False], [False, True, True, False, False]]


def run_loss(config, logprobs=LOGPROBS, behaviour=BEHAVIOUR, advantages=ADVANTAGES, mask=MASK, reference=REFERENCE):
    current = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        current,
        torch.tensor(behaviour, dtype=torch.float64),
        torch.tensor(advantages, dtype=torch.float64).unsqueeze(-1),
        torch.tensor(mask),
        config,
        torch.tensor(reference, dtype=torch.float64),
    )
    loss.backward()
    return loss.item(), current.grad.tolist(), metrics


SETTINGS = [
    {},
    {"clip_eps_low": 0.3, "clip_eps_high": 0.5},
    {"correction": "tis", "is_cap": 1.5},
    {"correction": "mis", "is_cap": 2.0},
    {"seq_mask_geo_mean": 1.3},
    {"kl_beta": 0.05},
    {"correction": "tis", "seq_mask_geo_mean": 1.5, "kl_beta": 0.1},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults")
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_loss_matches_the_reference_formula_in_value_and_gradient(name, settings):
    config = make_config(name, **settings)
    loss, grad, _ = run_loss(config)
    expected_loss, expected_grad = reference_loss_and_grad(config, LOGPROBS, BEHAVIOUR, ADVANTAGES, MASK, REFERENCE)
    assert loss == pytest.approx(expected_loss, abs=1e-9)
    for row, expected_row in zip(grad, expected_grad):
        assert row == pytest.approx(expected_row, abs=1e-9)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_loss_takes_its_ratio_against_the_behaviour_logprobs_not_a_detached_copy(name):
    """One token with behaviour != current and clips wide enough not to bind: every loss's gradient
    carries r = exp(0.5) (for dr_grpo over its constant normalizer). A ratio taken against a
    detached copy of the current logprobs is 1, and the gradient would be -A instead."""
    config = make_config(name, clip_eps_low=0.5, clip_eps_high=5.0)
    normalizer = LENGTH_NORMALIZER if name == "dr_grpo" else 1
    ratio = math.exp(-0.4 + 0.9)
    _, grad, metrics = run_loss(config, [[0.0, -0.4]], [[0.0, -0.9]], [1.0], [[False, True]], [[0.0, 0.0]])
    assert metrics["loss/mean_ratio"] == pytest.approx(ratio, rel=1e-6)
    assert grad[0][1] == pytest.approx(-ratio / normalizer, rel=1e-6)
    # The bug this guards against, reproduced: the ratio against a detached copy corrects nothing.
    current = torch.tensor([[0.0, -0.4]], requires_grad=True)
    loss, _ = policy_loss(current, current.detach(), torch.tensor([[1.0]]), torch.tensor([[False, True]]), config)
    loss.backward()
    assert current.grad[0, 1].item() == pytest.approx(-1.0 / normalizer, rel=1e-6)


def test_clipping_stops_the_push_beyond_the_trust_region():
    _, grad, metrics = run_loss(make_config("grpo"), [[0.0, 0.0]], [[0.0, -1.0]], [1.0], [[False, True]], [[0.0, 0.0]])
    assert grad[0][1] == 0.0  # ratio e ~ 2.7 > 1.2
    assert metrics["loss/clip_fraction_high"] == 1.0
    assert metrics["loss/clip_fraction_low"] == 0.0


def test_clip_higher_lets_dapo_raise_a_rewarded_token_further_than_grpo_but_lowers_equally():
    log_ratio_up, log_ratio_down = math.log(1.25), math.log(0.75)
    args = ([[log_ratio_up, log_ratio_down]], [[0.0, 0.0]], [[True, False]], [[True, True]])
    rewarded = run_loss(make_config("dapo"), args[0], args[1], [1.0], args[2], args[1])[1][0][0]
    assert rewarded == pytest.approx(-1.25, rel=1e-6)  # 1.25 < 1 + 0.28: still pushed
    assert run_loss(make_config("grpo"), args[0], args[1], [1.0], args[2], args[1])[1][0][0] == 0.0
    for name in ("grpo", "dapo"):  # 0.75 < 1 - 0.2 on a negative advantage: clipped by both
        grad = run_loss(make_config(name), args[0], args[1], [-1.0], [[False, True]], args[1])[1]
        assert grad[0][1] == 0.0


def test_cispo_gradient_is_the_detached_clipped_ratio_times_the_advantage_and_never_zero():
    """CISPO's default weight is clip(r, 0, 4): a token at r = e^2 gets weight 4, one at r = e^-2
    keeps its small weight. PPO's clip zeroes the first (A > 0, r > 1.2)."""
    args = ([[0.0, 0.0]], [[-2.0, 2.0]], [1.0], [[True, True]], [[0.0, 0.0]])
    _, grad, metrics = run_loss(make_config("cispo"), *args)
    assert grad[0] == pytest.approx([-4.0 / 2, -math.exp(-2.0) / 2], rel=1e-6)
    assert metrics["loss/clip_fraction_high"] == 0.5
    assert run_loss(make_config("grpo"), *args)[1][0][0] == 0.0


def test_gspo_gives_every_token_of_a_sequence_the_same_sequence_ratio():
    config = make_config("gspo", clip_eps_low=0.5, clip_eps_high=0.5)
    _, grad, _ = run_loss(config, [[-0.1, -0.5, -0.3]], [[-0.2, -0.2, -0.2]], [1.0], [[True, True, True]], [[0.0] * 3])
    seq_ratio = math.exp((0.1 - 0.3 - 0.1) / 3)
    assert grad[0] == pytest.approx([-seq_ratio / 3] * 3, rel=1e-6)


def test_gspo_defaults_clip_the_sequence_ratio_at_three_and_four_ten_thousandths():
    config = make_config("gspo")
    assert (config.eps_low, config.eps_high) == (3e-4, 4e-4)


def test_dr_grpo_weighs_every_token_alike_whatever_its_sequence_length():
    """Per-sequence length normalization (GRPO as first published, and GSPO) gives the lone token of
    row 1 three times the weight of each token of row 0; Dr. GRPO divides every token by
    num_sequences * length_normalizer."""
    on_policy = [[-0.5, -0.5, -0.5], [-0.5, 0.0, 0.0]]
    args = (on_policy, on_policy, [1.0, 1.0], [[True, True, True], [True, False, False]], on_policy)
    _, grad, _ = run_loss(make_config("dr_grpo"), *args)
    expected = -1.0 / (2 * LENGTH_NORMALIZER)
    assert grad[0] == pytest.approx([expected] * 3, rel=1e-6)
    assert grad[1] == pytest.approx([expected, 0.0, 0.0], rel=1e-6)
    _, length_normalized, _ = run_loss(make_config("gspo"), *args)
    assert length_normalized[1][0] == pytest.approx(3 * length_normalized[0][0], rel=1e-6)


def test_tis_caps_the_importance_weight_instead_of_multiplying_it_in_twice():
    """A negative-advantage token at r = e^1.5 ~ 4.5 is not clipped by PPO; TIS at cap 2 gives its
    gradient weight min(r, 2) = 2, not r * 2. A token below the cap is untouched."""
    args = ([[0.0, 0.0]], [[-1.5, -0.2]], [-1.0], [[True, True]], [[0.0, 0.0]])
    _, plain, _ = run_loss(make_config("grpo"), *args)
    _, capped, metrics = run_loss(make_config("grpo", correction="tis", is_cap=2.0), *args)
    assert plain[0][0] == pytest.approx(math.exp(1.5) / 2, rel=1e-6)
    assert capped[0] == pytest.approx([2.0 / 2, math.exp(0.2) / 2], rel=1e-6)
    assert metrics["loss/tis_truncated_fraction"] == 0.5


def test_mis_drops_tokens_outside_the_cap_and_keeps_the_denominator():
    args = ([[0.0, 0.0, 0.0]], [[-1.0, 1.0, -0.1]], [1.0], [[True, True, True]], [[0.0] * 3])
    _, grad, metrics = run_loss(make_config("cispo", correction="mis", is_cap=2.0), *args)
    assert grad[0] == pytest.approx([0.0, 0.0, -math.exp(0.1) / 3], rel=1e-6)  # e and 1/e are outside [0.5, 2]
    assert metrics["loss/mis_masked_fraction"] == pytest.approx(2 / 3)


def test_sequence_geometric_mean_masking_drops_whole_sequences():
    behaviour = [[-0.1, -0.1], [-1.0, -1.0]]  # row 1's geometric-mean ratio is e^0.9 ~ 2.5
    current = [[-0.1, -0.2], [-0.1, -0.1]]
    _, grad, metrics = run_loss(
        make_config("grpo", seq_mask_geo_mean=2.0), current, behaviour, [1.0, 1.0], [[True, True]] * 2, current
    )
    assert grad[1] == [0.0, 0.0]
    assert grad[0][0] != 0.0
    assert metrics["loss/seq_masked_fraction"] == 0.5


def test_kl_penalty_needs_reference_logprobs_and_reports_its_value():
    current = torch.tensor([[-0.3, -1.2]])
    mask = torch.tensor([[True, True]])
    with pytest.raises(ValueError, match="trainer.loss.kl_beta"):
        policy_loss(current, current, torch.tensor([[1.0]]), mask, make_config("grpo", kl_beta=0.1))
    _, without = policy_loss(current, current, torch.tensor([[1.0]]), mask, make_config("grpo"))
    config = make_config("grpo", kl_beta=0.1)
    _, with_kl = policy_loss(current, current, torch.tensor([[1.0]]), mask, config, current - 0.5)
    assert "loss/ref_kl" not in without
    assert with_kl["loss/ref_kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5)


def test_mismatch_kl_is_zero_on_policy_and_positive_off_policy():
    mask = torch.tensor([[True, True]])
    same = torch.tensor([[-0.3, -1.2]])
    _, on_policy = policy_loss(same, same, torch.tensor([[1.0]]), mask, make_config("grpo"))
    _, off_policy = policy_loss(same, same - 0.5, torch.tensor([[1.0]]), mask, make_config("grpo"))
    assert on_policy["loss/mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert off_policy["loss/mismatch_kl"] > 0.0
    assert off_policy["loss/max_abs_log_ratio"] == pytest.approx(0.5)  # "/max_": reduced with max


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_nan_at_masked_positions_never_reaches_the_loss(name):
    current = torch.tensor([[0.0, -0.4]], requires_grad=True)
    nan = float("nan")
    config = make_config(name, correction="tis", seq_mask_geo_mean=2.0, kl_beta=0.1)
    mask = torch.tensor([[False, True]])
    with_nan = torch.tensor([[nan, -0.4]])
    loss, metrics = policy_loss(current, with_nan, torch.tensor([[1.0]]), mask, config, with_nan)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(current.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_shard_losses_weighted_by_their_loss_units_add_up_to_the_batch_loss(name):
    """The trainer's data-parallel contract: sum over shards of loss * (shard units / batch units)."""
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 6, generator=generator, dtype=torch.float64)
    behaviour = logprobs - 0.3 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([[1.0], [-0.5], [0.3], [-1.2]], dtype=torch.float64)
    mask = torch.rand(4, 6, generator=generator) < 0.7
    mask[3] = False  # a fully masked row (an ERRORED completion)
    config = make_config(name, correction="tis", is_cap=1.2)
    whole, _ = policy_loss(logprobs, behaviour, advantages, mask, config)
    total = sum(
        policy_loss(logprobs[rows], behaviour[rows], advantages[rows], mask[rows], config)[0]
        * num_loss_units(mask[rows], config)
        / num_loss_units(mask, config)
        for rows in (slice(0, 2), slice(2, 4))
    )
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)


def test_each_loss_has_its_papers_clip_defaults_and_explicit_values_win():
    assert (make_config("grpo").eps_low, make_config("grpo").eps_high) == (0.2, 0.2)
    assert (make_config("dapo").eps_low, make_config("dapo").eps_high) == (0.2, 0.28)
    assert (make_config("cispo").eps_low, make_config("cispo").eps_high) == (1.0, 3.0)
    assert make_config("dapo", clip_eps_high=0.3).eps_high == 0.3
    assert not make_config("dr_grpo").normalize_advantage_std
    assert make_config("grpo").normalize_advantage_std


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"clip_eps_low": 0.0},
            r"trainer.loss.clip_eps_low \(0.0\) must be in \(0, 10\). Set --trainer.loss.clip-eps-low",
        ),
        ({"name": "dr_grpo"}, r"trainer.loss.length_normalizer \(None\) must be set"),
        ({"length_normalizer": 16}, r"trainer.loss.length_normalizer \(16\) has no effect"),
        ({"is_cap": 1.0}, r"trainer.loss.is_cap \(1.0\) must be > 1"),
        ({"seq_mask_geo_mean": 0.5}, r"trainer.loss.seq_mask_geo_mean \(0.5\)"),
        ({"kl_beta": -0.1}, r"trainer.loss.kl_beta \(-0.1\) must be >= 0 and finite. Set --trainer.loss.kl-beta"),
    ],
)
def test_invalid_loss_config_names_the_field_value_and_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)
