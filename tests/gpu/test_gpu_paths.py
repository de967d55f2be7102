"""The CUDA paths: vLLM's CUDA build, NCCL trainer ranks, the whole loop on one GPU.

Skipped without CUDA (tests/conftest.py). Set up a GPU machine with `make ENGINE=gpu venv`, then
`make test-gpu`.
"""

import asyncio
import json

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.tasks.tokenizer import VOCAB_SIZE, PromptTokenizer
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("gpu") / "model")


def test_trainer_on_cuda_matches_transformers_logits(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    assert trainer.device.type == "cuda"
    input_ids = torch.randint(3, VOCAB_SIZE, (4, 12))
    ours = trainer._logits(input_ids).cpu()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    theirs = reference(input_ids.cuda()).logits.float().cpu()
    assert (ours - theirs).abs().max().item() < 1e-3  # TF32 matmuls on GPU


def test_cuda_vllm_logprobs_agree_with_the_cuda_trainer(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=8))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start(model_dir, 128))
        prompt = tokenizer.encode_prompt("M37=")
        completions = loop.run_until_complete(engine.generate(prompt, 8, tokenizer.eos_id))
        loop.run_until_complete(engine.shutdown())
    finally:
        loop.close()
    episode = Episode(0, "M37=", "7", prompt, completions)
    batch = make_train_batch([episode], tokenizer.pad_id)
    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    logprobs = trainer.compute_logprobs(batch)
    diff = (logprobs - batch.behaviour_logprobs_NL)[batch.loss_mask_NL]
    # The CUDA engine serves bf16 (forge_rl/engines/vllm_engine.py): agreement is bf16-close.
    assert diff.abs().max().item() < 5e-2


def test_the_whole_loop_runs_on_one_gpu(tmp_path):
    from apps.grpo.main import run
    from forge_rl.config import GRPOConfig
    from forge_rl.core.buffer import BufferConfig
    from forge_rl.plumbing.placement import LaunchConfig

    config = GRPOConfig(
        run_dir=tmp_path,
        run_name="gpu",
        steps=3,
        train_batch_size=32,
        group_size=4,
        buffer=BufferConfig(max_policy_age=1, capacity_episodes=16),
        launch=LaunchConfig(share_gpus=True),  # trainer rank and generator on device 0
    )
    summary = asyncio.run(run(config))
    assert summary["steps"] == 3
    assert summary["max_policy_age_seen"] <= 1
    metrics = [json.loads(line) for line in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["loss/mismatch_kl"] < 1e-2


def test_cuda_vllm_returns_sampling_masks_and_the_trainer_renormalizes_over_them(model_dir):
    """On GPUs vLLM's model runner V2 runs, so kept sets come from its sampling masks (on CPU they
    are read from the top processed logprobs instead; tests/integration/test_vllm_engine.py)."""
    tokenizer = PromptTokenizer(model_dir)
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=8, temperature=0.8, top_p=0.8))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start(model_dir, 128))
        assert engine._support_source == "sampling_mask"
        prompt = tokenizer.encode_prompt("M37=")
        completions = loop.run_until_complete(engine.generate(prompt, 8, tokenizer.eos_id))
        loop.run_until_complete(engine.shutdown())
    finally:
        loop.close()
    for completion in completions:
        assert all(token in kept for token, kept in zip(completion.token_ids, completion.sampling_support))
    episode = Episode(0, "M37=", "7", prompt, completions, temperature=0.8)
    batch = make_train_batch([episode], tokenizer.pad_id)
    logprobs = PolicyTrainer(TrainerConfig(), model_dir).compute_logprobs(batch)
    ratio = (logprobs - batch.behaviour_logprobs_NL)[batch.loss_mask_NL].exp()
    assert abs(ratio.mean().item() - 1.0) < 5e-2  # bf16 engine; without the kept sets ~0.8
