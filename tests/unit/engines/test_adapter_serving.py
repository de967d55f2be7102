"""Serving policy versions as LoRA adapters (forge_rl/engines/vllm_engine.py, AdapterServing): the
checks that run before vLLM is touched, so no engine starts here."""

import asyncio
from pathlib import Path

import pytest

from forge_rl.engines.adapters import AdapterMismatch, AdapterServing
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine


def test_vllm_gets_the_smallest_max_lora_rank_it_accepts_that_holds_the_adapters():
    assert [AdapterServing(rank, 2, "/m").max_lora_rank for rank in (1, 4, 8, 16, 17, 300)] == [1, 8, 8, 16, 32, 320]
    with pytest.raises(ValueError, match=r"trainer.lora.rank \(1024\) exceeds vLLM's largest max_lora_rank \(512\)"):
        AdapterServing(1024, 2, "/m")
    with pytest.raises(ValueError, match=r"resident \(0\) must be >= 1"):
        AdapterServing(8, 0, "/m")


def test_an_adapter_of_another_base_is_refused_naming_both_bases():
    engine = VLLMEngine(GeneratorConfig(), adapters=AdapterServing(8, 2, "/models/a"))
    with pytest.raises(AdapterMismatch, match=r"adapter of base '/models/b', but this engine serves '/models/a'"):
        asyncio.run(engine.load_adapter(Path("/dev/shm/x"), 1, "/models/b"))


def test_an_adapter_version_on_a_full_weight_engine_is_refused_naming_the_flag():
    engine = VLLMEngine(GeneratorConfig())
    with pytest.raises(AdapterMismatch, match=r"serves full weights.*--trainer.lora.enabled"):
        asyncio.run(engine.load_adapter(Path("/dev/shm/x"), 1, "/models/a"))


def test_full_weights_on_an_adapter_engine_are_refused():
    engine = VLLMEngine(GeneratorConfig(), adapters=AdapterServing(8, 2, "/models/a"))
    with pytest.raises(AdapterMismatch, match=r"holds full weights.*--trainer.lora.enabled"):
        asyncio.run(engine.load_adapter(Path("/dev/shm/x"), 1, None))
