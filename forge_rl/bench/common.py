"""What the benchmarks share: running one variant of a recipe config, reading reward curves."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.observability.metric_names import REWARD_MEAN, WALL_TIME_S
from forge_rl.observability.metrics import FINAL_REWARD_WINDOW

# Reward curves are smoothed over this many steps before reading off a time (final values use the
# same window: metrics.final_reward).
SMOOTHING_STEPS = FINAL_REWARD_WINDOW


def run_variant(base: GRPOConfig, out_dir: Path, name: str, **changes) -> Path:
    """Run `base` with `changes` (dataclasses.replace fields) as OUT_DIR/NAME; returns that path."""
    from forge_rl.run.recipes import recipe

    run = recipe("grpo")(dataclasses.replace(base, run_dir=out_dir, run_name=name, **changes))
    asyncio.run(cast("Coroutine[Any, Any, dict]", run))  # a recipe's `run` is an async def
    return out_dir / name


def seeded(base: GRPOConfig, seed: int) -> GRPOConfig:
    """`base` with `seed` as its trainer's, its prompts' and its generators' sampling seed (the
    initial weights stay model.tiny.seed's: every seed starts from the same model)."""
    return dataclasses.replace(
        base,
        trainer=dataclasses.replace(base.trainer, seed=seed),
        task=dataclasses.replace(base.task, seed=seed),
        generator=dataclasses.replace(base.generator, seed=seed),
    )


def reuse_or_run_variant(base: GRPOConfig, out_dir: Path, name: str, **changes) -> Path:
    """`run_variant`, except that a run OUT_DIR/NAME already finished with the same config (its
    config.yaml equal to this one, all its steps logged) is taken as it is: a benchmark cut into
    several invocations (one seed each) reads the earlier runs instead of running them again. A
    directory there holding anything else is an error naming the fix."""
    import yaml

    from forge_rl.run.run_dir import config_to_dict, saved_config_path

    config = dataclasses.replace(base, run_dir=out_dir, run_name=name, **changes)
    path = out_dir / name
    if not path.exists():
        return run_variant(base, out_dir, name, **changes)
    saved = saved_config_path(path)
    metrics = path / "metrics.jsonl"
    logged = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0
    # Compared as YAML, the form config.yaml holds (a tuple field reads back as a list).
    as_saved = yaml.safe_load(yaml.safe_dump(config_to_dict(config)))
    same = saved.is_file() and yaml.safe_load(saved.read_text()) == as_saved
    if not same or logged < config.steps:
        raise ConfigError(
            f"{path} holds another run (another config, or one that did not finish its {config.steps} "
            "steps). Remove it or set another --out-dir."
        )
    return path


def smoothed(rewards: list[float]) -> list[float]:
    """Means of SMOOTHING_STEPS consecutive steps; the first is the mean of steps 1..SMOOTHING_STEPS."""
    return [
        sum(rewards[i - SMOOTHING_STEPS + 1 : i + 1]) / SMOOTHING_STEPS
        for i in range(SMOOTHING_STEPS - 1, len(rewards))
    ]


def steps_to(rewards: list[float], target: float) -> int | None:
    """Trainer steps until the reward, smoothed over SMOOTHING_STEPS steps, first reaches `target`."""
    for i, mean in enumerate(smoothed(rewards)):
        if mean >= target:
            return i + SMOOTHING_STEPS
    return None


def time_to_reward(metrics: list[dict], target: float) -> float | None:
    """Seconds since the loops started until the smoothed mean reward first reaches `target`."""
    steps = steps_to([m[REWARD_MEAN] for m in metrics], target)
    return None if steps is None else metrics[steps - 1][WALL_TIME_S]


def final_reward_spread(finals: list[float]) -> dict:
    """Final rewards of one variant's runs (one per seed): their mean, sample standard deviation
    (0 for one run), lowest and highest."""
    return {
        "final_reward_mean": statistics.mean(finals),
        "final_reward_stdev": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "final_reward_min": min(finals),
        "final_reward_max": max(finals),
    }
