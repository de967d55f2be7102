"""Fixtures and helpers the integration tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from tests.support.helpers import rank_env

LAUNCH_ENV = tuple(rank_env(rank=0, world_size=1, master_port=0))
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
