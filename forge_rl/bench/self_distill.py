"""`forge-rl bench self-distill`: GRPO with and without a teacher pinned to the policy's own past.

The same recipe config runs once per variant and seed, same steps: GRPO alone, then GRPO plus
self-distillation (`forge_rl.scoring.teacher.TeacherPin`) with the teacher lagged `versions_back`
versions, an exponential moving average of the versions, and the version after the best step. The
distillation term pulls each token toward what the policy's recent past preferred, a moving trust
region; whether that helps depends on how unstable plain GRPO is, so `--lr` sets the regime (the
demo's 3e-4 learns steadily; docs/benchmarks/README.md has what 1e-3 and up do) and `--seeds` repeats
every variant (a seed is the trainer's, the prompts' and the generators' seed; the initial model is
the same).

Figures per run: the final task reward (last FINAL_REWARD_WINDOW steps), the highest smoothed
reward (a run that climbs and falls back without reaching the target shows there), the steps until
the smoothed reward reaches `target_reward`, the lowest smoothed reward after first reaching it,
whether the run collapsed (`collapsed`) and the loop time. Per variant over its seeds: the mean and
the spread of those, and the number of collapses. OUT_DIR/self_distill.json; the last stdout line
holds the per-variant figures. The chart has a panel per variant with each seed's smoothed curve.

Runs already finished in OUT_DIR with the same config are read, not run again (common.py
`reuse_or_run_variant`): `--seeds 0`, `--seeds 1`, then `--seeds 0 1` aggregates both.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from forge_rl.bench.common import SMOOTHING_STEPS, final_reward_spread, reuse_or_run_variant, seeded, smoothed, steps_to
from forge_rl.bench.distill import final, task_rewards
from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import WALL_TIME_S
from forge_rl.observability.metrics import progress
from forge_rl.observability.plot import plot_per_step_panels, read_metrics
from forge_rl.tasks import TaskName

PINS: tuple[Literal["lagged", "ema", "best"], ...] = ("lagged", "ema", "best")


@dataclass(frozen=True)
class SelfDistillArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config every variant runs (the demo)."""
    task: TaskName | None = None
    """task.name of every variant (None: the config's): another synthetic task on the same model."""
    steps: int = 200
    """Trainer steps per run."""
    lr: float = 1e-3
    """trainer.lr of every variant: the regime. On the demo plain GRPO is steady at 3e-4 and 1e-3,
    reaches 0.8 and falls back at 2e-3 (where the teachers help), stalls at 3e-3 (docs/benchmarks/README.md)."""
    seeds: tuple[int, ...] = (0,)
    """Each variant runs once per seed, as trainer.seed, task.seed and generator.seed."""
    teacher_weight: float = 1.0
    """scorer.teacher.weight of the self-distillation variants."""
    refresh_every_n_steps: int = 4
    """scorer.teacher.refresh_every_n_steps of the self-distillation variants."""
    versions_back: int = 4
    """scorer.teacher.versions_back of the lagged variant."""
    ema_decay: float = 0.5
    """scorer.teacher.ema_decay of the ema variant."""
    target_reward: float = 0.8
    """Reward whose first (smoothed) crossing is counted in steps."""
    collapse_below: float = 0.6
    """A run collapsed when its smoothed reward fell below this after reaching `target_reward`, or
    its final reward is below it (it never learned, or did not recover). On the demo's max_of_two,
    answering one of the two digits blindly earns 0.55 and a fixed answer at most 0.19."""
    out_dir: Path = Path("runs/bench-self-distill")
    """Where the run directories, the JSON figures and the chart go."""

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds ({list(self.seeds)}) must be one or more distinct seeds. Set --seeds.")
        if not 0 < self.collapse_below <= self.target_reward:
            raise ValueError(
                f"collapse_below ({self.collapse_below}) must be in (0, target_reward ({self.target_reward})]. "
                "Set --collapse-below."
            )


def min_after_reaching(rewards: list[float], target: float) -> float | None:
    """The lowest reward, smoothed over SMOOTHING_STEPS steps, after it first reached `target`."""
    first = steps_to(rewards, target)
    if first is None:
        return None
    return min(smoothed(rewards)[first - SMOOTHING_STEPS :])


