"""The tiny Qwen3-MoE served by vLLM's CPU backend: its logprobs agree with the TorchTitan
trainer's, and forge_rl's capture hook records the routing the trainer computes for the same
tokens (forge_rl/engines/routing_capture.py).
One engine start (about 30 s here) for the module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.envs.runner import SampledTurn
from forge_rl.models.moe import last_routing
from forge_rl.models.tiny import create_tiny_model
from forge_rl.routing import routing_differs_NL
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode
from tests.unit.models.test_keep_routing import NUM_LAYERS, PROMPT, TINY_MOE, TOP_K

pytestmark = pytest.mark.integration

NUM_SAMPLES, NUM_NEW_TOKENS = 4, 6


def _sample(model_dir) -> tuple[Episode, SampledTurn]:
    """An episode of 4 completions of 6 tokens sampled by vLLM with routing recorded, and a turn of
    3 tokens continuing the first (the multi-turn path, `generate_turn`)."""
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=NUM_NEW_TOKENS, record_routing=True))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start(model_dir, max_model_len=64))
        completions = loop.run_until_complete(engine.generate(PROMPT, NUM_SAMPLES, eos_id=None))
        turn = loop.run_until_complete(engine.generate_turn(PROMPT + completions[0].token_ids, 3, eos_id=None))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    return Episode(0, "", "", PROMPT, completions), turn


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    model_dir = create_tiny_model(TINY_MOE, tmp_path_factory.mktemp("moe") / "model")
    return model_dir, *_sample(model_dir)


def test_the_cpu_hook_records_every_generated_token_at_every_moe_layer(sampled):
    _, episode, turn = sampled
    assert turn.routed_experts is not None and turn.routed_experts.expert_ids_GXK.shape == (3, NUM_LAYERS, TOP_K)
    for completion in episode.completions:
        record = completion.routed_experts
        assert record is not None and record.expert_ids_GXK.shape == (NUM_NEW_TOKENS, NUM_LAYERS, TOP_K)
        assert record.expert_ids_GXK.dtype == torch.uint8
    # Every completion's first token was sampled by the same prefill row (the prompt's last token).
    firsts = {tuple(c.routed_experts.expert_ids_GXK[0].flatten().tolist()) for c in episode.completions}
    assert len(firsts) == 1


def test_vllm_and_torchtitan_agree_on_logprobs_and_on_the_routing_that_sampled_each_token(sampled, single_process):
    model_dir, episode, _ = sampled
    batch = make_train_batch([episode], pad_id=0)
    trainer = PolicyTrainer(TrainerConfig(batching="pad"), model_dir)
    logprobs = trainer.compute_logprobs(batch)
    mask = batch.loss_mask_NL
    assert (logprobs - batch.behaviour_logprobs_NL)[mask].abs().max() < 1e-4
    # The trainer's own routing at the rows that sampled each token is what vLLM used (fp32 both).
    own_NLXK = last_routing(trainer.model)[:, :-1]
    recorded_NLXK = batch.routed_experts_NLXK[:, 1:]
    assert not routing_differs_NL(own_NLXK, recorded_NLXK)[mask[:, 1:]].any()


@pytest.mark.gpu
def test_vllms_own_routed_experts_become_the_record_on_gpu(tmp_path):
    """On GPU the record comes from vLLM (enable_return_routed_experts), not forge_rl's hook."""
    episode, turn = _sample(create_tiny_model(TINY_MOE, tmp_path / "model"))
    assert turn.routed_experts is not None
    for completion in episode.completions:
        assert completion.routed_experts is not None
        assert completion.routed_experts.expert_ids_GXK.shape == (NUM_NEW_TOKENS, NUM_LAYERS, TOP_K)
