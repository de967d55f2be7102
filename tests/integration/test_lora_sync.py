"""Adapter-only weight sync into a real vLLM engine (issue 15, part 5): the trainer side publishes
LoRA adapters through the weight store, the engine serves each version as a new vLLM adapter.

The silent failures this guards against (every known LoRA bug in async RL elsewhere fails
silently): an adapter that is not applied, a stale adapter under a cached name, another request's
adapter. So the engine's logprobs on a fixed prompt must equal the trainer's (TorchTitan with the
same adapters attached, one process) and differ from the base model's, after every update, and a
request in flight across an update must keep its own adapter and version.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from forge_rl.store.actors import open_store
from forge_rl.store.client import WeightStore
from forge_rl.store.publisher import WeightPublisher
from tests.support.held_engine import HoldableEngine, hold_mid_request

pytestmark = pytest.mark.integration

RANK = 4
MAX_MODEL_LEN = 64
NEW_TOKENS = 12
PROMPT = [1, 5, 9, 6, 12, 7, 8]
LOGPROB_TOLERANCE = 1e-4  # measured 2.4e-7 (fp32 on both sides); a wrong or missing adapter moves them by > 0.05


class Trainer:
    """The trainer side in one process: the TorchTitan model, its adapters, the store publisher."""

    def __init__(self, model_dir: Path, publisher: WeightPublisher, targets: tuple[str, ...] | None = None):
        from forge_rl.models.lora import LoRAAdapters, LoRAConfig
        from forge_rl.models.titan import ParallelConfig, build_titan_model

        self.model_dir, self.publisher = model_dir, publisher
        self.model, _ = build_titan_model(model_dir, ParallelConfig(), torch.device("cpu"))
        self.lora = LoRAConfig(rank=RANK, alpha=8.0, **({"targets": targets} if targets else {}))
        self.adapters = LoRAAdapters(self.model, self.lora)
        self.adapters.attach()

    def set_version(self, version: int) -> None:
        """Adapters of 'version' v: random, non-zero, a different draw per version."""
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.adapters.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    async def publish(self, version: int) -> None:
        from forge_rl.models.peft_format import peft_adapter

        self.set_version(version)
        tensors, config = peft_adapter(self.adapters.adapter_state_dict(), self.lora, self.model_dir, torch.float32)
        await self.publisher.publish(version, tensors, 0.0, adapter=(config, str(self.model_dir)))
        await self.publisher.flush()

    def logprobs(self, tokens: list[int], version: int | None) -> list[float]:
        """Logprobs of `tokens` after PROMPT under adapters of `version` (None: the base)."""
        if version is None:
            self.adapters.detach()
        else:
            self.set_version(version)
        try:
            return self.current_logprobs(tokens)
        finally:
            self.adapters.attach()

    def current_logprobs(self, tokens: list[int]) -> list[float]:
        """Logprobs of `tokens` after PROMPT with the adapters as they are now."""
        with torch.no_grad():
            logits = self.model(torch.tensor([PROMPT + tokens]))[0]
        positions = torch.log_softmax(logits.float(), dim=-1)[len(PROMPT) - 1 : -1]
        return [positions[i, t].item() for i, t in enumerate(tokens)]


class Setup:
    def __init__(self, loop, engine, store, trainer):
        self.loop, self.engine, self.store, self.trainer = loop, engine, store, trainer

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from forge_rl.engines.adapters import AdapterServing
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model

    torch.manual_seed(0)
    model_dir = create_tiny_model(TinyModelConfig(num_kv_heads=2), tmp_path_factory.mktemp("lora-base") / "model")
    root = Path("/dev/shm") / f"forge_rl-test-lora-store-{time.monotonic_ns()}"
    loop = asyncio.new_event_loop()

    async def build():
        index, _ = await open_store(root, model_dir, keep_latest=1)
        store = WeightStore(index, root, extra_files_dir=model_dir)
        # Two adapters resident (max_policy_age 1), temperature 1: processed logprobs are log-softmax.
        engine = HoldableEngine(
            GeneratorConfig(max_new_tokens=NEW_TOKENS, temperature=1.0),
            adapters=AdapterServing(rank=RANK, resident=2, base_model=str(model_dir)),
        )
        await engine.start(model_dir, MAX_MODEL_LEN)
        return store, engine

    store, engine = loop.run_until_complete(build())
    setup = Setup(loop, engine, store, Trainer(model_dir, WeightPublisher(store)))
    yield setup
    loop.run_until_complete(engine.shutdown())
    loop.close()
    store.local.destroy()


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_after_each_adapter_update_the_engine_serves_the_trainers_logprobs_not_the_bases(lora_setup):
    from forge_rl.store.loader import ADAPTERS_RESIDENT, PUBLISH_TO_SERVABLE_S, load_version

    s = lora_setup
    for version in (1, 2, 3):
        s.run(s.trainer.publish(version))
        metrics = s.run(load_version(s.engine, s.store, version))
        assert metrics["loader"] == "adapter" and metrics["policy_version"] == version
        assert metrics[ADAPTERS_RESIDENT] == min(version, 3) and metrics[PUBLISH_TO_SERVABLE_S] < 10
        (completion,) = s.run(s.engine.generate(PROMPT, n=1, eos_id=None))
        assert completion.policy_versions == [version] * NEW_TOKENS
        served = completion.logprobs
        assert _close(served, s.trainer.logprobs(completion.token_ids, version)) < LOGPROB_TOLERANCE
        assert _close(served, s.trainer.logprobs(completion.token_ids, None)) > 0.05, "adapter not applied"
        if version > 1:
            assert _close(served, s.trainer.logprobs(completion.token_ids, version - 1)) > 0.05, "stale adapter"
    # Two resident (max_policy_age + 1): version 1's adapter was unloaded after version 3 loaded.
    assert s.run(s.engine.adapters_settled()) == [1]
    assert sorted(s.run(s.engine._running_llm.list_loras())) == [2 + 1, 3 + 1]


def test_a_request_in_flight_across_an_update_keeps_its_adapter_and_version(lora_setup):
    from forge_rl.store.loader import load_version

    s = lora_setup
    s.run(s.trainer.publish(4))

    async def update_mid_request():
        version_before = s.engine.policy_version
        # Held after 3 tokens: the request is mid-decode when the new adapter loads.
        batch = await hold_mid_request(
            s.engine, lambda: s.engine.generate(PROMPT, n=2, eos_id=None), num_requests=2, hold_after_tokens=3
        )
        metrics = await load_version(s.engine, s.store, 4)  # add_lora is answered while held
        await s.engine.resume()
        return version_before, metrics, await batch

    version_before, metrics, in_flight = s.run(update_mid_request())
    assert metrics["policy_version"] == 4 and version_before == 3
    for completion in in_flight:  # its own adapter (3) to the end, and stamped so
        assert completion.policy_versions == [3] * NEW_TOKENS
        assert _close(completion.logprobs, s.trainer.logprobs(completion.token_ids, 3)) < LOGPROB_TOLERANCE
    (after,) = s.run(s.engine.generate(PROMPT, n=1, eos_id=None))
    assert after.policy_versions == [4] * NEW_TOKENS
    assert _close(after.logprobs, s.trainer.logprobs(after.token_ids, 4)) < LOGPROB_TOLERANCE


def test_a_request_that_outlives_its_adapter_continues_on_the_newest_and_no_load_waits_for_it(lora_setup):
    """Two adapters resident: the second load after a request's own retires its adapter while the
    request is held mid-decode (a straggler past the age bound). The request is moved to the
    newest adapter, and the load after that is answered without the request finishing."""
    from forge_rl.core.columns import exact_versions
    from forge_rl.store.loader import load_version

    s = lora_setup
    held_version = s.engine.policy_version + 1

    async def retire_under_a_held_request():
        await s.trainer.publish(held_version)
        await load_version(s.engine, s.store, held_version)
        batch = await hold_mid_request(
            s.engine, lambda: s.engine.generate(PROMPT, n=1, eos_id=None), num_requests=1, hold_after_tokens=3
        )
        for version in range(held_version + 1, held_version + 4):
            await s.trainer.publish(version)
            # The third load waits for the second's unload, of the held request's adapter: bounded
            # here so that an unload waiting for the request fails the test instead of hanging it.
            await asyncio.wait_for(load_version(s.engine, s.store, version), timeout=60)
        await s.engine.resume()
        return await batch

    (completion,) = s.run(retire_under_a_held_request())
    head, tail = completion.policy_versions[:3], completion.policy_versions[3:]
    assert head == [held_version] * 3 and len(set(tail)) == 1, completion.policy_versions
    (tail_version,) = set(tail)
    assert tail_version >= held_version + 2  # the newest adapter when its own was retired
    assert exact_versions(completion) == head + tail  # its prefix encoded anew by the newest adapter
    assert (
        _close(completion.logprobs[:3], s.trainer.logprobs(completion.token_ids, held_version)[:3]) < LOGPROB_TOLERANCE
    )
    assert (
        _close(completion.logprobs[3:], s.trainer.logprobs(completion.token_ids, tail_version)[3:]) < LOGPROB_TOLERANCE
    )
    assert s.run(s.engine.adapters_settled()) == [held_version + 1]
    assert sorted(s.run(s.engine._running_llm.list_loras())) == [held_version + 2 + 1, held_version + 3 + 1]


def test_an_adapter_on_the_unembedding_is_served_with_the_trainers_logprobs(lora_setup):
    """lm_head among the targets: vLLM applies its adapter in LogitsProcessorWithLoRA, on the same
    engine (every adapter version may or may not adapt lm_head). Its logprobs equal the trainer's,
    and differ from those of the same adapters without the lm_head one."""
    from forge_rl.models.lora_config import ATTENTION_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
    from forge_rl.store.loader import load_version

    s = lora_setup
    trainer = Trainer(s.trainer.model_dir, s.trainer.publisher, ATTENTION_TARGETS + MLP_TARGETS + UNEMBED_TARGETS)
    version = s.engine.policy_version + 1
    s.run(trainer.publish(version))
    assert s.run(load_version(s.engine, s.store, version))["policy_version"] == version
    (completion,) = s.run(s.engine.generate(PROMPT, n=1, eos_id=None))
    assert completion.policy_versions == [version] * NEW_TOKENS
    assert _close(completion.logprobs, trainer.logprobs(completion.token_ids, version)) < LOGPROB_TOLERANCE
    with torch.no_grad():
        trainer.adapters.layers["lm_head"].lora_B.zero_()  # the other adapters of `version` kept
    without_unembedding = trainer.current_logprobs(completion.token_ids)
    assert _close(completion.logprobs, without_unembedding) > 0.05, "lm_head's adapter not applied"


def _tied(model_dir: Path) -> Path:
    """`model_dir` rewritten with tie_word_embeddings true: lm_head.weight dropped, the embedding
    serving as the unembedding too (as SmolLM2 and Qwen3-0.6B)."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(model_dir / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def test_an_unembedding_adapter_on_tied_embeddings_is_served_with_the_trainers_logprobs(tmp_path):
    """Tied embeddings: the trainer adds lm_head's adapter to the logits alone (the shared matrix
    stays the base's), and so does vLLM (LogitsProcessorWithLoRA over the tied head)."""
    from forge_rl.engines.adapters import AdapterServing
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine
    from forge_rl.models.lora_config import ATTENTION_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
    from forge_rl.models.peft_format import write_peft_adapter
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model

    model_dir = _tied(create_tiny_model(TinyModelConfig(num_kv_heads=2), tmp_path / "model"))
    trainer = Trainer(model_dir, None, ATTENTION_TARGETS + MLP_TARGETS + UNEMBED_TARGETS)
    assert trainer.model.tok_embeddings.weight is trainer.model.lm_head.weight
    trainer.set_version(1)
    adapter_dir = write_peft_adapter(
        tmp_path / "adapter", trainer.adapters.adapter_state_dict(), trainer.lora, model_dir
    )

    async def serve():
        engine = VLLMEngine(
            GeneratorConfig(max_new_tokens=NEW_TOKENS, temperature=1.0),
            adapters=AdapterServing(rank=RANK, resident=1, base_model=str(model_dir)),
        )
        await engine.start(model_dir, MAX_MODEL_LEN)
        try:
            await engine.load_adapter(adapter_dir, 1, str(model_dir))
            return await engine.generate(PROMPT, n=1, eos_id=None)
        finally:
            await engine.shutdown()

    (completion,) = asyncio.run(serve())
    assert _close(completion.logprobs, trainer.logprobs(completion.token_ids, 1)) < LOGPROB_TOLERANCE
    with torch.no_grad():
        trainer.adapters.layers["lm_head"].lora_B.zero_()
    assert _close(completion.logprobs, trainer.current_logprobs(completion.token_ids)) > 0.05, (
        "lm_head's adapter not applied"
    )
