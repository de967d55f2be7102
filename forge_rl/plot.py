"""`forge-rl plot RUN_DIR`: a PNG dashboard of a run's metrics.jsonl."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tyro


@dataclass(frozen=True)
class PlotArgs:
    run_dir: tyro.conf.Positional[Path]
    """Run directory holding metrics.jsonl."""
    out: Path | None = None
    """PNG to write; unset: RUN_DIR/dashboard.png."""


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a run directory written by `forge-rl grpo`.")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_dashboard(args: PlotArgs) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    metrics = read_metrics(args.run_dir)
    wall = [m["wall_time_s"] for m in metrics]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    panels = [
        (axes[0, 0], "mean reward", [("reward/mean", "reward")]),
        (
            axes[0, 1],
            "tokens/s",
            [("throughput/generated_tokens_per_s", "generated"), ("throughput/trained_tokens_per_s", "trained")],
        ),
        (axes[1, 0], "policy age of trained tokens", [("policy_age/mean", "mean"), ("policy_age/max", "max")]),
        (
            axes[1, 1],
            "weight update (s)",
            [("weights/publish_s", "publish"), ("weights/load_s", "generator load"), ("weights/stall_s", "decode stall")],
        ),
        (
            axes[0, 2],
            "idle fraction since start",
            [("idle_fraction/trainer", "trainer"), ("idle_fraction/generators", "generators")],
        ),
        (axes[1, 2], "replay buffer (episodes)", [("buffer/size", "held"), ("buffer/dropped_episodes", "dropped (total)")]),
    ]
    for axis, title, series in panels:
        for key, label in series:
            points = [(t, m[key]) for t, m in zip(wall, metrics) if m.get(key) is not None]
            if points:
                axis.plot(*zip(*points), label=label)
        axis.set_title(title)
        axis.set_xlabel("wall time (s)")
        axis.grid(alpha=0.3)
        if len(series) > 1:
            axis.legend()
    fig.suptitle(str(args.run_dir))
    fig.tight_layout()
    out = args.out or Path(args.run_dir) / "dashboard.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
