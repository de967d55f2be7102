"""What the benchmarks share: running one variant of a recipe config, reading reward curves."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from forge_rl.config import GRPOConfig
from forge_rl.metrics import FINAL_REWARD_WINDOW, REWARD_MEAN, WALL_TIME_S

# Reward curves are smoothed over this many steps before reading off a time (final values use the
# same window: metrics.final_reward).
SMOOTHING_STEPS = FINAL_REWARD_WINDOW


def run_variant(base: GRPOConfig, out_dir: Path, name: str, **changes) -> Path:
    """Run `base` with `changes` (dataclasses.replace fields) as OUT_DIR/NAME; returns that path."""
    from forge_rl.recipes import recipe

    asyncio.run(recipe("grpo")(dataclasses.replace(base, run_dir=out_dir, run_name=name, **changes)))
    return out_dir / name


def time_to_reward(metrics: list[dict], target: float) -> float | None:
    """Seconds since the loops started until the smoothed mean reward first reaches `target`."""
    rewards = [m[REWARD_MEAN] for m in metrics]
    for i in range(SMOOTHING_STEPS - 1, len(rewards)):
        if sum(rewards[i - SMOOTHING_STEPS + 1 : i + 1]) / SMOOTHING_STEPS >= target:
            return metrics[i][WALL_TIME_S]
    return None
