"""`forge-rl bench staleness`: what bounded staleness costs, with and without IS correction.

Runs one recipe for every (max_policy_age, correction) pair at an equal sample budget (same steps
and batch size), and reports each run's final reward (mean of the last `final_window_steps` steps)
and the time until the smoothed reward reaches `target_reward`. max_policy_age 0 is the synchronous
baseline. Figures go to OUT_DIR/staleness.json and OUT_DIR/staleness.png; the last stdout line is
the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from forge_rl.bench.common import run_variant, time_to_reward
from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import DROPPED_COMPLETIONS, POLICY_AGE_MAX, POLICY_AGE_MEAN, WALL_TIME_S
from forge_rl.observability.metrics import final_reward
from forge_rl.observability.plot import headless_pyplot, plot_reward_curves, read_metrics, save_figure

if TYPE_CHECKING:
    from forge_rl.training.losses.config import Correction


@dataclass(frozen=True)
class StalenessArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config every run uses (only the staleness bound and the correction change)."""
    max_policy_ages: tuple[int, ...] = (0, 1, 2, 4, 8)
    """Staleness bounds to run; 0 is synchronous RL."""
    corrections: tuple[Literal["none", "tis", "mis"], ...] = ("none", "tis")
    """Off-policy corrections to run at every bound above 0 (trainer.loss.correction)."""
    steps: int | None = None
    """Trainer steps per run (the sample budget); unset: the config's."""
    out_dir: Path = Path("runs/bench-staleness")
    """Where the run directories, staleness.json and staleness.png go."""
    target_reward: float = 0.9
    """Smoothed reward whose first crossing is timed."""
    final_window_steps: int = 20
    """Final reward = mean reward of this many last steps."""


def variants(args: StalenessArgs) -> list[tuple[int, Correction]]:
    pairs: list[tuple[int, Correction]] = [(0, "none")]
    pairs += [(age, c) for age in args.max_policy_ages if age > 0 for c in args.corrections]
    return pairs


def run_one(base: GRPOConfig, args: StalenessArgs, max_policy_age: int, correction: Correction) -> Path:
    # Room for max_policy_age + 1 steps of episodes, so the bound, not the buffer, limits run-ahead.
    capacity = max(base.buffer.capacity_episodes, (max_policy_age + 1) * base.prompts_per_step)
    return run_variant(
        base,
        args.out_dir,
        f"age{max_policy_age}-{correction}",
        steps=args.steps or base.steps,
        buffer=dataclasses.replace(base.buffer, max_policy_age=max_policy_age, capacity_episodes=capacity),
        trainer=dataclasses.replace(base.trainer, loss=dataclasses.replace(base.trainer.loss, correction=correction)),
    )


def summarize(run_path: Path, args: StalenessArgs) -> dict:
    metrics = read_metrics(run_path)
    return {
        "final_reward": final_reward(metrics, args.final_window_steps),
        "time_to_target_s": time_to_reward(metrics, args.target_reward),
        "loop_time_s": metrics[-1][WALL_TIME_S],
        "mean_policy_age": sum(m[POLICY_AGE_MEAN] for m in metrics) / len(metrics),
        "max_policy_age_seen": max(m[POLICY_AGE_MAX] for m in metrics),
        "dropped_samples": metrics[-1][DROPPED_COMPLETIONS],
    }


def plot(runs: dict[str, Path], per_run: dict[str, dict], out: Path, target: float) -> None:
    plt = headless_pyplot()

    fig, (curves, times) = plt.subplots(1, 2, figsize=(13, 4.5))
    plot_reward_curves(curves, runs)
    curves.axhline(target, color="gray", ls="--", lw=0.8)
    curves.legend(fontsize=7)
    for correction in sorted({name.split("-")[1] for name in runs}):
        points = [
            (int(name.split("-")[0][3:]), summary["time_to_target_s"])
            for name, summary in per_run.items()
            if (name.endswith(correction) or name.startswith("age0-")) and summary["time_to_target_s"]
        ]
        times.plot(*zip(*sorted(points)), marker="o", label=f"correction={correction}")
    times.set_xlabel("max_policy_age")
    times.set_ylabel(f"seconds to smoothed reward {target}")
    times.legend()
    times.grid(alpha=0.3)
    save_figure(fig, out)


def main(args: StalenessArgs) -> dict:
    from forge_rl.observability.metrics import progress
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for max_policy_age, correction in variants(args):
        progress(f"bench staleness: max_policy_age={max_policy_age} correction={correction}")
        runs[f"age{max_policy_age}-{correction}"] = run_one(base, args, max_policy_age, correction)
    per_run = {name: summarize(path, args) for name, path in runs.items()}
    plot(runs, per_run, args.out_dir / "staleness.png", args.target_reward)
    sync_final = per_run["age0-none"]["final_reward"]
    corrected = [s["final_reward"] for name, s in per_run.items() if not name.endswith("-none")]
    summary = {
        "sync_final_reward": sync_final,
        "max_gap_to_sync_with_correction": max((sync_final - r for r in corrected), default=None),
        "runs": per_run,
    }
    (args.out_dir / "staleness.json").write_text(json.dumps(summary, indent=2))
    return summary
