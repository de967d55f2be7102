"""`forge-rl bench multi-turn`: a long-tail agentic workload run synchronously and asynchronously.

The same recipe and real engine as `forge-rl bench async-vs-sync` (whose runs, timeline analysis
and charts this reuses), on multi-turn episodes of `forge_rl.envs.long_tail`: Pareto-distributed
turns per episode (most one, some six) and environment latencies (most tens of ms, some two
seconds). Synchronously (max_policy_age 0) every step waits for its slowest episode's whole chain
of turns and tool waits; asynchronously the engine decodes other episodes, of this step and the
next ones, while those wait. Besides the async-vs-sync figures (speedup in wall per step, idle
fractions, pipeline bound) it reports per mode the generators' idle time spent waiting on
environments, turns per episode, environment step latency p50/p99 and the fraction of episodes
that spanned a weight update.

Figures go to OUT_DIR/multi_turn.json, a Gantt chart and a reward-vs-time chart; the last line of
stdout is the JSON summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.async_vs_sync import AsyncVsSyncArgs, run_sync_and_async, write_summary
from forge_rl.observability.metric_names import (
    ENV_STEP_LATENCY_P50_S,
    ENV_STEP_LATENCY_P99_S,
    GENERATORS_IDLE_ON_ENV_FRACTION,
    SPANNED_WEIGHT_UPDATE_FRACTION,
)
from forge_rl.observability.plot import read_metrics


@dataclass(frozen=True)
class MultiTurnArgs(AsyncVsSyncArgs):
    config: Path = Path("configs/bench_multi_turn_cpu.yaml")
    """Recipe config both modes run: an environment with heavy-tailed turns and latencies."""
    out_dir: Path = Path("runs/bench-multi-turn")
    """Where both run directories, the JSON figures and the charts go."""


def environment_figures(run_path: Path) -> dict:
    """Means over the run's steps of what its environment episodes did."""
    metrics = read_metrics(run_path)
    mean = lambda key: sum(m[key] for m in metrics) / len(metrics)  # noqa: E731
    return {
        "generator_idle_waiting_on_env_fraction": metrics[-1][GENERATORS_IDLE_ON_ENV_FRACTION],
        "env_step_latency_p50_s": mean(ENV_STEP_LATENCY_P50_S),
        "env_step_latency_p99_s": mean(ENV_STEP_LATENCY_P99_S),
        "spanned_weight_update_fraction": mean(SPANNED_WEIGHT_UPDATE_FRACTION),
    }


def main(args: MultiTurnArgs) -> dict:
    summary = run_sync_and_async(args, "multi-turn")
    for mode in ("sync", "async"):
        summary[mode].update(environment_figures(args.out_dir / mode))
    summary["generator_idle_waiting_on_env_fraction_sync"] = summary["sync"]["generator_idle_waiting_on_env_fraction"]
    summary["generator_idle_waiting_on_env_fraction_async"] = summary["async"]["generator_idle_waiting_on_env_fraction"]
    summary["mean_turns_per_episode"] = summary["async"]["mean_turns_per_episode"]
    write_summary(summary, args.out_dir / "multi_turn.json", "multi-turn")
    return summary
