"""A Hugging Face Llama whose vocabulary vLLM pads, swapped in through the staged loader.

vLLM pads the rows of the embedding and of the LM head to a multiple of 64; a model saved by
`transformers` with 16 tokens (the max-of-two task's characters and the 4 special tokens) is
served from 64-row tensors whose last 48 rows no checkpoint holds. The staged loader must load
the 16 real rows and leave the padding, and still refuse a snapshot that misses a whole module.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge_rl.tasks import tokenizer as char_tokenizer
from forge_rl.tasks.synthetic import make_prompt
from forge_rl.tasks.tokenizer import PromptTokenizer

pytestmark = pytest.mark.integration

MAX_OF_TWO_ALPHABET = "0123456789M="
"""Every character of the max_of_two task's prompts and answers: 4 special + 12 = 16 tokens."""
NUM_TOKENS = 16
MAX_MODEL_LEN = 32


def save_hf_llama(model_dir: Path, seed: int) -> Path:
    """A random 16-token Llama, saved by transformers as a user's model directory would be."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    char_tokenizer.save_char_tokenizer(model_dir, MAX_OF_TWO_ALPHABET)
    tokenizer = PromptTokenizer(model_dir)
    config = LlamaConfig(
        vocab_size=NUM_TOKENS,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id).save_pretrained(model_dir)
    return model_dir


def hf_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    """Logprob of each completion token under `model_dir`'s weights, computed by transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    picked = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
    return picked[len(prompt) - 1 :].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(loop, engine started on model 0, [model 0, model 1] directories)."""
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine

    model_dirs = [save_hf_llama(tmp_path_factory.mktemp(f"hf{seed}"), seed) for seed in (0, 1)]
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=6, temperature=1.0, swap_loader="staged"))
    loop.run_until_complete(engine.start(model_dirs[0], MAX_MODEL_LEN))
    yield loop, engine, model_dirs
    loop.run_until_complete(engine.shutdown())
    loop.close()


def test_the_16_token_tokenizer_covers_the_task(tmp_path):
    char_tokenizer.save_char_tokenizer(tmp_path, MAX_OF_TWO_ALPHABET)
    tokenizer = PromptTokenizer(tmp_path)
    for index in range(20):
        prompt = make_prompt("max_of_two", 0, index)
        ids = tokenizer.encode_prompt(prompt.text)
        assert max(ids) < NUM_TOKENS and tokenizer.decode(ids) == prompt.text
    assert tokenizer.encode_prompt("7")[-1] < NUM_TOKENS


def test_a_staged_swap_of_a_padded_vocabulary_serves_the_new_weights(served):
    loop, engine, (old_dir, new_dir) = served
    prompt = PromptTokenizer(new_dir).encode_prompt("M37=")

    stats = loop.run_until_complete(engine.swap_weights(new_dir, 1))
    (completion,) = loop.run_until_complete(engine.generate(prompt, n=1, eos_id=None))

    assert stats.loader == "staged" and engine.policy_version == 1
    assert completion.policy_versions == [1] * 6
    new = hf_logprobs(new_dir, prompt, completion.token_ids)
    old = hf_logprobs(old_dir, prompt, completion.token_ids)
    assert completion.logprobs == pytest.approx(new, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(completion.logprobs, old)) > 1e-2  # the weights did change


def test_a_snapshot_without_one_module_is_refused(served, tmp_path):
    """A module none of whose parameters the snapshot holds would keep the previous weights."""
    from safetensors.torch import load_file, save_file

    loop, engine, (old_dir, _) = served
    tensors = load_file(str(old_dir / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((old_dir / "config.json").read_text())

    with pytest.raises(RuntimeError, match=r"loads no parameter of 1 modules \(\['RMSNorm'\]\)"):
        loop.run_until_complete(engine.stage_weights(tmp_path, 2))