def run_figures(rewards: list[float], target: float, collapse_below: float) -> dict:
    """One run's figures from its task reward per step (see SelfDistillArgs.collapse_below)."""
    lowest = min_after_reaching(rewards, target)
    final_reward = final(rewards)
    return {
        "final_reward": final_reward,
        "peak_reward": max(smoothed(rewards), default=None),
        "steps_to_target": steps_to(rewards, target),
        "min_after_target": lowest,
        "collapsed": final_reward < collapse_below or (lowest is not None and lowest < collapse_below),
    }


def over_seeds(runs: list[dict]) -> dict:
    """A variant's figures over its runs (run_figures): the mean and the spread (sample standard
    deviation, 0 for one run; the lowest and highest) of the final reward, the mean peak, the
    number of runs that reached the target, their mean steps to it and mean lowest reward after it,
    and the number of collapses. A mean over no values (no run reached the target, or every run
    was shorter than SMOOTHING_STEPS) is None."""
    finals = [r["final_reward"] for r in runs]
    reached = [r for r in runs if r["steps_to_target"] is not None]

    def mean(values: list[float]) -> float | None:
        return statistics.mean(values) if values else None

    return {
        "runs": len(runs),
        **final_reward_spread(finals),
        "peak_reward_mean": mean([r["peak_reward"] for r in runs if r["peak_reward"] is not None]),
        "reached_target": len(reached),
        "steps_to_target_mean": mean([r["steps_to_target"] for r in reached]),
        "min_after_target_mean": mean([r["min_after_target"] for r in reached]),
        "collapses": sum(r["collapsed"] for r in runs),
    }


def variants(base: GRPOConfig, args: SelfDistillArgs) -> dict:
    """The scorer config of each variant: GRPO's own, then one per pin."""
    from forge_rl.scoring.teacher import TeacherConfig

    scorers = {"grpo": base.scorer}
    for pin in PINS:
        teacher = TeacherConfig(
            pin=pin,
            weight=args.teacher_weight,
            refresh_every_n_steps=args.refresh_every_n_steps,
            versions_back=args.versions_back,
            ema_decay=args.ema_decay,
        )
        scorers[f"grpo+{pin}"] = dataclasses.replace(base.scorer, teacher=teacher)
    return scorers


def main(args: SelfDistillArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    base = dataclasses.replace(
        base,
        steps=args.steps,
        trainer=dataclasses.replace(base.trainer, lr=args.lr),
        checkpoint=dataclasses.replace(base.checkpoint, enabled=False),
        task=base.task if args.task is None else dataclasses.replace(base.task, name=args.task),
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    scorers = variants(base, args)
    curves: dict[str, dict[int, list[float]]] = {name: {} for name in scorers}
    runs: dict[str, dict[int, dict]] = {name: {} for name in scorers}
    for seed in args.seeds:
        for name, scorer in scorers.items():
            progress(f"bench self-distill: {name}, seed {seed} ({args.steps} steps, lr {args.lr})")
            run = reuse_or_run_variant(seeded(base, seed), args.out_dir, f"{name}-seed{seed}", scorer=scorer)
            metrics = read_metrics(run)
            curves[name][seed] = rewards = task_rewards(metrics)
            runs[name][seed] = {
                **run_figures(rewards, args.target_reward, args.collapse_below),
                "loop_time_s": metrics[-1][WALL_TIME_S],
            }
    summary: dict = {
        "lr": args.lr,
        "steps": args.steps,
        "seeds": list(args.seeds),
        "target_reward": args.target_reward,
        "collapse_below": args.collapse_below,
    }
    for name in scorers:
        summary[name] = over_seeds(list(runs[name].values()))
        # The stdout line holds no nested values: the figures to compare, flat.
        for key in ("final_reward_mean", "final_reward_stdev", "peak_reward_mean", "steps_to_target_mean", "collapses"):
            summary[f"{key}_{name}"] = summary[name][key]
    summary["runs"] = runs
    plot_per_step_panels(
        {name: {f"seed {seed}": smoothed(c) for seed, c in by_seed.items()} for name, by_seed in curves.items()},
        f"task reward, mean of {SMOOTHING_STEPS} steps",
        args.target_reward,
        args.out_dir / "self_distill_reward.png",
        first_step=SMOOTHING_STEPS,
    )
    (args.out_dir / "self_distill.json").write_text(json.dumps({**summary, "curves": curves}, indent=2) + "\n")
    return summary
