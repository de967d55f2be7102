"""`forge-rl bench async-vs-sync`: one recipe run twice, synchronous and asynchronous.

Both runs use the same config, processes and engine settings; only `buffer.max_policy_age`
differs (0: generate, train, publish, swap, repeat; A > 0: generation runs up to A versions ahead).
From each run's timeline (busy intervals per component) it derives:

    wall per step          loop time / steps (engine start excluded, the first fill included)
    idle fraction          1 - busy time / loop time, per component
    pipeline bound         max(generator busy, trainer busy): the loop time a perfect overlap needs
    pipeline efficiency    pipeline bound / loop time
    overlap bound          (G + T) / max(G, T) with G, T the synchronous busy times: the speedup
                           overlap alone could give; stragglers can add to it, because a
                           synchronous step also waits for its slowest completion

With `--pin-cores` both modes run a second time with the roles pinned apart
(launch.placement.generator_cpus / trainer_cpus: the generator and its engine processes on one
core, the trainer on another), into OUT_DIR/pinned, and the summary holds both comparisons
(`speedup`, unpinned; `speedup_pinned`; `pinned` the whole pinned comparison). On a 2-core
machine unpinned processes migrate and share both cores; pinned, each side owns one.

Figures go to OUT_DIR/async_vs_sync.json, a Gantt chart and a reward-vs-time chart; the last line
of stdout is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.common import run_variant, time_to_reward
from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.observability.metric_names import GENERATED_TOKENS_TOTAL, TRAINED_TOKENS, WALL_TIME_S
from forge_rl.observability.metrics import run_summary
from forge_rl.observability.plot import headless_pyplot, plot_reward_curves, read_metrics, save_figure
from forge_rl.observability.timeline import Timeline, busy_s, mean_sequences_in_flight, merged


@dataclass(frozen=True)
class AsyncVsSyncArgs:
    config: Path = Path("configs/bench_long_tail_cpu.yaml")
    """Recipe config both modes run. configs/grpo_tiny_cpu.yaml compares reward vs time on the demo."""
    max_policy_age: int = 2
    """Staleness bound of the asynchronous run (the synchronous run uses 0)."""
    steps: int | None = None
    """Trainer steps per run; unset: the config's."""
    out_dir: Path = Path("runs/bench-async-vs-sync")
    """Where both run directories, the JSON figures and the charts go."""
    target_reward: float = 0.9
    """Reward whose first crossing (smoothed) is timed in both runs."""
    pin_cores: bool = False
    """Also run both modes with the generator's processes pinned to one core and the trainer to
    another (the first two cores this process may use), and report both comparisons."""


def run_mode(base: GRPOConfig, args: AsyncVsSyncArgs, mode: str, max_policy_age: int) -> Path:
    return run_variant(
        base,
        args.out_dir,
        mode,
        steps=args.steps or base.steps,
        buffer=dataclasses.replace(base.buffer, max_policy_age=max_policy_age),
    )


def analyze(run_path: Path, num_generators: int, target_reward: float) -> dict:
    """The run's own summary (metrics.run_summary: final reward, idle fractions, ...) plus what
    this benchmark reads from its timeline: busy times and the pipeline bound."""
    metrics = read_metrics(run_path)
    summary = run_summary(metrics)
    intervals = Timeline.load(run_path / "timeline.jsonl")
    loop_s = summary["loop_time_s"]
    # The busiest generator bounds the pipeline.
    generator_busy = max(busy_s(intervals, f"generator{i}", 0.0, loop_s) for i in range(num_generators))
    trainer_busy = busy_s(intervals, "trainer", 0.0, loop_s)
    bound = max(generator_busy, trainer_busy)
    return {
        **summary,
        "steps": len(metrics),
        "wall_per_step_s": loop_s / len(metrics),
        "generator_busy_s": generator_busy,
        "trainer_busy_s": trainer_busy,
        "pipeline_bound_s": bound,
        "pipeline_efficiency": bound / loop_s,
        "generated_tokens_per_s": metrics[-1][GENERATED_TOKENS_TOTAL] / loop_s,
        "trained_tokens_per_s": sum(m[TRAINED_TOKENS] for m in metrics) / loop_s,
        "mean_sequences_in_flight": mean_sequences_in_flight(intervals, "generator0", 0.0, loop_s),
        "time_to_target_reward_s": time_to_reward(metrics, target_reward),
    }


def compare(sync: dict, asynchronous: dict) -> dict:
    overlap_bound = (sync["generator_busy_s"] + sync["trainer_busy_s"]) / max(
        sync["generator_busy_s"], sync["trainer_busy_s"]
    )
    times = (sync["time_to_target_reward_s"], asynchronous["time_to_target_reward_s"])
    speedup = sync["wall_per_step_s"] / asynchronous["wall_per_step_s"]
    return {
        "speedup": speedup,
        "warnings": caveats(speedup, overlap_bound, min(sync["steps"], asynchronous["steps"])),
        "pipeline_efficiency": asynchronous["pipeline_efficiency"],
        "trainer_idle_fraction_async": asynchronous["trainer_idle_fraction"],
        "generator_idle_fraction_async": asynchronous["generator_idle_fraction"],
        "trainer_idle_fraction_sync": sync["trainer_idle_fraction"],
        "generator_idle_fraction_sync": sync["generator_idle_fraction"],
        "overlap_bound": overlap_bound,
        "time_to_target_ratio": times[0] / times[1] if None not in times else None,
    }


MIN_STEADY_STEPS = 30
"""Fewer steps than this and the first fill (in wall per step) and a few stragglers weigh enough to
move the speedup by tens of percent: a short run can report a speedup far above the overlap bound."""


