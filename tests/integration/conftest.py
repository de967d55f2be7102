"""Fixtures and helpers the integration tests share."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from forge_rl.models.tiny import TinyModelConfig, create_tiny_model

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher sets for torch.distributed; unset, a PolicyTrainer runs as one process."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama created from scratch for the module."""
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def single_process():
    """No launcher variables in this process, so a PolicyTrainer built in it runs alone."""
    with pytest.MonkeyPatch.context() as patch:
        for name in LAUNCH_ENV:
            patch.delenv(name, raising=False)
        yield


async def decoding_batch(engine, prompts: list[list[int]], n: int) -> asyncio.Future:
    """Start `n` samples of each prompt on `engine` (a VLLMEngine, eos ignored) and return their
    gathered future once they are decoding, so a weight swap lands mid-request.

    "Decoding" is known, not guessed: a 3-token probe submitted just before the batch has finished,
    so the requests scheduled with it have decoded tokens and most of theirs still to go. A fixed
    sleep landed the swap before the first decode step on a machine with a slow prefill, and a
    probe submitted after the batch queues behind it once the batch fills max_num_seqs.
    """
    probe = asyncio.ensure_future(engine.generate(prompts[0], n=1, eos_id=None, forced_length=3))
    await asyncio.sleep(0.01)  # the probe's request goes in first
    batch = asyncio.gather(*(engine.generate(p, n=n, eos_id=None) for p in prompts))
    await probe
    return batch
