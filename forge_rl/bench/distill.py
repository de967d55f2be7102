"""`forge-rl bench distill`: on-policy distillation of a trained teacher into a fresh student,
side by side with GRPO from scratch on the same student, for the same number of trainer steps.

1. teacher   the demo recipe (configs/grpo_tiny_cpu.yaml) trains the tiny model from scratch, and
             its newest checkpoint is exported as an HF directory (`forge_rl.run.export`); or
             `--teacher-run RUN_DIR` reuses a trained run
2. distill   the same recipe from a fresh student (the config's from-scratch model), the task
             reward's weight 0 and the teacher's per-token reverse KL as the only signal
             (`forge_rl.scoring.teacher`): every token's advantage is teacher - student logprob
3. grpo      the same recipe from the same fresh student, the task reward alone

Both student curves are the task's reward (the verifier, which the distillation run still runs and
logs as `reward/components/reward_fn` without training on it), so they measure the same thing. The
summary gives each run's final reward (mean of the last FINAL_REWARD_WINDOW steps), the distilled
student's over the teacher's, and the trainer steps each student took for its smoothed reward to
reach `threshold` times the teacher's: `steps_vs_grpo` is distillation's over GRPO's (< 1: fewer).

Figures go to OUT_DIR/distill.json and a reward-vs-step chart; the last stdout line is the JSON
summary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.common import run_variant, steps_to
from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import REWARD_COMPONENTS, REWARD_MEAN, WALL_TIME_S
from forge_rl.observability.metrics import FINAL_REWARD_WINDOW, progress
from forge_rl.observability.plot import plot_per_step, read_metrics

TASK_REWARD_OF_DISTILLATION = f"{REWARD_COMPONENTS}/reward_fn"
"""The verifier's reward in a run whose reward is a weighted sum (`forge_rl.scoring.scorers.WeightedSum`)."""


@dataclass(frozen=True)
class DistillArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config of the teacher's training and of both student runs (the demo)."""
    teacher_run: Path | None = None
    """A trained run directory to take the teacher from (its newest checkpoint, its final reward);
    unset: train one with `config` for `teacher_steps` steps."""
    teacher_steps: int = 300
    """Trainer steps of the teacher's training run."""
    steps: int = 300
    """Trainer steps of each student run (distillation, GRPO); the teacher's by default, which is
    about when GRPO reaches 0.9 of the teacher's reward on the demo."""
    teacher_weight: float = 1.0
    """scorer.teacher.weight of the distillation run (coefficient of the reverse KL)."""
    threshold: float = 0.9
    """Steps-to-threshold are read where a student's smoothed task reward first reaches this
    fraction of the teacher's final reward."""
    out_dir: Path = Path("runs/bench-distill")
    """Where the run directories, the teacher's model, the JSON figures and the chart go."""

    def __post_init__(self) -> None:
        for name in ("teacher_steps", "steps"):
            if getattr(self, name) < FINAL_REWARD_WINDOW:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be >= {FINAL_REWARD_WINDOW}. Set --{name.replace('_', '-')}."
                )
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold ({self.threshold}) must be in (0, 1]. Set --threshold.")


def task_rewards(metrics: list[dict]) -> list[float]:
    """The task's reward per step: the verifier's component where the reward is a weighted sum
    (the distillation run), else the reward itself."""
    return [m.get(TASK_REWARD_OF_DISTILLATION, m[REWARD_MEAN]) for m in metrics]


def final(rewards: list[float]) -> float:
    """Mean of the last FINAL_REWARD_WINDOW steps (metrics.final_reward's window)."""
    tail = rewards[-FINAL_REWARD_WINDOW:]
    return sum(tail) / len(tail)


