"""The service's trainer side on a real tiny TorchTitan model: the Tinker losses as documented,
gradients adding up over forward_backward calls, and tenants whose adapters, gradients and
moments never mix however their calls interleave."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge_rl.models.lora_config import LoRAConfig
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.training.tenants import TenantTrainer
from forge_rl.training.tinker_losses import config_of, elementwise_loss
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from tests.support.helpers import rank_env

TOKENS = [1, 14, 9, 7, 40, 22, 5]
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    model_dir = create_tiny_model(
        TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=2), tmp_path_factory.mktemp("m") / "model"
    )
    with pytest.MonkeyPatch.context() as patch:
        for name in rank_env(rank=0, world_size=1, master_port=0):
            patch.delenv(name, raising=False)
        config = TrainerConfig(lora=LoRAConfig(enabled=True, rank=4))
        yield TenantTrainer(PolicyTrainer(config, model_dir))


def _datum(targets_shift: int = 1, weights=None):
    targets = np.array(TOKENS[targets_shift:] + [3] * targets_shift, dtype=np.int64)
    weights = np.ones(len(TOKENS), dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)
    return (TOKENS, {"target_tokens": targets, "weights": weights})


def _rl_datum(sampled, advantages):
    tokens, inputs = _datum()
    n = len(tokens)
    return tokens, {
        "target_tokens": inputs["target_tokens"],
        "logprobs": np.full(n, sampled, dtype=np.float32),
        "advantages": np.full(n, advantages, dtype=np.float32),
    }


def test_cross_entropy_is_the_weighted_sum_of_target_logprobs(tenants):
    tenants.add_tenant("ce", seed=1)
    weights = [0, 0, 1, 1, 1, 0.5, 1]
    (out,), metrics = tenants.forward_backward("ce", [_datum(weights=weights)], "cross_entropy", None, backward=False)
    assert out["logprobs"].shape == (len(TOKENS),) and (out["logprobs"] < 0).all()
    assert metrics["loss:sum"] == pytest.approx(-(np.asarray(weights) * out["logprobs"]).sum(), rel=1e-5)
    np.testing.assert_allclose(out["elementwise_loss"], -np.asarray(weights) * out["logprobs"], rtol=1e-5)


def test_each_policy_loss_matches_its_definition():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    sampled = torch.tensor([[-1.2, -1.0, -0.5]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, False]])
    inputs = {"logprobs": sampled, "advantages": adv}
    ratio = (logp - sampled).exp()
    expected = {
        "importance_sampling": -ratio * adv,
        "ppo": -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv),
        "cispo": -ratio.clamp(0.8, 1.2) * logp * adv,
        "dro": -(logp * adv - 0.5 * 0.05 * (logp - sampled) ** 2),
    }
    for loss_fn, want in expected.items():
        got = elementwise_loss(loss_fn, logp, inputs, mask, config_of(loss_fn, None))
        torch.testing.assert_close(got, torch.where(mask, want, 0.0))
    with pytest.raises(ValueError, match="clip_low"):
        config_of("dro", {"clip_low_threshold": 0.5})


def test_gradients_add_up_until_the_step_and_the_step_moves_the_adapters(tenants):
    tenants.add_tenant("acc", seed=2)
    datum = _rl_datum(-3.0, 1.0)
    tenants.forward_backward("acc", [datum, datum], "importance_sampling", None, backward=True)
    two_at_once = {name: p.grad.clone() for name, p in tenants._params.items() if p.grad is not None}
    tenants.trainer.optimizer.zero_grad(set_to_none=True)
    tenants.forward_backward("acc", [datum], "importance_sampling", None, backward=True)
    tenants.forward_backward("acc", [datum], "importance_sampling", None, backward=True)
    for name, grad in two_at_once.items():
        torch.testing.assert_close(tenants._params[name].grad, grad)
    (before,), _ = tenants.forward_backward("acc", [datum], "importance_sampling", None, backward=False)
    metrics = tenants.optim_step("acc", **ADAM)
    assert metrics["grad_norm"] > 0 and not metrics["step_skipped"]
    assert all(p.grad is None for p in tenants._params.values())
    (after,), _ = tenants.forward_backward("acc", [datum], "importance_sampling", None, backward=False)
    # Positive advantages everywhere: the step raises the targets' logprobs.
    assert after["logprobs"].sum() > before["logprobs"].sum()


def test_tenants_never_mix_however_their_calls_interleave(tenants):
    """Two tenants trained interleaved end exactly where each would alone."""
    up, down = _rl_datum(-3.0, 1.0), _rl_datum(-3.0, -1.0)

    def train(names_and_data):
        for name, datum in names_and_data:
            tenants.forward_backward(name, [datum], "importance_sampling", None, backward=True)
        for name, _ in names_and_data:
            tenants.optim_step(name, **ADAM)

    for name in ("a", "b", "a_alone", "b_alone"):
        tenants.add_tenant(name, seed=7)
    for _ in range(2):
        train([("a", up), ("b", down)])  # interleaved: a's gradient waits while b's is computed
        train([("a_alone", up)])
        train([("b_alone", down)])
    state = {
        name: tenants.adapter_state_dict(name, torch.float32, keep=True) for name in ("a", "b", "a_alone", "b_alone")
    }
    for key in state["a"]:
        torch.testing.assert_close(state["a"][key], state["a_alone"][key])
        torch.testing.assert_close(state["b"][key], state["b_alone"][key])
    assert any(not torch.equal(state["a"][key], state["b"][key]) for key in state["a"])


def test_layers_a_tenant_does_not_train_stay_as_the_base(tenants):
    tenants.add_tenant("attention_only", seed=4, frozen_targets=("w1", "w2", "w3"))
    tenants.forward_backward("attention_only", [_rl_datum(-3.0, 1.0)], "importance_sampling", None, backward=True)
    tenants.optim_step("attention_only", **ADAM)
    adapters = tenants.adapter_state_dict("attention_only", torch.float32, keep=True)
    moved = {key.rsplit(".", 2)[-2] for key, value in adapters.items() if key.endswith("lora_B") and value.any()}
    assert moved == {"wqkv", "wo"}
    with pytest.raises(ValueError, match="not adapted here"):
        tenants.add_tenant("nowhere", seed=0, frozen_targets=("lm_head",))


def test_a_new_tenant_starts_as_the_base_and_bad_data_is_refused(tenants):
    tenants.add_tenant("fresh", seed=3)
    adapters = tenants.adapter_state_dict("fresh", torch.float32, keep=True)
    assert all(not value.any() for key, value in adapters.items() if key.endswith("lora_B"))
    with pytest.raises(ValueError, match="lacks loss_fn_inputs \\['advantages'\\]"):
        tenants.forward_backward(
            "fresh", [(TOKENS, {"target_tokens": np.zeros(7), "logprobs": np.zeros(7)})], "ppo", None, True
        )
    with pytest.raises(ValueError, match="has 3 entries but the model_input has 7"):
        tenants.forward_backward(
            "fresh", [(TOKENS, {"target_tokens": np.zeros(3), "weights": np.ones(3)})], "cross_entropy", None, True
        )
    with pytest.raises(ValueError, match="unknown tenant"):
        tenants.optim_step("nobody", **ADAM)
