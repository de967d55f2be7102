"""`forge-rl bench sampling-support`: importance ratios under top-p, with and without the kept sets.

With top-p (or top-k) sampling the generator draws each token from the renormalized kept set, so
its behaviour logprob is higher than the full-vocabulary softmax the trainer computes by default:
every ratio pi/b comes out below 1 by the mass top-p cut off, and the off-policy corrections then
act on a bias, not on staleness. forge_rl records each token's kept set (vLLM's sampling mask,
`generator.record_sampling_support`) and the trainer renormalizes over it
(`forge_rl.core.batching.token_logprobs`).

Runs the recipe twice with the same seeds at `generator.top_p`, synchronously (max_policy_age 0,
so staleness adds nothing to the ratio): kept sets off, then on. Reports the token-mean
importance ratio (`loss/mean_ratio`) and mismatch KL averaged over the steps, at step 1 (same
weights on both sides) and the final reward. Figures go to OUT_DIR/sampling_support.json and .png;
the last stdout line is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.common import run_variant
from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import MISMATCH_KL
from forge_rl.observability.metrics import final_reward
from forge_rl.observability.plot import plot_per_step, read_metrics

_VARIANTS = {"full_vocabulary": False, "kept_set": True}
"""Run name -> generator.record_sampling_support."""


@dataclass(frozen=True)
class SamplingSupportArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config both runs use (top_p, the staleness bound and the steps are set here)."""
    top_p: float = 0.8
    """Nucleus mass of the generator in both runs."""
    steps: int = 60
    """Trainer steps per run."""
    out_dir: Path = Path("runs/bench-sampling-support")
    """Where the two run directories, sampling_support.json and sampling_support.png go."""


def summarize(run_path: Path) -> dict:
    metrics = read_metrics(run_path)
    return {
        "mean_ratio": sum(m["loss/mean_ratio"] for m in metrics) / len(metrics),
        "mean_ratio_step1": metrics[0]["loss/mean_ratio"],
        "mismatch_kl": sum(m[MISMATCH_KL] for m in metrics) / len(metrics),
        "mismatch_kl_step1": metrics[0][MISMATCH_KL],
        "final_reward": final_reward(metrics),
    }


def plot(runs: dict[str, Path], out: Path) -> None:
    curves = {name: [m["loss/mean_ratio"] for m in read_metrics(path)] for name, path in runs.items()}
    plot_per_step(curves, "mean importance ratio pi / behaviour", 1.0, out)


def main(args: SamplingSupportArgs) -> dict:
    from forge_rl.observability.metrics import progress
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, record in _VARIANTS.items():
        progress(f"bench sampling-support: top_p={args.top_p}, {name}")
        runs[name] = run_variant(
            base,
            args.out_dir,
            name,
            steps=args.steps,
            generator=dataclasses.replace(base.generator, top_p=args.top_p, record_sampling_support=record),
            buffer=dataclasses.replace(base.buffer, max_policy_age=0),
        )
    per_run = {name: summarize(path) for name, path in runs.items()}
    plot(runs, args.out_dir / "sampling_support.png")
    print(f"top_p={args.top_p}, {args.steps} synchronous steps of {args.config}")
    print(f"{'trainer normalizes over':<24}{'mean ratio':>12}{'at step 1':>12}{'mismatch KL':>14}{'final reward':>14}")
    for name, s in per_run.items():
        print(
            f"{name:<24}{s['mean_ratio']:>12.4f}{s['mean_ratio_step1']:>12.4f}"
            f"{s['mismatch_kl']:>14.2e}{s['final_reward']:>14.3f}"
        )
    summary = {
        "top_p": args.top_p,
        "mean_ratio_full_vocabulary": per_run["full_vocabulary"]["mean_ratio"],
        "mean_ratio_kept_set": per_run["kept_set"]["mean_ratio"],
        "runs": per_run,
    }
    (args.out_dir / "sampling_support.json").write_text(json.dumps(summary, indent=2))
    return summary
