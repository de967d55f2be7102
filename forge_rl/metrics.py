"""Run metrics: one JSON object per trainer step in metrics.jsonl, optional TensorBoard and W&B
sinks (`log.tensorboard`, `log.wandb`), and a progress line on stderr.

metrics.jsonl is the record of a run (`forge-rl plot` reads it); the other sinks get the same
numbers: every numeric value as a scalar (a list of numbers, such as the generators' policy
versions, as one scalar per index: `generator/policy_versions/0`), and the policy-age histogram as
a histogram. A sink that fails is reported once and dropped; it never stops a run.
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from forge_rl.advantages import has_reward_spread
from forge_rl.types import CompletionStatus, Episode

if TYPE_CHECKING:
    from forge_rl.config import LogConfig

# Names of the metrics that more than one module reads (the loop writes them; the summary, the
# progress line, the plots and the benchmarks read them). docs/observability.md lists them all.
STEP = "step"
WALL_TIME_S = "wall_time_s"
"""Seconds since the loops started (the timeline's origin)."""
REWARD_MEAN = "reward/mean"
REWARD_COMPONENTS = "reward/components"
"""Prefix of each reward component's mean over the step's scored completions:
`reward/components/<name>` (forge_rl/scorers.py `Score.components`)."""
LOSS = "loss"
COMPLETIONS_ERRORED = "completions/errored"
POLICY_AGE_MAX = "policy_age/max"
POLICY_AGE_MEAN = "policy_age/mean"
POLICY_AGE_HISTOGRAM = "policy_age/histogram"
"""{age: number of trained tokens} of one step, ages as strings (JSON object keys)."""
ZERO_ADVANTAGE_FRACTION = "groups/zero_advantage_fraction"
POLICY_ENTROPY = "policy/entropy"
"""Mean entropy (nats) of the policy's next-token distribution over the trained tokens."""
MISMATCH_KL = "loss/mismatch_kl"
"""Trainer-vs-sampler KL (k3) over the trained tokens: numerics, staleness-free when weights agree."""
MISMATCH_KL_BY_GENERATOR = "mismatch_kl/generator"
"""Prefix of the same KL per generator: `mismatch_kl/generator/<i>` (forge_rl/health.py watches it)."""
MISMATCH_ALARMS = "health/mismatch_alarms"
"""Generators whose mismatch KL jumped this step (forge_rl/health.py); each also printed as a warning."""
TRUNCATED_KEPT_SETS = "completions/truncated_kept_sets"
"""Trained tokens whose top-k/top-p kept set may have been cut to generator.max_support_ids (CPU
engines): their importance ratios are biased above 1. 0 unless that limit is too low."""
TRAINED_TOKENS = "num_tokens"
"""Tokens the step trained (reported by the trainer)."""
STEP_SKIPPED = "step_skipped"
GENERATED_TOKENS_TOTAL = "tokens/generated_total"
GENERATED_TOKENS_PER_S = "throughput/generated_tokens_per_s"
TRAINED_TOKENS_PER_S = "throughput/trained_tokens_per_s"
TRAINER_IDLE_FRACTION = "idle_fraction/trainer"
GENERATORS_IDLE_FRACTION = "idle_fraction/generators"
"""Both since the loops started, by `timeline.idle_fraction` (generator-seconds for several)."""
DROPPED_COMPLETIONS = "buffer/dropped_completions"
DROPPED_EPISODES = "buffer/dropped_episodes"
GENERATOR_POLICY_VERSIONS = "generator/policy_versions"

FINAL_REWARD_WINDOW = 5
"""Final mean reward = mean of the last steps' batch rewards (one step is noisy at small batches)."""


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

    def log(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        for sink in list(self.sinks):
            try:
                sink.log(metrics[STEP], metrics)
            except Exception as e:  # a dashboard outage must not cost the run
                progress(f"metrics sink {type(sink).__name__} failed and is turned off: {type(e).__name__}: {e}")
                self.sinks.remove(sink)
        self._num_skipped_steps += bool(metrics.get(STEP_SKIPPED))
        self._num_errored += metrics.get(COMPLETIONS_ERRORED, 0)
        now = time.monotonic()
        if now - self._last_progress >= self.progress_every_s or metrics[STEP] >= self.total_steps:
            self._last_progress = now
            progress(self.progress_line(metrics))

    def progress_line(self, metrics: dict) -> str:
        """step 40/300 | reward 0.812 | loss -0.0123 | gen 950 tok/s | train 3100 tok/s | age<=1 | ..."""
        step, wall_time_s = metrics[STEP], metrics.get(WALL_TIME_S, 0.0)
        parts = [
            f"step {step}/{self.total_steps}",
            f"reward {metrics.get('reward/mean', math.nan):.3f}",
            f"loss {metrics.get('loss', math.nan):+.4f}",
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
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def open_sinks(log: LogConfig, run_path: Path, hparams: dict) -> list[MetricsSink]:
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

    def __init__(self, run_path: Path, project: str, mode: str, hparams: dict):
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
            values["policy_age"] = self.wandb.Histogram(np_histogram=(counts, edges))
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def final_reward(history: Sequence[dict], num_steps: int = FINAL_REWARD_WINDOW) -> float:
    """Mean reward of the last `num_steps` steps: the figure a run and every benchmark report."""
    tail = history[-num_steps:]
    return sum(m[REWARD_MEAN] for m in tail) / len(tail)


def run_summary(history: Sequence[dict]) -> dict:
    """What a run reports about its training, from its per-step metrics (the run adds how it ran:
    wall time, engine start, recoveries, accounting). Benchmarks read the same function."""
    last = history[-1]
    return {
        "final_mean_reward": final_reward(history),
        "steps": len(history),
        "max_policy_age_seen": max(m[POLICY_AGE_MAX] for m in history),
        "dropped_samples": last[DROPPED_COMPLETIONS],
        "errored_samples": sum(m[COMPLETIONS_ERRORED] for m in history),
        "loop_time_s": last[WALL_TIME_S],
        "trainer_idle_fraction": last[TRAINER_IDLE_FRACTION],
        "generator_idle_fraction": last[GENERATORS_IDLE_FRACTION],
    }


def progress(message: str) -> None:
    """Human-facing status on stderr, so stdout stays machine-readable (the summary JSON line)."""
    print(f"[forge-rl] {message}", file=sys.stderr, flush=True)


def batch_metrics(episodes: list[Episode], train_version: int) -> dict:
    """Reward and staleness of the episodes one step trained at `train_version`. Policy ages count
    the tokens that reach the loss only: a token masked for its age (`drop_policy: mask_tokens`)
    was never trained, so it must not raise `policy_age/max` above the bound."""
    rewards, ages, components = [], collections.Counter(), collections.defaultdict(list)
    num_errored = num_tokens = num_truncated = 0
    for episode in episodes:
        for completion in episode.completions:
            if completion.status == CompletionStatus.ERRORED:
                num_errored += 1
                continue
            rewards.append(completion.reward)
            for name, value in completion.reward_components.items():
                components[f"{REWARD_COMPONENTS}/{name}"].append(value)
            num_tokens += completion.num_tokens
            num_truncated += completion.num_truncated_support
            ages.update(train_version - v for v, trained in zip(completion.policy_versions, completion.loss_mask) if trained)
    return {
        REWARD_MEAN: sum(rewards) / max(len(rewards), 1),
        COMPLETIONS_ERRORED: num_errored,
        TRUNCATED_KEPT_SETS: num_truncated,
        "completions/mean_tokens": num_tokens / max(len(rewards), 1),
        POLICY_AGE_MAX: max(ages, default=0),
        POLICY_AGE_MEAN: sum(age * n for age, n in ages.items()) / max(sum(ages.values()), 1),
        POLICY_AGE_HISTOGRAM: {str(age): count for age, count in sorted(ages.items())},
        # Groups whose rewards are all equal carry no signal (zero advantage); dynamic sampling
        # keeps this at 0, and without it a value near 1 means the task is solved or hopeless.
        ZERO_ADVANTAGE_FRACTION: sum(not has_reward_spread(e) for e in episodes) / max(len(episodes), 1),
        **{name: sum(values) / len(values) for name, values in sorted(components.items())},
    }
