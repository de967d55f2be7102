"""Each generator's vLLM workers run on the GPUs placement gives it (forge_rl/plumbing/placement.py,
`generator_devices`), one per tensor-parallel rank.

Skipped without CUDA (tests/conftest.py), and each test without the GPUs it names. The engines
see their devices through CUDA_VISIBLE_DEVICES (`VLLMEngine._engine_env`); the workers report the
UUID of the device they run on (`VLLMEngine.worker_devices`), compared here with the UUIDs of
this process's devices, so a worker on the wrong GPU fails whatever its local index is.
"""

import asyncio

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

_NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(_NUM_GPUS < 2, reason=f"requires at least 2 GPUs, got {_NUM_GPUS}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("gpu_devices") / "model")


def _device_uuids(indices) -> list[str]:
    # Called after the engines started: initializing CUDA here first would make vLLM spawn its
    # engine processes instead of forking them, and the fork is the path a generator actor takes.
    return [str(torch.cuda.get_device_properties(index).uuid) for index in indices]


@needs_two_gpus
def test_two_engines_on_one_host_run_on_their_assigned_devices(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    prompt = tokenizer.encode_prompt("M37=")

    async def run():
        engines = [VLLMEngine(GeneratorConfig(max_new_tokens=8), cuda_devices=(index,)) for index in (0, 1)]
        try:
            for engine in engines:
                await engine.start(model_dir, 128)
            workers = [await engine.worker_devices() for engine in engines]
            completions = [await engine.generate(prompt, 4, tokenizer.eos_id) for engine in engines]
        finally:
            for engine in engines:
                await engine.shutdown()
        return workers, completions

    workers, completions = asyncio.run(run())
    assert [len(engine_workers) for engine_workers in workers] == [1, 1]
    assert [engine_workers[0]["uuid"] for engine_workers in workers] == _device_uuids([0, 1])
    assert all(len(group) == 4 and all(c.token_ids for c in group) for group in completions)


@needs_two_gpus
def test_a_tensor_parallel_engine_spans_its_block_and_matches_the_trainer_before_and_after_a_swap(model_dir, tmp_path):
    """TP 2 over devices (0, 1): one worker per device, logprobs that agree with the trainer, and a
    weight swap (vLLM's reload: the staged loader is TP 1 only) that reaches both shards."""
    tokenizer = PromptTokenizer(model_dir)
    prompt = tokenizer.encode_prompt("M37=")
    new_weights = create_tiny_model(TinyModelConfig(seed=1), tmp_path / "v1")  # same shapes, other weights

    async def run():
        engine = VLLMEngine(GeneratorConfig(max_new_tokens=8, tensor_parallel_size=2), cuda_devices=(0, 1))
        try:
            await engine.start(model_dir, 128)
            workers = await engine.worker_devices()
            before = await engine.generate(prompt, 8, tokenizer.eos_id)
            stats = await engine.swap_weights(new_weights, policy_version=1)
            after = await engine.generate(prompt, 8, tokenizer.eos_id)
        finally:
            await engine.shutdown()
        return workers, before, stats, after

    workers, before, stats, after = asyncio.run(run())
    assert [worker["uuid"] for worker in workers] == _device_uuids([0, 1])
    assert stats.loader == "reload"
    assert all(version == 1 for completion in after for version in completion.policy_versions)
    for weights, completions in ((model_dir, before), (new_weights, after)):
        episode = Episode(0, "M37=", "7", prompt, completions)
        batch = make_train_batch([episode], tokenizer.pad_id)
        logprobs = PolicyTrainer(TrainerConfig(), weights).compute_logprobs(batch)
        diff = (logprobs - batch.behaviour_logprobs_NL)[batch.loss_mask_NL]
        assert diff.abs().max().item() < 5e-2, weights  # bf16 engine, as in test_gpu_paths.py
