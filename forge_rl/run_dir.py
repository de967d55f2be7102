"""The run directory: config.yaml, metrics.jsonl and (for from-scratch runs) the model."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import yaml

from forge_rl.config import GRPOConfig
from forge_rl.models.tiny import create_tiny_model
from forge_rl.preflight import check_machine, check_model_inputs
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
    """Check what the run needs from this machine and its files (forge_rl/preflight.py), then create
    the run directory with config.yaml (and the tiny model, for from-scratch runs).

    The directory is built as RUN_DIR/.NAME.partial and renamed into place only once it is complete
    and its model's tokenizer and prompts check out, so a failure at any point leaves no directory
    that a later run or `--resume` could take for a run.
    """
    name = config.run_name or time.strftime("grpo-%Y%m%d-%H%M%S")
    path = config.run_dir / name
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            f"run directory {path} already exists and is not empty. Choose another --run-name "
            "or remove it."
        )
    check_machine(config)
    if config.model.path is not None:
        check_model_inputs(config, config.model.path)
    partial = config.run_dir / f".{name}.partial"
    try:
        shutil.rmtree(partial, ignore_errors=True)  # left by a creation that was killed
        partial.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create run directory {path}: {e.strerror} ({e.filename}). Set --run-dir to a "
            "writable directory."
        ) from None
    try:
        (partial / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
        if config.model.path is None:
            check_model_inputs(config, create_tiny_model(config.model.tiny, partial / "model"))
        if path.exists():
            path.rmdir()  # empty, checked above
        partial.rename(path)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConfigError(
                f"cannot write run directory {path}: {e.strerror} ({e.filename}). Free space or set "
                "--run-dir to a writable directory."
            ) from None
        raise
    return path


def remove_unstarted_run_dir(run_path: Path) -> bool:
    """Remove `run_path` if its run failed before logging a step (an engine that would not start,
    Ctrl-C during start-up): it holds only config.yaml and the model, nothing to inspect or resume,
    and would block re-running the same --run-name. Returns whether it was removed."""
    metrics = run_path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return False
    shutil.rmtree(run_path, ignore_errors=True)
    return True


def prepare_model_dir(config: GRPOConfig, run_path: Path) -> Path:
    """The model directory the run serves and trains: the user's (checked by the config and by
    `create_run_dir`), or the tiny model `create_run_dir` wrote into the run directory."""
    if config.model.path is None:
        return run_path / "model"
    return config.model.path
