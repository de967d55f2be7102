"""`forge-rl bench eval-overhead`: what evaluation beside training costs the training.

One recipe config run several times in one invocation: without evaluation, and with an
evaluation every `every_n_steps` steps (a held-out file of the task's prompts under another seed,
greedy: docs/evaluation.md) on generators of its own (eval.placement own) and on the run's
generators (shared), interleaved (off, own, shared, shared, own, off, ...) so that a drift of the
machine's load falls on every mode alike. The figure is each run's trained tokens per second over
its train loop (the trained tokens of every step / the loop's wall time; the wait for the last
evaluation after the last step is not training time), its median per mode, and per placement:

    ratio_<placement>      with evaluation / without (1.0: evaluation costs training nothing)
    slowdown_<placement>   1 - ratio

Also reported: the evaluations each run made and their mean seconds, and each run's final reward.
Figures go to OUT_DIR/eval_overhead.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from forge_rl.bench.common import run_variant
from forge_rl.config import GRPOConfig
from forge_rl.data.config import DataConfig
from forge_rl.data.rows import export_rows
from forge_rl.errors import ConfigError
from forge_rl.evaluation.config import EvalConfig, EvalSetConfig
from forge_rl.observability.metric_names import TRAINED_TOKENS, WALL_TIME_S
from forge_rl.observability.metrics import final_reward, progress
from forge_rl.observability.plot import read_metrics
from forge_rl.pipeline.prompts import TaskRows


@dataclass(frozen=True)
class EvalOverheadArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config every run uses (its checkpoints turned off)."""
    steps: int = 100
    """Trainer steps per run."""
    every_n_steps: int = 10
    """Evaluate every this many steps in the runs with evaluation (and at the start and the end)."""
    eval_prompts: int = 64
    """Prompts of the held-out set: the task's, under seed + 1."""
    repeats: int = 2
    """Runs of each mode, interleaved off, own, shared, shared, own, off, ..."""
    placements: tuple[str, ...] = ("own", "shared")
    """The eval.placement of the runs with evaluation (own, shared or both)."""
    out_dir: Path = Path("runs/bench-eval-overhead")
    """Where the run directories, the held-out file and the JSON figures go."""


def main(args: EvalOverheadArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    if not args.placements or set(args.placements) - {"own", "shared"}:
        raise ConfigError(f"bench eval-overhead: --placements ({list(args.placements)}) must name own, shared or both.")
    if args.steps < args.every_n_steps or args.every_n_steps < 1 or args.repeats < 1 or args.eval_prompts < 1:
        raise ConfigError(
            f"bench eval-overhead: --steps ({args.steps}) must reach --every-n-steps ({args.every_n_steps}) >= 1, and "
            f"--repeats ({args.repeats}) and --eval-prompts ({args.eval_prompts}) must be >= 1."
        )
    base = load_yaml_config(GRPOConfig, args.config)
    if base.data is not None or base.environment.name is not None:
        raise ConfigError(
            f"bench eval-overhead: {args.config} trains on data.path or an environment; it needs a task config "
            "(configs/grpo_tiny_cpu.yaml), whose prompts under another seed make its held-out set."
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    held_out = args.out_dir / "held_out.jsonl"
    written = export_rows(
        TaskRows(dataclasses.replace(base.task, seed=base.task.seed + 1)), held_out, args.eval_prompts, unique=True
    )
    evaluation = EvalConfig(
        sets=(EvalSetConfig("held_out", DataConfig(str(held_out), answer_column="answer"), max_prompts=written),),
        every_n_steps=args.every_n_steps,
    )
    base = dataclasses.replace(base, steps=args.steps, checkpoint=dataclasses.replace(base.checkpoint, enabled=False))
    modes = ("off", *args.placements)
    order = interleaved(modes, args.repeats)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i, mode in enumerate(order):
        progress(f"bench eval-overhead: run {i + 1}/{len(order)}, evaluation {mode}")
        placed = cast(Literal["own", "shared"], mode)  # args.placements are checked above
        changes = {"eval": dataclasses.replace(evaluation, placement=placed)} if mode != "off" else {}
        runs[mode].append(analyze(run_variant(base, args.out_dir, f"{mode}-{i}", **changes)))
    tokens_per_s = {mode: statistics.median(r["trained_tokens_per_s"] for r in runs[mode]) for mode in modes}
    summary = {
        "bench": "eval-overhead",
        "config": str(args.config),
        "steps": args.steps,
        "every_n_steps": args.every_n_steps,
        "eval_prompts": written,
        "repeats": args.repeats,
        "trained_tokens_per_s_without_eval": tokens_per_s["off"],
    }
    for placement in args.placements:
        ratio = tokens_per_s[placement] / tokens_per_s["off"]
        summary |= {
            f"trained_tokens_per_s_{placement}": tokens_per_s[placement],
            f"ratio_{placement}": ratio,
            f"slowdown_{placement}": 1 - ratio,
            f"evaluations_{placement}": statistics.median(r["evaluations"] for r in runs[placement]),
            f"eval_failed_{placement}": max(r["eval_failed"] or 0 for r in runs[placement]),
        }
    summary["runs"] = runs
    (args.out_dir / "eval_overhead.json").write_text(json.dumps(summary, indent=2))
    return summary


def interleaved(modes: tuple[str, ...], repeats: int) -> list[str]:
    """`repeats` runs of each mode, every other round reversed: ("off", "own"), 2 -> off, own, own, off."""
    return [mode for i in range(repeats) for mode in (modes if i % 2 == 0 else modes[::-1])]


def analyze(run_path: Path) -> dict:
    """A run's trained tokens per second over its train loop, its evaluations, its final reward."""
    metrics = read_metrics(run_path)
    loop_time_s = metrics[-1][WALL_TIME_S]
    evaluations = []
    if (run_path / "eval.jsonl").is_file():
        evaluations = [json.loads(line) for line in (run_path / "eval.jsonl").read_text().splitlines() if line.strip()]
    counts = json.loads((run_path / "summary.json").read_text()).get("evaluations", {})
    return {
        "run": str(run_path),
        "trained_tokens_per_s": sum(m[TRAINED_TOKENS] for m in metrics) / loop_time_s,
        "loop_time_s": loop_time_s,
        "final_mean_reward": final_reward(metrics),
        "evaluations": counts.get("evaluated", 0),
        "eval_failed": counts.get("failed", 0),
        "eval_seconds_mean": statistics.mean(e["eval/seconds"] for e in evaluations) if evaluations else None,
        "final_eval_pass@1": evaluations[-1].get("eval/held_out/pass@1") if evaluations else None,
    }
