"""The run directory: config.yaml, metrics.jsonl and (for from-scratch runs) the model."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import yaml

from forge_rl.config import GRPOConfig
from forge_rl.models.tiny import create_tiny_model
from forge_rl.yaml_config import ConfigError

def config_to_dict(config: object) -> dict:
    def plain(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))


def create_run_dir(config: GRPOConfig) -> Path:
    """Create a fresh run directory and record the resolved config in it."""
    name = config.run_name or time.strftime("grpo-%Y%m%d-%H%M%S")
    path = config.run_dir / name
    if path.exists() and any(path.iterdir()):
        raise ConfigError(
            f"run directory {path} already exists and is not empty. Choose another --run-name "
            "or remove it."
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    return path


def prepare_model_dir(config: GRPOConfig, run_path: Path) -> Path:
    """The model directory the run serves and trains: the user's (checked by the config) or a new
    tiny model written into the run directory."""
    if config.model.path is None:
        return create_tiny_model(config.model.tiny, run_path / "model")
    return config.model.path
