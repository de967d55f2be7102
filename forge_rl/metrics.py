"""Run metrics: one JSON object per trainer step in metrics.jsonl, and a progress line on stderr."""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

from forge_rl.types import CompletionStatus, Episode


class MetricsLogger:
    def __init__(self, path: Path, total_steps: int, progress_every_s: float):
        self.path = path
        self.total_steps = total_steps
        self.progress_every_s = progress_every_s
        self._last_progress = float("-inf")
        self._file = open(path, "a", buffering=1)

    def log(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        now = time.monotonic()
        is_last = metrics["step"] >= self.total_steps
        if now - self._last_progress >= self.progress_every_s or is_last:
            self._last_progress = now
            progress(
                f"step {metrics['step']}/{self.total_steps}"
                f" | reward {metrics['reward/mean']:.3f}"
                f" | loss {metrics['loss']:+.4f}"
                f" | gen {metrics['throughput/generated_tokens_per_s']:.0f} tok/s"
                f" | train {metrics['throughput/trained_tokens_per_s']:.0f} tok/s"
                f" | age<={metrics['policy_age/max']}"
                f" | dropped {metrics['buffer/dropped_completions']}"
                f" | {metrics['wall_time_s']:.0f}s"
            )

    def close(self) -> None:
        self._file.close()


def progress(message: str) -> None:
    """Human-facing status on stderr, so stdout stays machine-readable (the summary JSON line)."""
    print(f"[forge-rl] {message}", file=sys.stderr, flush=True)


def batch_metrics(episodes: list[Episode], train_version: int) -> dict:
    """Reward and staleness of the episodes one step trained at `train_version`."""
    rewards, ages = [], collections.Counter()
    num_errored = 0
    for episode in episodes:
        for completion in episode.completions:
            if completion.status == CompletionStatus.ERRORED:
                num_errored += 1
                continue
            rewards.append(completion.reward)
            ages.update(train_version - v for v in completion.policy_versions)
    return {
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        "completions/errored": num_errored,
        "completions/mean_tokens": sum(ages.values()) / max(len(rewards), 1),
        "policy_age/max": max(ages, default=0),
        "policy_age/mean": sum(age * n for age, n in ages.items()) / max(sum(ages.values()), 1),
        "policy_age/histogram": {str(age): count for age, count in sorted(ages.items())},
    }