def caveats(speedup: float, overlap_bound: float, steps: int) -> list[str]:
    """What makes this comparison's speedup not a steady-state figure, in words for the reader."""
    found = []
    if steps < MIN_STEADY_STEPS:
        found.append(
            f"only {steps} steps per run: the first fill and stragglers dominate wall per step; "
            f"pass --steps {MIN_STEADY_STEPS} or more for a steady-state speedup"
        )
    if speedup > 1.1 * overlap_bound:
        found.append(
            f"speedup {speedup:.2f} exceeds the overlap bound {overlap_bound:.2f}: the synchronous run "
            "waited on stragglers (or on its first fill) more than the asynchronous one; check the "
            "Gantt chart and run more steps before quoting it"
        )
    return found


def plot_gantt(runs: dict[str, Path], out: Path, num_steps_shown: int = 6) -> None:
    """Busy intervals of each component over a few steady-state steps of each run."""
    plt = headless_pyplot()

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.2 * len(runs)), squeeze=False)
    for axis, (mode, run_path) in zip(axes[:, 0], runs.items()):
        metrics, intervals = read_metrics(run_path), Timeline.load(run_path / "timeline.jsonl")
        middle = len(metrics) // 2
        start = metrics[middle - 1][WALL_TIME_S]
        end = metrics[min(middle + num_steps_shown, len(metrics)) - 1][WALL_TIME_S]
        components = sorted({i.component for i in intervals}, key=_component_order)
        for row, component in enumerate(components):
            own = [i for i in intervals if i.component == component]
            spans = [(s, e - s) for s, e in merged(own, start, end)]
            axis.broken_barh(spans, (row - 0.4, 0.8), color=f"C{row}")
        axis.set_yticks(range(len(components)), components)
        axis.set_xlim(start, end)
        axis.set_title(f"{mode}: {num_steps_shown} steps from step {middle}")
        axis.set_xlabel("seconds since the loops started")
    save_figure(fig, out)


def _component_order(component: str) -> tuple[int, str]:
    order = ("generator", "scorer", "trainer", "weights")
    return next((i for i, prefix in enumerate(order) if component.startswith(prefix)), len(order)), component


def plot_reward(runs: dict[str, Path], out: Path) -> None:
    plt = headless_pyplot()

    fig, axis = plt.subplots(figsize=(7, 4))
    plot_reward_curves(axis, runs)
    axis.legend()
    save_figure(fig, out)


def main(args: AsyncVsSyncArgs) -> dict:
    summary = run_sync_and_async(args, "async-vs-sync")
    write_summary(summary, args.out_dir / "async_vs_sync.json", "async-vs-sync")
    return summary


def run_sync_and_async(args: AsyncVsSyncArgs, bench_name: str) -> dict:
    """Run `args.config` synchronously (max_policy_age 0) then asynchronously (args.max_policy_age)
    into args.out_dir, chart both, and compare them (the multi-turn benchmark reuses this on its
    own workload); with args.pin_cores, again pinned apart into args.out_dir / "pinned"."""
    from forge_rl.observability.metrics import progress
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    pinned_base = pinned_apart(base) if args.pin_cores else None  # refused before any run starts
    summary = compare_modes(base, args, bench_name)
    if pinned_base is not None:
        progress(f"bench {bench_name}: both modes again, the generator and the trainer pinned to cores of their own")
        pinned = compare_modes(pinned_base, dataclasses.replace(args, out_dir=args.out_dir / "pinned"), bench_name)
        summary.update(
            speedup_pinned=pinned["speedup"],
            pipeline_efficiency_pinned=pinned["pipeline_efficiency"],
            warnings=summary["warnings"] + [f"pinned: {warning}" for warning in pinned["warnings"]],
            pinned=pinned,
        )
    return summary


def pinned_apart(base: GRPOConfig) -> GRPOConfig:
    """`base` with its generators (and their engine processes) on the first core this process may
    use and its trainer ranks on the second."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ConfigError(
            f"--pin-cores needs two cores to pin the generator and the trainer apart; this process "
            f"may use {len(cores)} ({cores}). Drop --pin-cores."
        )
    placement = dataclasses.replace(base.launch.placement, generator_cpus=(cores[0],), trainer_cpus=(cores[1],))
    return dataclasses.replace(base, launch=dataclasses.replace(base.launch, placement=placement))


def compare_modes(base: GRPOConfig, args: AsyncVsSyncArgs, bench_name: str) -> dict:
    """Run `base` synchronously then asynchronously into args.out_dir, chart both, compare them."""
    from forge_rl.observability.metrics import progress

    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for mode, max_policy_age in (("sync", 0), ("async", args.max_policy_age)):
        progress(f"bench {bench_name}: {mode} run (max_policy_age={max_policy_age})")
        runs[mode] = run_mode(base, args, mode, max_policy_age)
    per_mode = {mode: analyze(path, base.num_generators, args.target_reward) for mode, path in runs.items()}
    plot_gantt(runs, args.out_dir / "timeline.png")
    plot_reward(runs, args.out_dir / "reward_vs_time.png")
    return {
        **compare(per_mode["sync"], per_mode["async"]),
        "config": str(args.config),
        "placement": {
            "generator_cpus": base.launch.placement.generator_cpus,
            "trainer_cpus": base.launch.placement.trainer_cpus,
        },
        "max_policy_age_async": args.max_policy_age,
        "sync": per_mode["sync"],
        "async": per_mode["async"],
    }


def write_summary(summary: dict, path: Path, bench_name: str) -> None:
    from forge_rl.observability.metrics import progress

    path.write_text(json.dumps(summary, indent=2))
    for warning in summary["warnings"]:
        progress(f"WARNING bench {bench_name}: {warning}")
