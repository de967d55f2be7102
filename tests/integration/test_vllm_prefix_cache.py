"""Prefix-cache blocks never outlive the weights that computed them (forge_rl/engines/vllm_engine.py).

Requests are salted with the version they are submitted under, so a block is reused only by
requests of the same version. A request that arrives while a swap pauses the engine is the edge:
submitted at once, it would carry the outgoing version's salt and be scheduled after the resume,
where the new weights would decode it over the old weights' blocks of its prompt. Its tokens would
be labelled with the new version and sampled from neither version's distribution: the trainer
would see a mismatch that no staleness explains. These tests send such a request at the one moment
it can arrive (the swap paused, the new weights loaded, the version not yet relabelled), by
construction: the engine's own `update_weight_version` call is where the request is sent.

Their own engine, with 32-token KV blocks: on the CPU default of 128 (the whole context of the tiny
model) no prompt ever fills a block, and nothing is cached.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.types import Completion
from tests.support.helpers import wait_until_async

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 128
CONFIG = GeneratorConfig(max_new_tokens=8, kv_block_size=32, swap_kv="reuse")
PROMPT = [1] + [4 + (7 * i) % 40 for i in range(79)]
"""80 tokens: two whole 32-token blocks the prefix cache keeps, and a partial one it does not."""
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("model"))
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(CONFIG)
    loop.run_until_complete(engine.start(model_dir, MAX_MODEL_LEN))
    yield engine, loop
    loop.run_until_complete(engine.shutdown())
    loop.close()


def logprobs_under(model_dir: Path, prompt: list[int], completion: Completion) -> list[float]:
    """log_softmax of the completion's tokens under `transformers`, fp32 (temperature 1, no top-k/p)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits_LV = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
    logprobs_LV = torch.log_softmax(logits_LV, dim=-1)
    return [logprobs_LV[i, token].item() for i, token in enumerate(completion.token_ids)]


async def send_during_swap(engine: VLLMEngine, new_dir: Path, version: int) -> Completion:
    """Swap to `new_dir`, and send one request for PROMPT while the swap has the engine paused."""
    llm = engine._running_llm
    relabel = llm.update_weight_version
    sent: list[asyncio.Task] = []

    async def send_then_relabel(version_label: str) -> None:
        before = llm.get_num_unfinished_requests()
        sent.append(asyncio.create_task(engine.generate(PROMPT, n=1, eos_id=None)))
        # Sent to vLLM (queued there, the engine being paused), or held by the engine until the
        # swap ends: either way the request has arrived before the swap relabels and resumes.
        await wait_until_async(
            lambda: llm.get_num_unfinished_requests() > before or engine.num_requests_held_for_swap == 1,
            "the request sent during the swap to arrive",
        )
        await relabel(version_label)

    llm.update_weight_version = send_then_relabel
    try:
        await engine.swap_weights(new_dir, version, mode="keep")
    finally:
        llm.update_weight_version = relabel
    (completion,) = await sent[0]
    return completion


def test_a_request_sent_during_a_swap_never_decodes_over_the_old_weights_prefix_cache(served, tmp_path_factory):
    engine, loop = served
    version = engine.policy_version + 1
    new_dir = create_tiny_model(TinyModelConfig(seed=10 + version), tmp_path_factory.mktemp(f"model_v{version}"))
    # The prompt's two whole blocks now sit in the prefix cache, computed by the weights served now.
    loop.run_until_complete(engine.generate(PROMPT, n=1, eos_id=None))

    completion = loop.run_until_complete(send_during_swap(engine, new_dir, version))

    assert completion.policy_versions == [version] * CONFIG.max_new_tokens
    assert completion.logprobs == pytest.approx(logprobs_under(new_dir, PROMPT, completion), abs=LOGPROB_ATOL)


def test_a_branch_reuses_its_heads_kv_under_the_weights_that_encoded_it_and_reencodes_it_after_a_swap(
    served, tmp_path_factory
):
    """Branch rollouts (forge_rl/core/branches.py) resample from a completion's prefix: the head's
    KV comes from the prefix cache while the weights that encoded it serve, and is encoded afresh
    by the new weights after a swap. Either way each continuation token's logprob is that of the
    version it is labelled with, and its `kv_versions` name the weights its context came from."""
    engine, loop = served
    prompt = PROMPT[:60]
    old, new = engine.policy_version + 1, engine.policy_version + 2
    old_dir = create_tiny_model(TinyModelConfig(seed=20 + old), tmp_path_factory.mktemp(f"model_v{old}"))
    new_dir = create_tiny_model(TinyModelConfig(seed=20 + new), tmp_path_factory.mktemp(f"model_v{new}"))
    loop.run_until_complete(engine.swap_weights(old_dir, old, mode="keep"))
    (parent,) = loop.run_until_complete(engine.generate(prompt, n=1, eos_id=None))
    head = parent.token_ids[:6]  # prompt + head: 66 tokens, two whole blocks, the second holding head tokens

    # One child per request here: vLLM reports the cached count of a request's last child, and
    # with several the later ones read the first one's prefill whatever the weights.
    ((_, cached),) = loop.run_until_complete(engine.generate_branches(prompt, [head], 1, None, None))
    assert cached == 64
    ((pieces, _),) = loop.run_until_complete(engine.generate_branches(prompt, [head], 3, None, None))
    for piece in pieces:
        assert piece.num_tokens == CONFIG.max_new_tokens - len(head)
        assert piece.policy_versions == piece.kv_versions == [old] * piece.num_tokens
        assert piece.logprobs == pytest.approx(logprobs_under(old_dir, prompt + head, piece), abs=LOGPROB_ATOL)

    loop.run_until_complete(engine.swap_weights(new_dir, new, mode="keep"))
    ((_, cached),) = loop.run_until_complete(engine.generate_branches(prompt, [head], 1, None, None))
    assert cached == 0  # the head's blocks were encoded by the old weights: salted apart
    ((pieces, _),) = loop.run_until_complete(engine.generate_branches(prompt, [head], 3, None, None))
    for piece in pieces:
        assert piece.policy_versions == piece.kv_versions == [new] * piece.num_tokens
        assert piece.logprobs == pytest.approx(logprobs_under(new_dir, prompt + head, piece), abs=LOGPROB_ATOL)