def compare(teacher: list[float], distill: list[float], grpo: list[float], threshold: float) -> dict:
    """The benchmark's figures from the three task-reward curves (one value per trainer step)."""
    teacher_final = final(teacher)
    target = threshold * teacher_final
    distill_steps, grpo_steps = steps_to(distill, target), steps_to(grpo, target)
    # GRPO that never got there took more than the run's steps: the ratio is then an upper bound.
    ratio = None if distill_steps is None else distill_steps / (grpo_steps or len(grpo))
    return {
        "teacher_final_reward": teacher_final,
        "distill_final_reward": final(distill),
        "grpo_final_reward": final(grpo),
        "student_reward_vs_teacher": final(distill) / teacher_final,
        "grpo_reward_vs_teacher": final(grpo) / teacher_final,
        "target_reward": target,
        "distill_steps_to_target": distill_steps,
        "grpo_steps_to_target": grpo_steps,
        "steps_vs_grpo": ratio,
        "steps_vs_grpo_is_upper_bound": ratio is not None and grpo_steps is None,
    }


def train_teacher(base: GRPOConfig, args: DistillArgs) -> tuple[Path, Path]:
    """(the teacher's run directory, its exported model directory)."""
    from forge_rl.run.export import export_run

    run_path = args.teacher_run
    if run_path is None:
        progress(f"bench distill: training the teacher ({args.teacher_steps} steps of {args.config})")
        checkpoint = dataclasses.replace(base.checkpoint, enabled=True, every_n_steps=args.teacher_steps)
        run_path = run_variant(base, args.out_dir, "teacher", steps=args.teacher_steps, checkpoint=checkpoint)
    model_dir = args.out_dir / "teacher-model"
    if not model_dir.exists():
        export_run(run_path, model_dir)
    return run_path, model_dir


def run_students(base: GRPOConfig, args: DistillArgs, teacher_model: Path) -> dict[str, Path]:
    from forge_rl.scoring.teacher import TeacherConfig

    no_checkpoints = dataclasses.replace(base.checkpoint, enabled=False)
    teacher = TeacherConfig(path=teacher_model, weight=args.teacher_weight)
    progress(f"bench distill: distilling into a fresh student ({args.steps} steps)")
    distill = run_variant(
        base,
        args.out_dir,
        "distill",
        steps=args.steps,
        checkpoint=no_checkpoints,
        scorer=dataclasses.replace(base.scorer, reward_fn_weight=0.0, teacher=teacher),
    )
    progress(f"bench distill: GRPO from scratch on the same student ({args.steps} steps)")
    grpo = run_variant(base, args.out_dir, "grpo", steps=args.steps, checkpoint=no_checkpoints)
    return {"distill": distill, "grpo": grpo}


def main(args: DistillArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    teacher_run, teacher_model = train_teacher(base, args)
    students = run_students(base, args, teacher_model)
    metrics = {"teacher": read_metrics(teacher_run), **{name: read_metrics(path) for name, path in students.items()}}
    curves = {name: task_rewards(m) for name, m in metrics.items()}
    summary = compare(curves["teacher"], curves["distill"], curves["grpo"], args.threshold)
    summary.update(
        steps=args.steps,
        teacher_steps=len(curves["teacher"]),
        distill_loop_time_s=metrics["distill"][-1][WALL_TIME_S],
        grpo_loop_time_s=metrics["grpo"][-1][WALL_TIME_S],
        distill_reverse_kl_first=metrics["distill"][0].get(f"{REWARD_COMPONENTS}/teacher/reverse_kl"),
        distill_reverse_kl_final=final([m[f"{REWARD_COMPONENTS}/teacher/reverse_kl"] for m in metrics["distill"]]),
        teacher_model=str(teacher_model),
        curves=curves,
    )
    labels = {"teacher": "teacher (its training)", "distill": "student, distilled", "grpo": "student, GRPO"}
    plot_per_step(
        {labels[name]: c for name, c in curves.items()},
        "task reward (verifier)",
        summary["target_reward"],
        args.out_dir / "distill_reward.png",
    )
    (args.out_dir / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
