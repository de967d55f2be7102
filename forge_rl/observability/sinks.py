"""Where a run's metrics go: metrics.jsonl, one JSON object per trainer step (the record of a run:
`forge-rl plot` reads it), and the optional TensorBoard and W&B sinks (`log.tensorboard`,
`log.wandb`), which get the same numbers: every numeric value as a scalar (a list of numbers, such
as the generators' policy versions, as one scalar per index: `generator/policy_versions/0`), and
the policy-age histogram as a histogram. A sink that fails is reported once and dropped; it never
stops a run."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

from forge_rl.observability.metric_names import (
    COMPLETIONS_ERRORED,
    POLICY_AGE_HISTOGRAM,
    SIMULATED,
    STEP,
    STEP_SKIPPED,
    WALL_TIME_S,
)
from forge_rl.observability.metrics import progress


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    def __init__(self, path: Path, total_steps: int, progress_every_s: float, sinks: Sequence[MetricsSink] = ()):
        self.path = path
        self.total_steps = total_steps
        self.progress_every_s = progress_every_s
        self.sinks = list(sinks)
        self._last_progress = float("-inf")
        self._num_skipped_steps = 0
        self._num_errored = 0
        self._file = open(path, "a", buffering=1)
        self._first_line_at = self._file.tell()
        """Where this logger's lines start in the file (a resumed run's earlier steps are before)."""

    def logged(self) -> list[dict]:
        """Every step's metrics this logger wrote, read back from its file: the run's history is
        kept there, not in memory (a dict of every step's figures is kilobytes; at the demo's step
        rate that grows the controller without bound over a long soak)."""
        self._file.flush()
        with open(self.path) as written:
            written.seek(self._first_line_at)
            return [json.loads(line) for line in written]

    def log(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self.log_to_sinks(metrics)
        self._num_skipped_steps += bool(metrics.get(STEP_SKIPPED))
        self._num_errored += metrics.get(COMPLETIONS_ERRORED, 0)
        now = time.monotonic()
        if now - self._last_progress >= self.progress_every_s or metrics[STEP] >= self.total_steps:
            self._last_progress = now
            progress(self.progress_line(metrics))

    def log_to_sinks(self, metrics: dict) -> None:
        """`metrics` (with its step) to the dashboards only: what has a file of its own, such as an
        evaluation's record (RUN_DIR/eval.jsonl)."""
        for sink in list(self.sinks):
            try:
                sink.log(metrics[STEP], metrics)
            except Exception as e:  # a dashboard outage must not cost the run
                progress(f"metrics sink {type(sink).__name__} failed and is turned off: {type(e).__name__}: {e}")
                self.sinks.remove(sink)

    def progress_line(self, metrics: dict) -> str:
        """step 40/300 | reward 0.812 | loss -0.0123 | gen 950 tok/s | train 3100 tok/s | age<=1 | ..."""
        step, wall_time_s = metrics[STEP], metrics.get(WALL_TIME_S, 0.0)
        # A simulated trainer (trainer.engine sim) computes no loss, and its rewards mean nothing.
        learning = (
            []
            if metrics.get(SIMULATED)
            else [f"reward {metrics.get('reward/mean', math.nan):.3f}", f"loss {metrics.get('loss', math.nan):+.4f}"]
        )
        parts = [
            f"step {step}/{self.total_steps}",
            *(learning or ["SIMULATED"]),
            f"gen {metrics.get('throughput/generated_tokens_per_s', 0):.0f} tok/s",
            f"train {metrics.get('throughput/trained_tokens_per_s', 0):.0f} tok/s",
            f"age<={metrics.get('policy_age/max', 0)}",
            f"dropped {metrics.get('buffer/dropped_completions', 0)}",
        ]
        if self._num_errored:
            parts.append(f"errored {self._num_errored}")
        if self._num_skipped_steps:
            parts.append(f"skipped steps {self._num_skipped_steps}")
        eta_s = wall_time_s / max(step, 1) * (self.total_steps - step)
        parts.append(f"{wall_time_s:.0f}s" + (f", eta {_duration(eta_s)}" if step < self.total_steps else ""))
        return " | ".join(parts)

    def close(self) -> None:
        self._file.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                progress(f"metrics sink {type(sink).__name__} failed to close: {type(e).__name__}: {e}")
        self.sinks = []


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class SinkSettings(Protocol):
    """What the sinks read of the run's `forge_rl.config.LogConfig` (read-only: the config is frozen)."""

    @property
    def tensorboard(self) -> bool: ...
    @property
    def wandb(self) -> bool: ...
    @property
    def wandb_project(self) -> str: ...
    @property
    def wandb_mode(self) -> Literal["offline", "online"]: ...


def open_sinks(log: SinkSettings, run_path: Path, hparams: dict) -> list[MetricsSink]:
    """The sinks `log` asks for, writing under `run_path`; `hparams` is the run's config as a dict."""
    sinks: list[MetricsSink] = []
    if log.tensorboard:
        sinks.append(TensorBoardSink(run_path / "tensorboard"))
    if log.wandb:
        sinks.append(WandbSink(run_path, log.wandb_project, log.wandb_mode, hparams))
    return sinks


def scalars(metrics: dict) -> dict[str, float]:
    """Every number in `metrics`, lists of numbers flattened to name/index; nested dicts left out."""
    flat: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, (bool, int, float)):
            flat[name] = float(value)
        elif isinstance(value, list):
            flat.update({f"{name}/{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
    return flat


def policy_age_counts(metrics: dict) -> tuple[list[int], list[int]]:
    """(ages, token counts) of the step's policy-age histogram, ages ascending."""
    histogram = metrics.get(POLICY_AGE_HISTOGRAM) or {}
    ages = sorted(int(age) for age in histogram)
    return ages, [histogram[str(age)] for age in ages]


class TensorBoardSink:
    """Event files under `log_dir`: scalars by metric name, and the policy-age histogram."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)

    def log(self, step: int, metrics: dict) -> None:
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(name, value, step)
        ages, counts = policy_age_counts(metrics)
        if ages:
            # One bucket per age: bucket i spans (age - 0.5, age + 0.5].
            self.writer.add_histogram_raw(
                "policy_age",
                min=ages[0],
                max=ages[-1],
                num=sum(counts),
                sum=sum(a * c for a, c in zip(ages, counts)),
                sum_squares=sum(a * a * c for a, c in zip(ages, counts)),
                bucket_limits=[age + 0.5 for age in ages],
                bucket_counts=counts,
                global_step=step,
            )

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in `run_path`/wandb; offline mode needs neither network nor account."""

    def __init__(self, run_path: Path, project: str, mode: Literal["offline", "online"], hparams: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            name=run_path.name,
            dir=str(run_path),
            mode=mode,
            config=hparams,
            # console="off": stdout stays the CLI's (its last line is the summary JSON).
            settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True, disable_git=True),
        )

    def log(self, step: int, metrics: dict) -> None:
        values: dict = scalars(metrics)
        ages, counts = policy_age_counts(metrics)
        if ages:
            edges = [age - 0.5 for age in ages] + [ages[-1] + 0.5]
            values["policy_age"] = self.wandb.Histogram(
                np_histogram=(counts, edges)  # type: ignore[arg-type]  # wandb's stub asks for arrays; lists work too
            )
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
