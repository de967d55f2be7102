"""What the benchmarks share: running one variant of a recipe config, reading reward curves."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from forge_rl.config import GRPOConfig

# Reward curves are smoothed over this many steps before reading off a time or a final value.
SMOOTHING_STEPS = 5


def run_variant(base: GRPOConfig, out_dir: Path, name: str, **changes) -> Path:
    """Run `base` with `changes` (dataclasses.replace fields) as OUT_DIR/NAME; returns that path."""
    from apps.grpo.main import run

    asyncio.run(run(dataclasses.replace(base, run_dir=out_dir, run_name=name, **changes)))
    return out_dir / name


def time_to_reward(metrics: list[dict], target: float) -> float | None:
    """Seconds since the loops started until the smoothed mean reward first reaches `target`."""
    rewards = [m["reward/mean"] for m in metrics]
    for i in range(SMOOTHING_STEPS - 1, len(rewards)):
        if sum(rewards[i - SMOOTHING_STEPS + 1 : i + 1]) / SMOOTHING_STEPS >= target:
            return metrics[i]["wall_time_s"]
    return None


def final_reward(metrics: list[dict], num_steps: int = SMOOTHING_STEPS) -> float:
    """Mean reward of the last `num_steps` steps."""
    tail = metrics[-num_steps:]
    return sum(m["reward/mean"] for m in tail) / len(tail)
