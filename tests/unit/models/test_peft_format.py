"""TorchTitan adapters as a PEFT adapter directory (forge_rl/models/peft_format.py), on a tiny
grouped-query Llama (4 query heads, 2 KV heads: the fused wqkv interleaves them, and llama3 permutes
q and k rows), adapters on every projection and on the unembedding (lm_head): the PEFT factors
rebuild exactly forge_rl's merged HF export, and `peft` serves the directory with the logits of the
TorchTitan model with its adapters attached, also on a model with tied embeddings, whose input
embedding the lm_head adapter leaves as it was."""

from __future__ import annotations

import json

import pytest
import torch

from forge_rl.models.lora import LoRAAdapters, LoRAConfig
from forge_rl.models.lora_config import ATTENTION_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
from forge_rl.models.peft_format import ADAPTER_CONFIG_FILE, merged_hf_state_dict, peft_state_dict, write_peft_adapter
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.models.titan import ParallelConfig, build_titan_model, state_dict_adapter

TOKENS = torch.randint(4, 40, (2, 12), generator=torch.Generator().manual_seed(0))
LORA = LoRAConfig(rank=4, alpha=8.0, targets=ATTENTION_TARGETS + MLP_TARGETS + UNEMBED_TARGETS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(TinyModelConfig(num_kv_heads=2), tmp_path_factory.mktemp("tiny-gqa") / "model")


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A grouped-query tiny Llama with tie_word_embeddings true (as SmolLM2 and Qwen3-0.6B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=48,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model_dir = tmp_path_factory.mktemp("tiny-tied") / "model"
    model.save_pretrained(model_dir)
    return model_dir


def _adapted(model_dir):
    """The TorchTitan model with random (non-zero) adapters attached."""
    model, _ = build_titan_model(model_dir, ParallelConfig(), torch.device("cpu"))
    adapters = LoRAAdapters(model, LORA)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    adapters.attach()
    return model, adapters


@pytest.fixture(scope="module")
def trained(model_dir):
    return _adapted(model_dir)


def _hf_config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_peft_factors_rebuild_the_merged_hf_export_exactly(model_dir, trained):
    model, adapters = trained
    hf_config = _hf_config(model_dir)
    converter = state_dict_adapter(hf_config)
    adapters.detach()
    try:
        base = converter.to_hf({k: v.detach().clone() for k, v in model.state_dict().items()})
    finally:
        adapters.attach()
    merged = merged_hf_state_dict(model, adapters)
    factors = peft_state_dict(adapters.adapter_state_dict(), hf_config)
    modules = {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in factors}
    assert len(modules) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    for module in modules:
        a = factors[f"base_model.model.{module}.lora_A.weight"]
        b = factors[f"base_model.model.{module}.lora_B.weight"]
        rebuilt = base[f"{module}.weight"] + LORA.scaling * (b @ a)
        torch.testing.assert_close(rebuilt, merged[f"{module}.weight"], rtol=0, atol=1e-6, msg=module)
    untouched = set(base) - {f"{m}.weight" for m in modules}
    assert untouched and all(torch.equal(base[k], merged[k]) for k in untouched)


def _peft_logits(model_dir, adapter_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """(base logits, logits with the adapter directory loaded by `peft`) of TOKENS."""
    peft = pytest.importorskip("peft", reason="peft is the optional extra `lora` (pip install -e '.[lora]')")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(TOKENS).logits
        return base_logits, peft.PeftModel.from_pretrained(base, adapter_dir)(TOKENS).logits


def test_peft_loads_the_directory_and_computes_the_adapted_model(model_dir, trained, tmp_path):
    model, adapters = trained
    out = write_peft_adapter(tmp_path / "adapter", adapters.adapter_state_dict(), LORA, model_dir)
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert (config["r"], config["lora_alpha"]) == (4, 8)

    base_logits, peft_logits = _peft_logits(model_dir, out)
    with torch.no_grad():
        titan_logits = model(TOKENS)
    torch.testing.assert_close(peft_logits, titan_logits, rtol=0, atol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapters changed something


def test_an_unembedding_adapter_on_tied_embeddings_changes_the_logits_alone(tied_model_dir, tmp_path):
    """The hook adds lm_head's adapter to the logits; the shared matrix, hence the input embedding,
    stays the base's, as `peft` serves it (its lora.Linear on lm_head). A merge would change both,
    so it is refused."""
    model, adapters = _adapted(tied_model_dir)
    embedding = model.tok_embeddings.weight.detach().clone()
    assert model.tok_embeddings.weight is model.lm_head.weight
    out = write_peft_adapter(tmp_path / "adapter", adapters.adapter_state_dict(), LORA, tied_model_dir)
    base_logits, peft_logits = _peft_logits(tied_model_dir, out)
    with torch.no_grad():
        titan_logits = model(TOKENS)
    torch.testing.assert_close(peft_logits, titan_logits, rtol=0, atol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-2
    with pytest.raises(
        ValueError, match=r"lm_head cannot be merged.*tie_word_embeddings.*leave lm_head out of --trainer.lora.targets"
    ):
        merged_hf_state_dict(model, adapters)
    assert torch.equal(model.tok_embeddings.weight, embedding)


def test_a_key_that_is_no_block_projection_is_refused(model_dir):
    with pytest.raises(ValueError, match="tok_embeddings.lora_A.*is not a LoRA factor.*adapter_state_dict"):
        peft_state_dict({"tok_embeddings.lora_A": torch.zeros(2, 2)}, _hf_config(model_dir))
