"""`forge-rl plot RUN_DIR`: a PNG dashboard of a run's metrics.jsonl and timeline.jsonl. Works on a
live run too: it reads whatever steps and intervals are logged so far.

    reward               | tokens/s (generated, trained) | policy-age histogram (all steps)
    policy age over time | weight publish / load times    | replay buffer occupancy vs capacity
    idle per component   | faults (errored, skipped)      | loss and gradient norm
"""

from __future__ import annotations

import collections
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import tyro
import yaml

from forge_rl.observability.sinks import policy_age_counts
from forge_rl.observability.timeline import Timeline, busy_s


@dataclass(frozen=True)
class PlotArgs:
    run_dir: tyro.conf.Positional[Path]
    """Run directory holding metrics.jsonl."""
    out: Path | None = None
    """PNG to write; unset: RUN_DIR/dashboard.png."""


def headless_pyplot():
    """matplotlib's pyplot drawing to files only (the Agg backend): no display on servers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_per_step(curves: dict[str, list[float]], ylabel: str, reference: float, out: Path) -> None:
    """One line per named curve (a value per trainer step, from step 1) and a dashed horizontal
    line at `reference`, written to `out` (PNG)."""
    plt = headless_pyplot()
    fig, axis = plt.subplots(figsize=(7, 4))
    for name, values in curves.items():
        axis.plot(range(1, len(values) + 1), values, label=name, lw=1)
    axis.axhline(reference, color="gray", ls="--", lw=0.8)
    axis.set_xlabel("step")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(fig, out)


def plot_per_step_panels(
    panels: dict[str, dict[str, list[float]]], ylabel: str, reference: float, out: Path, first_step: int = 1
) -> None:
    """A panel per name (side by side, sharing the y axis), each with one line per named curve (a
    value per trainer step from `first_step`) and a dashed line at `reference`; written to `out`."""
    plt = headless_pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.5 * len(panels), 3.5), sharey=True, squeeze=False)
    for axis, (title, curves) in zip(axes[0], panels.items()):
        for name, values in curves.items():
            axis.plot(range(first_step, first_step + len(values)), values, label=name, lw=1)
        axis.axhline(reference, color="gray", ls="--", lw=0.8)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    axes[0, 0].set_ylabel(ylabel)
    save_figure(fig, out)


def save_figure(fig, out: Path) -> None:
    """Lay out `fig`, write it to `out` (PNG) and free it (pyplot keeps open figures alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_reward_curves(axis, runs: dict[str, Path]) -> None:
    """Mean reward vs seconds since the loops started, one line per run directory."""
    for name, run_path in runs.items():
        metrics = read_metrics(run_path)
        axis.plot([m["wall_time_s"] for m in metrics], [m["reward/mean"] for m in metrics], label=name, lw=1)
    axis.set_xlabel("seconds since the loops started")
    axis.set_ylabel("mean reward")
    axis.grid(alpha=0.3)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a run directory written by `forge-rl grpo`.")
    metrics = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not metrics:
        raise ValueError(f"{path} has no steps yet: plot again once the run has trained a step.")
    return metrics


def plot_dashboard(args: PlotArgs) -> Path:
    plt = headless_pyplot()

    run_dir = Path(args.run_dir)
    metrics = read_metrics(run_dir)
    fig, axes = plt.subplots(3, 3, figsize=(16, 11))
    lines = functools.partial(_lines, metrics=metrics)
    lines(axes[0, 0], "mean reward", [("reward/mean", "reward")])
    _evaluations(axes[0, 0], run_dir, metrics)
    lines(
        axes[0, 1],
        "tokens/s",
        [("throughput/generated_tokens_per_s", "generated"), ("throughput/trained_tokens_per_s", "trained")],
    )
    _policy_age_histogram(axes[0, 2], metrics)
    lines(axes[1, 0], "policy age of trained tokens", [("policy_age/mean", "mean"), ("policy_age/max", "max")])
    # Every weights/*_s timing the trainer's publish and the generators' loads report.
    weight_timings = sorted({k for m in metrics for k in m if k.startswith("weights/") and k.endswith("_s")})
    lines(axes[1, 1], "weight publish and load (s)", [(k, k.removeprefix("weights/")) for k in weight_timings])
    lines(
        axes[1, 2],
        "replay buffer (episodes)",
        [("buffer/size", "held"), ("buffer/dropped_episodes", "dropped (total)")],
    )
    capacity = _config(run_dir).get("buffer", {}).get("capacity_episodes")
    if capacity:
        axes[1, 2].axhline(capacity, color="grey", linestyle="--", label=f"capacity ({capacity})")
        axes[1, 2].legend(fontsize="small")
    _idle_fractions(axes[2, 0], run_dir, metrics)
    _faults(axes[2, 1], metrics)
    lines(axes[2, 2], "loss and gradient norm", [("loss", "loss"), ("grad_norm", "grad norm (before clip)")])
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    fig.suptitle(f"{run_dir} ({len(metrics)} steps)")
    out = args.out or run_dir / "dashboard.png"
    save_figure(fig, out)
    return out


def _evaluations(axis, run_dir: Path, metrics: list[dict]) -> None:
    """Each eval set's pass@k (RUN_DIR/eval.jsonl) at the wall time of the step whose version it
    evaluated (step 0: the start), beside the training reward."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    wall_time = {0: 0.0} | {m["step"]: m["wall_time_s"] for m in metrics if "wall_time_s" in m}
    keys = sorted({k for r in records for k in r if k.startswith("eval/") and "/pass@" in k})
    for key in keys:
        points = [(wall_time[r["step"]], r[key]) for r in records if key in r and r["step"] in wall_time]
        if points:
            axis.plot(*zip(*points), marker="o", label=key.removeprefix("eval/"))
    if keys:
        axis.legend(fontsize="small")


def _lines(axis, title: str, series: list[tuple[str, str]], metrics: list[dict]) -> None:
    """One line per (metric key, label) over wall time, skipping steps that lack the key."""
    for key, label in series:
        points = [(m["wall_time_s"], m[key]) for m in metrics if m.get(key) is not None]
        if points:
            axis.plot(*zip(*points), label=label)
    axis.set_title(title)
    axis.set_xlabel("wall time (s)")
    if len(series) > 1:
        axis.legend(fontsize="small")


def _config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _policy_age_histogram(axis, metrics: list[dict]) -> None:
    """Trained tokens by policy age, summed over every step: how off-policy the training was."""
    totals: collections.Counter = collections.Counter()
    for m in metrics:
        totals.update(dict(zip(*policy_age_counts(m))))
    ages = sorted(totals)
    axis.bar([str(a) for a in ages], [totals[a] for a in ages])
    axis.set_title("policy age of trained tokens (all steps)")
    axis.set_xlabel("policy age (trainer version - token version)")
    axis.set_ylabel("tokens")


def _idle_fractions(axis, run_dir: Path, metrics: list[dict]) -> None:
    """Per component from timeline.jsonl; before the run's
    first interval ends, the controller's running idle fractions from metrics.jsonl."""
    timeline_path = run_dir / "timeline.jsonl"
    if not timeline_path.is_file():
        keys = sorted({k for m in metrics for k in m if k.startswith("idle_fraction/")})
        _lines(axis, "idle fraction since start", [(k, k.removeprefix("idle_fraction/")) for k in keys], metrics)
        return
    intervals = Timeline.load(timeline_path)
    end_s = max((i.end_s for i in intervals), default=0.0)
    components = sorted({i.component for i in intervals})
    idle = [1.0 - busy_s(intervals, c, 0.0, end_s) / max(end_s, 1e-9) for c in components]
    axis.barh(components, idle)
    axis.set_xlim(0, 1)
    axis.set_title(f"idle fraction per component ({end_s:.0f} s)")
    axis.set_xlabel("idle fraction")


def _faults(axis, metrics: list[dict]) -> None:
    """Running totals of what went wrong: errored completions and skipped steps (per-step counts,
    summed here), reward timeouts and worker restarts, and any `faults/*` counter (already totals)."""
    wall = [m["wall_time_s"] for m in metrics]
    running = {"errored completions": "completions/errored", "skipped steps": "step_skipped"}
    for label, key in running.items():
        running_total, total = [], 0
        for m in metrics:
            total += m.get(key, 0)
            running_total.append(total)
        axis.plot(wall, running_total, label=label)
    totals = {"scorer/timed_out": "reward timeouts", "scorer/worker_restarts": "reward worker restarts"}
    totals.update({k: k.removeprefix("faults/") for m in metrics for k in m if k.startswith("faults/")})
    for key, label in sorted(totals.items()):
        if any(key in m for m in metrics):
            axis.plot(wall, [m.get(key, 0) for m in metrics], label=label)
    axis.set_title("faults (running totals)")
    axis.set_xlabel("wall time (s)")
    axis.legend(fontsize="small")
