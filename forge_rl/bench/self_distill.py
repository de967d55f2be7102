"""`forge-rl bench self-distill`: GRPO with and without a teacher pinned to the policy's own past.

The same recipe config runs once per variant, same steps and seed: GRPO alone, then GRPO plus
self-distillation (forge_rl/teacher.py `TeacherPin`) with the teacher lagged `versions_back`
versions, an exponential moving average of the versions, and the version after the best step. The
distillation term pulls each token toward what the policy's recent past preferred, a moving trust
region; whether that helps depends on how unstable plain GRPO is, so `--lr` sets the regime (the
demo's 3e-4 learns steadily; at 1e-3, in plain PyTorch GRPO on these tasks, two of three collapsed
to a fixed wrong answer).

Figures: per variant the final task reward (last FINAL_REWARD_WINDOW steps), the trainer steps
until the smoothed reward reaches `target_reward`, the lowest smoothed reward after first reaching
it (a collapse shows there) and the loop time; OUT_DIR/self_distill.json, the last stdout line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.common import SMOOTHING_STEPS, run_variant
from forge_rl.bench.distill import final, steps_to, task_rewards
from forge_rl.config import GRPOConfig
from forge_rl.metrics import WALL_TIME_S, progress
from forge_rl.plot import plot_per_step, read_metrics

PINS = ("lagged", "ema", "best")


@dataclass(frozen=True)
class SelfDistillArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config every variant runs (the demo)."""
    steps: int = 200
    """Trainer steps per variant."""
    lr: float = 1e-3
    """trainer.lr of every variant: the regime (3e-4 steady, 1e-3 unstable on the demo)."""
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
    out_dir: Path = Path("runs/bench-self-distill")
    """Where the run directories, the JSON figures and the chart go."""


def min_after_reaching(rewards: list[float], target: float) -> float | None:
    """The lowest reward, smoothed over SMOOTHING_STEPS steps, after it first reached `target`."""
    first = steps_to(rewards, target)
    if first is None:
        return None
    smoothed = [sum(rewards[i - SMOOTHING_STEPS + 1 : i + 1]) / SMOOTHING_STEPS for i in range(SMOOTHING_STEPS - 1, len(rewards))]
    return min(smoothed[first - SMOOTHING_STEPS :])


def main(args: SelfDistillArgs) -> dict:
    from forge_rl.teacher import TeacherConfig
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    base = dataclasses.replace(
        base, steps=args.steps, trainer=dataclasses.replace(base.trainer, lr=args.lr),
        checkpoint=dataclasses.replace(base.checkpoint, enabled=False),
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = {"grpo": base.scorer}
    for pin in PINS:
        teacher = TeacherConfig(
            pin=pin, weight=args.teacher_weight, refresh_every_n_steps=args.refresh_every_n_steps,
            versions_back=args.versions_back, ema_decay=args.ema_decay,
        )
        variants[f"grpo+{pin}"] = dataclasses.replace(base.scorer, teacher=teacher)
    curves, summary = {}, {"lr": args.lr, "steps": args.steps, "target_reward": args.target_reward}
    for name, scorer in variants.items():
        progress(f"bench self-distill: {name} ({args.steps} steps, lr {args.lr})")
        metrics = read_metrics(run_variant(base, args.out_dir, name, scorer=scorer))
        curves[name] = rewards = task_rewards(metrics)
        summary[name] = {
            "final_reward": final(rewards),
            "steps_to_target": steps_to(rewards, args.target_reward),
            "min_after_target": min_after_reaching(rewards, args.target_reward),
            "loop_time_s": metrics[-1][WALL_TIME_S],
        }
    for name in variants:
        summary[f"final_reward_{name}"] = summary[name]["final_reward"]
    plot_per_step(curves, "task reward (verifier)", args.target_reward, args.out_dir / "self_distill_reward.png")
    (args.out_dir / "self_distill.json").write_text(json.dumps({**summary, "curves": curves}, indent=2) + "\n")
    return summary
