"""The run directory: config.yaml, metrics.jsonl, checkpoints/ and (for from-scratch runs) the model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from forge_rl.config import GRPOConfig
from forge_rl.core.checkpoint import (
    CONTROLLER_FILE,
    ControllerState,
    checkpoints_root,
    newest_complete_checkpoint,
    read_controller_state,
)
from forge_rl.errors import ConfigError
from forge_rl.models.tiny import create_tiny_model
from forge_rl.observability.metrics import progress
from forge_rl.pipeline.partial_groups import partial_groups_problem, saved_partial_tokens
from forge_rl.run.preflight import check_machine, check_model_inputs
from forge_rl.tasks.tokenizer import tokenizer_fingerprint
from forge_rl.yaml_config import load_yaml_config

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RESUME_FIXED_FIELDS = ("model", "task", "data", "group_size", "trainer.num_procs", "trainer.parallel", "policies")
"""What a resumed run may not change: the checkpoint's shards are laid out for the model and the
parallelism, and the prompt indices it accounts for, and their groups, mean something only for the
task or data file (its path, columns and seed) and group size they were drawn with; it holds a
trainer per policy, each for the seats it played."""


def config_to_dict(config: DataclassInstance) -> dict:
    def plain(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))


def create_run_dir(config: GRPOConfig) -> Path:
    """Check what the run needs from this machine and its files (`forge_rl.run.preflight`), then create
    the run directory with config.yaml (and the tiny model, for from-scratch runs).

    The directory is built as RUN_DIR/.NAME.partial and renamed into place only once it is complete
    and its model's tokenizer and prompts check out, so a failure at any point leaves no directory
    that a later run or `--resume` could take for a run.
    """
    name = config.run_name or time.strftime("grpo-%Y%m%d-%H%M%S")
    path = config.run_dir / name
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        resume = f", continue it with `forge-rl grpo --resume {path}`," if newest_complete_checkpoint(path) else ""
        raise ConfigError(
            f"run directory {path} already exists and is not empty. Choose another --run-name{resume} or remove it."
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
            f"cannot create run directory {path}: {e.strerror} ({e.filename}). Set --run-dir to a writable directory."
        ) from None
    try:
        (partial / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
        if config.model.path is None:
            model_dir = create_tiny_model(config.model.tiny, partial / "model")
            if config.environment.warmup.episodes:
                from forge_rl.training.warmup import warm_up_model  # torch and TorchTitan: only for a warm-up

                figures = warm_up_model(model_dir, config.environment)
                (partial / "warmup.json").write_text(json.dumps(figures, indent=2) + "\n")
                progress(
                    f"warm-up: {figures['warmup/episodes']} demonstrations, {figures['warmup/steps']} steps, "
                    f"loss {figures['warmup/first_loss']:.3f} -> {figures['warmup/final_loss']:.3f}, "
                    f"{figures['warmup/seconds']:.1f} s"
                )
            check_model_inputs(config, model_dir)
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
    and would block re-running the same --run-name. A directory with metrics or checkpoints is
    kept. Returns whether it was removed."""
    metrics = run_path / "metrics.jsonl"
    if (metrics.is_file() and metrics.stat().st_size > 0) or checkpoints_root(run_path).exists():
        return False
    shutil.rmtree(run_path, ignore_errors=True)
    return True


def prepare_model_dir(config: GRPOConfig, run_path: Path) -> Path:
    """The model directory the run serves and trains: the user's (checked by the config and by
    `create_run_dir`), or the tiny model `create_run_dir` wrote into the run directory."""
    if config.model.path is None:
        return run_path / "model"
    return config.model.path


def saved_config_path(run_path: Path) -> Path:
    """The config a run directory was last run with (the base of `--resume`)."""
    return Path(run_path) / "config.yaml"


def _check_same_data(config: GRPOConfig, fingerprint: str, run_path: Path, checkpoint: Path) -> None:
    """The data file is the one the checkpoint counted rows of (`FileSource.fingerprint`): its
    cursor means nothing over another file, where a resume would skip or repeat rows."""
    from forge_rl.data.files import FileSource  # opens datasets: only for a run on a data file

    assert config.data is not None  # the caller checks it
    source = FileSource(config.data)
    if source.fingerprint != fingerprint:
        raise ConfigError(
            f"--resume {run_path}: {source.where} ({source.num_rows} rows) is not the file {checkpoint.name} was "
            "taken on (its row count, columns or rows differ), and the checkpoint's prompt cursor counts rows of "
            "that file: resumed, the run would skip or repeat rows. Restore the file the run trained on, or start "
            "a new run on this one (without --resume)."
        )


