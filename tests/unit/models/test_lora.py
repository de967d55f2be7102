"""LoRA core (forge_rl/models/lora.py) on the tiny TorchTitan Llama (hidden 128, 2 layers), one
process: adapters start as the identity, only they train, merging reproduces the adapted model,
and bad settings or checkpoints fail naming what exists."""

from __future__ import annotations

import pytest
import torch

from forge_rl.models.lora import LoRAAdapters, LoRAConfig
from forge_rl.models.lora_config import UNEMBED_TARGETS
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.models.titan import ParallelConfig, build_titan_model

TOKENS = torch.randint(4, 40, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


def _model(model_dir):
    model, _ = build_titan_model(model_dir, ParallelConfig(), torch.device("cpu"))
    return model


def test_adapters_start_as_the_base_and_only_they_train(model_dir):
    model = _model(model_dir)
    base_logits = model(TOKENS).detach()
    base_weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapters = LoRAAdapters(model, LoRAConfig(rank=4))
    adapters.attach()
    assert len(adapters.module_names) == 2 * 5  # wqkv, wo, w1, w2, w3 per layer; not lm_head
    assert torch.equal(model(TOKENS), base_logits)  # B = 0
    assert not any(p.requires_grad for p in model.parameters())

    optimizer = torch.optim.AdamW(adapters.parameters(), lr=1e-2)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(TOKENS[:, :-1]).flatten(0, 1), TOKENS[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    adapted_logits = model(TOKENS).detach()
    assert (adapted_logits - base_logits).abs().max() > 1e-3
    for name, p in model.named_parameters():
        assert torch.equal(p, base_weights[name]), name
    adapters.detach()
    assert torch.equal(model(TOKENS), base_logits)
    adapters.attach()
    assert torch.equal(model(TOKENS), adapted_logits)


@pytest.mark.parametrize(
    "targets", [LoRAConfig().targets, LoRAConfig().targets + UNEMBED_TARGETS], ids=["default", "lm_head"]
)
def test_the_merged_weights_compute_what_the_adapted_model_does(model_dir, targets):
    model = _model(model_dir)
    adapters = LoRAAdapters(model, LoRAConfig(rank=8, alpha=16.0, targets=targets))
    assert ("lm_head" in adapters.module_names) == ("lm_head" in targets)
    with torch.no_grad():
        for p in adapters.parameters():
            p.normal_(0, 0.05)
    adapters.attach()
    adapted = model(TOKENS).detach()
    with adapters.merged():
        assert (model(TOKENS) - adapted).abs().max() < 1e-4  # merged weights, hooks off
        merged_state_dict = {name: value.clone() for name, value in model.state_dict().items()}
    assert torch.equal(model(TOKENS), adapted)  # hooks back on, base weights restored
    merged = _model(model_dir)
    merged.load_state_dict(merged_state_dict, strict=True)
    assert (merged(TOKENS) - adapted).abs().max() < 1e-4
    assert (merged(TOKENS) - _model(model_dir)(TOKENS)).abs().max() > 1e-3
    adapters.detach()  # the merge left the adapted model's own base weights as they were
    assert torch.equal(model(TOKENS), _model(model_dir)(TOKENS))


@pytest.mark.parametrize(
    "targets, reachable",
    [(LoRAConfig().targets, False), (LoRAConfig().targets + UNEMBED_TARGETS, True)],
    ids=["default", "lm_head"],
)
def test_only_an_unembedding_adapter_lifts_a_token_past_the_random_unembeddings_cap(model_dir, targets, reachable):
    """The tiny model's unembedding is random: with it frozen, the adapters upstream cannot raise a
    token's probability past a cap its rows set (about 0.25 for this token), however they train."""
    model = _model(model_dir)
    adapters = LoRAAdapters(model, LoRAConfig(rank=4, targets=targets))
    adapters.attach()
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=3e-2, weight_decay=0.0)
    target = torch.full((TOKENS.numel(),), 7)
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(TOKENS).flatten(0, 1), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        probability = torch.softmax(model(TOKENS), dim=-1)[..., 7]
    assert probability.min() > 0.9 if reachable else probability.max() < 0.3


def test_adapters_only_checkpoint_round_trips(model_dir):
    model = _model(model_dir)
    adapters = LoRAAdapters(model, LoRAConfig(rank=4))
    with torch.no_grad():
        for p in adapters.parameters():
            p.normal_()
    checkpoint = adapters.adapter_state_dict()
    assert all(key.endswith((".lora_A", ".lora_B")) for key in checkpoint)
    assert sum(t.numel() for t in checkpoint.values()) == adapters.num_parameters()
    fresh = LoRAAdapters(_model(model_dir), LoRAConfig(rank=4))
    fresh.load_adapters(checkpoint)
    assert all(torch.equal(fresh.adapter_state_dict()[k], v) for k, v in checkpoint.items())


def test_an_adapter_checkpoint_that_does_not_fit_names_the_mismatch(model_dir):
    checkpoint = LoRAAdapters(_model(model_dir), LoRAConfig(rank=4)).adapter_state_dict()
    other_rank = LoRAAdapters(_model(model_dir), LoRAConfig(rank=8))
    with pytest.raises(
        ValueError,
        match=r"does not fit.*rank 8.*layers\.0\.attention\.wo\.lora_A has shape \[4, 128\], these adapters \[8, 128\]",
    ):
        other_rank.load_adapters(checkpoint)
    attention_only = LoRAAdapters(_model(model_dir), LoRAConfig(rank=4, targets=("wo",)))
    with pytest.raises(ValueError, match=r"unexpected layers\.0\.attention\.qkv_linear\.wqkv\.lora_A"):
        attention_only.load_adapters(checkpoint)


def test_a_rank_larger_than_a_layer_is_refused_naming_the_layer_and_the_largest_rank(model_dir):
    # The tiny model's smallest targeted dimension is hidden_size = 128.
    with pytest.raises(
        ValueError, match=r"trainer.lora.rank \(129\) exceeds .*\[\d+ x \d+\].*--trainer.lora.rank to at most 128"
    ):
        LoRAAdapters(_model(model_dir), LoRAConfig(rank=129))
    LoRAAdapters(_model(model_dir), LoRAConfig(rank=128))


def test_targets_that_match_nothing_list_the_layer_names_that_exist(model_dir):
    with pytest.raises(
        ValueError,
        match=r"\['q_proj', 'v_proj'\] match no linear layer.*\['lm_head', 'w1', 'w2', 'w3', 'wo', 'wqkv'\].*--trainer.lora.targets",
    ):
        LoRAAdapters(_model(model_dir), LoRAConfig(targets=("q_proj", "wo", "v_proj")))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rank": 0}, r"trainer.lora.rank \(0\) must be >= 1. Set --trainer.lora.rank"),
        ({"alpha": 0.0}, "--trainer.lora.alpha"),
        ({"targets": ()}, "trainer.lora.targets is empty.*--trainer.lora.targets"),
    ],
)
def test_bad_lora_settings_name_the_flag(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**fields)