def _check_partial_groups(config: GRPOConfig, controller: ControllerState, run_path: Path, checkpoint: Path) -> None:
    """The checkpoint's partial groups can be continued by `config`'s model
    (`forge_rl.pipeline.partial_groups.partial_groups_problem`); otherwise ConfigError naming the file, or, with
    checkpoint.partial_groups_on_error regenerate, a warning (the rollouts then generate them afresh)."""
    problem = partial_groups_problem(
        controller.partial_groups,
        controller.reissue,
        config.model.hf_config()["vocab_size"],
        controller.tokenizer_fingerprint,
        tokenizer_fingerprint(prepare_model_dir(config, run_path)),
    )
    if problem is None:
        return
    where = checkpoint / CONTROLLER_FILE
    if config.checkpoint.partial_groups_on_error == "refuse":
        raise ConfigError(
            f"--resume {run_path}: {where}: {problem}. Resume with --checkpoint.partial-groups-on-error "
            "regenerate to generate those prompts again from the start (their saved tokens are counted as "
            f"salvage_discarded_tokens), or from an earlier checkpoint under {checkpoints_root(run_path)}."
        )
    progress(
        f"--resume {run_path}: {where}: {problem}; those {len(controller.partial_groups)} prompts are generated "
        f"again from the start ({saved_partial_tokens(controller.partial_groups)} saved tokens discarded)"
    )


def open_run_dir_for_resume(config: GRPOConfig) -> tuple[GRPOConfig, Path, Path]:
    """For `config.resume`: `config` pointed at that run directory, the directory, and its newest
    complete checkpoint. Raises ConfigError when the directory has no complete checkpoint, when
    `config` changes what the checkpoint fixes (RESUME_FIXED_FIELDS), or when nothing is left to
    train. Rewrites config.yaml with `config`, so a later resume continues with these settings."""
    if config.resume is None:
        raise ValueError("open_run_dir_for_resume opens the run config.resume names, and config.resume is unset")
    run_path = Path(config.resume)
    saved_path = saved_config_path(run_path)
    if not saved_path.is_file():
        raise ConfigError(
            f"--resume {run_path}: {saved_path} does not exist, so this is not a forge-rl run directory. "
            "Pass the directory a run printed as `run directory ...` (under --run-dir)."
        )
    checkpoint = newest_complete_checkpoint(run_path)
    if checkpoint is None:
        raise ConfigError(
            f"--resume {run_path}: no complete checkpoint under {checkpoints_root(run_path)} (a save cut "
            "short does not count). The run had checkpoints off or stopped before its first one; start "
            "it again with --checkpoint.enabled."
        )
    saved = load_yaml_config(GRPOConfig, saved_path)
    conflicts = [
        f"{name} ({_field(config, name)!r}; the run has {_field(saved, name)!r})"
        for name in RESUME_FIXED_FIELDS
        if _field(config, name) != _field(saved, name)
    ]
    if conflicts:
        raise ConfigError(
            f"--resume {run_path}: the config given changes what its checkpoint depends on: "
            f"{'; '.join(conflicts)}. Drop those flags (the run directory's config.yaml is the base), or "
            "start a new run."
        )
    config = dataclasses.replace(config, run_dir=run_path.parent, run_name=run_path.name)
    controller = read_controller_state(checkpoint)
    step = controller.step
    if config.data is not None and controller.data_fingerprint is not None:
        _check_same_data(config, controller.data_fingerprint, run_path, checkpoint)
    if controller.partial_groups:
        _check_partial_groups(config, controller, run_path, checkpoint)
    if controller.num_generators not in (None, config.num_generators) and config.num_generators == saved.num_generators:
        progress(
            f"--resume {run_path}: the pool had {controller.num_generators} generators at {checkpoint.name} "
            f"(changed while the run went on; config.yaml has {saved.num_generators}): starting "
            f"{controller.num_generators}. Pass --num-generators to start another count."
        )
        config = dataclasses.replace(config, num_generators=controller.num_generators)
    if step >= config.steps:
        raise ConfigError(
            f"--resume {run_path}: its newest checkpoint ({checkpoint.name}) is at step {step} and steps is "
            f"{config.steps}, so nothing is left to train. Raise --steps to train further."
        )
    check_machine(config)
    _write_atomically(saved_path, yaml.safe_dump(config_to_dict(config), sort_keys=False))
    return config, run_path, checkpoint


def truncate_metrics(run_path: Path, last_step: int) -> list[dict]:
    """Keep only the metrics of steps up to `last_step` in RUN_DIR/metrics.jsonl (a resume redoes the
    later ones); returns them."""
    path = Path(run_path) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = [metrics for metrics in map(json.loads, lines) if metrics["step"] <= last_step]
    _write_atomically(path, "".join(json.dumps(metrics) + "\n" for metrics in kept))
    return kept


def _field(config: object, dotted_name: str):
    for name in dotted_name.split("."):
        config = getattr(config, name)
    return config


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
