"""Run metrics: one JSON object per trainer step in metrics.jsonl, optional TensorBoard and W&B
sinks (`log.tensorboard`, `log.wandb`), and a progress line on stderr.

metrics.jsonl is the record of a run (`forge-rl plot` reads it); the other sinks get the same
numbers: every numeric value as a scalar (a list of numbers, such as the generators' policy
versions, as one scalar per index: `generator/policy_versions/0`), and the policy-age histogram as
a histogram. A sink that fails is reported once and dropped; it never stops a run.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from forge_rl.core.advantages import has_signal
from forge_rl.core.columns import exact_versions
from forge_rl.types import Completion, CompletionStatus, Episode

if TYPE_CHECKING:
    from forge_rl.envs.graph import EpisodeGraph

# Names of the metrics that more than one module reads (the loop writes them; the summary, the
# progress line, the plots and the benchmarks read them). Each one's docstring is its entry in
# docs/reference/metrics.md (`make reference`).
STEP = "step"
"""Batches the trainer consumed: the step a record is of (1 for the first trained batch)."""
WALL_TIME_S = "wall_time_s"
"""Seconds since the loops started (the timeline's origin)."""
REWARD_MEAN = "reward/mean"
"""Mean reward of the step's completions, ERRORED ones aside."""
TEACHER_POLICY_VERSION = "teacher/policy_version"
"""Self-distillation: the policy version the pinned teacher serves (forge_rl/scoring/teacher.py `TeacherPin`)."""
REWARD_COMPONENTS = "reward/components"
"""Prefix of each reward component's mean over the step's scored completions:
`reward/components/<name>` (forge_rl/scoring/scorers.py `Score.components`)."""
LOSS = "loss"
"""The batch-wide loss of the step (the policy loss and any KL or entropy terms)."""
COMPLETIONS_ERRORED = "completions/errored"
"""Completions of the step's batch that ERRORED (a reward function or environment failed): advantage 0, left out of the group's statistics."""
POLICY_AGE_MAX = "policy_age/max"
"""The largest age (trainer version minus sampling version) of a token that reached the loss; tokens masked for their age are not counted."""
POLICY_AGE_MEAN = "policy_age/mean"
"""The mean age of the tokens that reached the loss, by the version that sampled each."""
POLICY_AGE_HISTOGRAM = "policy_age/histogram"
"""{age: number of trained tokens} of one step, ages as strings (JSON object keys)."""
POLICY_AGE_DEPENDENCY_MAX = "policy_age/dependency_max"
"""The largest age of a trained token by the oldest weights it depends on: those that sampled it
and those whose KV it attended to (forge_rl/core/columns.py `exact_versions`); what
buffer.max_policy_age bounds. policy_age/max ages by the sampling version alone."""
POLICY_AGE_DEPENDENCY_MEAN = "policy_age/dependency_mean"
"""The mean of the same dependency ages over the trained tokens."""
POLICY_VERSION = "policy_version"
"""The trainer's version after the step (the versions it published; unchanged by a skipped step).
With several policies (`policies`), each one's as `policy_version/<policy>` ("main": the run's own),
and beside it `policy_age/max/<policy>`, `policy_age/dependency_max/<policy>` and
`reward/mean/<policy>` of its part of the batch, its ages against its own version."""
ZERO_ADVANTAGE_FRACTION = "groups/zero_advantage_fraction"
"""The step's groups whose advantages are all zero (every completion scored alike): no learning signal."""
POLICY_ENTROPY = "policy/entropy"
"""Mean entropy (nats) of the policy's next-token distribution over the trained tokens."""
MISMATCH_KL = "loss/mismatch_kl"
"""Trainer-vs-sampler KL (k3) over the trained tokens, at the trainer's weights: numerics on tokens of
the trainer's own version, plus the policy lag of older tokens (sampled by weights since updated)."""
MISMATCH_KL_BY_GENERATOR = "mismatch_kl/generator"
"""Prefix of the same KL per generator: `mismatch_kl/generator/<i>`. Tokens older than the trainer's
version add their policy lag (the last updates' size), so it moves with the updates."""
MISMATCH_KL_FRESH_BY_GENERATOR = "mismatch_kl_fresh/generator"
"""Prefix of the KL per generator over its exact tokens, those whose turn so far was sampled at the
trainer's version (absent for a generator with none that step; forge_rl/core/batching.py
`exact_versions`): numerics alone while the generator serves the weights its versions name, whatever
the updates (forge_rl/observability/health.py watches it)."""
MISMATCH_ALARMS = "health/mismatch_alarms"
"""Generators whose mismatch KL jumped this step (forge_rl/observability/health.py); each also printed as a warning."""
TRUNCATED_KEPT_SETS = "completions/truncated_kept_sets"
"""Trained tokens whose top-k/top-p kept set may have been cut to generator.max_support_ids (CPU
engines): their importance ratios are biased above 1. 0 unless that limit is too low."""
TRAINED_TOKENS = "num_tokens"
"""Tokens the step trained (reported by the trainer)."""
SIMULATED = "simulated"
"""1 on the steps of a simulated trainer (trainer.engine sim): no loss, nothing learned."""
STEP_SKIPPED = "step_skipped"
"""1 when the step's loss or gradient norm was NaN or infinite: no optimizer step, the weights and the policy version stay as they were."""
DATA_SKIPPED_ROWS = "data/skipped_rows"
"""Rows of the data file passed over so far as too long for the context (data.too_long skip); each
counted once, however many epochs met it."""
DATA_EPOCH = "data/epoch"
"""The epoch of the data file the next new prompt comes from (0 during the first pass)."""
BRANCH_PIVOTS_TOTAL = "branch/pivots_total"
"""Branch rollouts (docs/branches.md): pivots branched from, since the start."""
BRANCH_COMPLETIONS_TOTAL = "branch/completions_total"
"""Branch completions sampled (pivots x branch.branches_per_pivot)."""
BRANCH_UNBRANCHED_TOTAL = "branch/unbranched_total"
"""Completions the pivot rule found no pivot in: they train as plain samples."""
BRANCH_PIVOT_ERRORS_TOTAL = "branch/pivot_errors_total"
"""Completions left unbranched because branch.function raised or named a position outside them."""
BRANCH_PREFIX_CACHE_HIT_FRACTION = "branch/prefix_cache_hit_fraction"
"""Of the prefix tokens of branch requests (prompt and head), the fraction read from the
generator's prefix cache: 0 where the weights changed between the pivot's sampling and its
branches (the prefix is encoded afresh), near 1 where they did not."""
BRANCH_TOKENS_TOTAL = "branch/tokens_total"
"""Tokens the branches sampled."""
GENERATED_TOKENS_TOTAL = "tokens/generated_total"
"""Tokens every generator sampled since the run started, trained or not."""
GENERATED_TOKENS_PER_S = "throughput/generated_tokens_per_s"
"""Tokens sampled per second since the previous step, over every generator."""
TRAINED_TOKENS_PER_S = "throughput/trained_tokens_per_s"
"""Tokens the step trained over the step's wall time."""
TRAINER_IDLE_FRACTION = "idle_fraction/trainer"
"""Since the loops started, 1 - the trainer's busy time over elapsed time (`timeline.idle_fraction`)."""
GENERATORS_IDLE_FRACTION = "idle_fraction/generators"
"""Since the loops started, generator-seconds idle over generator-seconds (`timeline.idle_fraction`)."""
DROPPED_COMPLETIONS = "buffer/dropped_completions"
"""Completions the buffer dropped for their age since the start (older than buffer.max_policy_age)."""
DROPPED_EPISODES = "buffer/dropped_episodes"
"""Episodes (groups) the buffer dropped for their age since the start."""
GENERATOR_POLICY_VERSIONS = "generator/policy_versions"
"""The version each generator serves at the step, a list by generator index (one scalar per index in TensorBoard and W&B: `generator/policy_versions/<i>`)."""
NUM_GENERATORS = "generator/count"
"""Generators in the pool at the step (the run's num_generators, then as `forge-rl scale` changes it)."""
WEIGHTS_FETCHED_BYTES_TOTAL = "weights/fetched_bytes_total"
"""Bytes every generator's weight updates moved between hosts since the run started: one copy per
version per remote host (store/host_copies.py), 0 when every generator shares the trainer's host."""

# The train loop's critical path, per step, from the previous step's return to this one's
# (forge_rl/run/loop.py `critical_path_breakdown`): waiting for data, the trainer's compute (rank 0's
# forward, backward, optimizer), and everything else (batching, publishing the weights, messages,
# the loop's bookkeeping; sampling the buffer only when the batch could not be taken ahead).
TRAINER_DATA_WAIT_S = "trainer/data_wait_s"
"""Waiting for the admission gate to have a batch (generation is behind): not overhead."""
TRAINER_FORWARD_S = "trainer/forward_s"
"""The forward pass of the step on rank 0 (the policy, and the reference where one is trained against)."""
TRAINER_BACKWARD_S = "trainer/backward_s"
"""Backward, and the LoRA adapters' gradient reduction."""
TRAINER_OPTIMIZER_S = "trainer/optimizer_s"
"""Gradient clipping and the AdamW step."""
TRAINER_BATCHING_S = "trainer/batching_s"
"""Building the padded/packed batch from the episodes, in the trainer's process."""
TRAINER_PUBLISH_S = "trainer/publish_s"
"""Snapshotting the new weights and handing them to the store's writer (the write itself is
in the background)."""
TRAINER_OVERHEAD_S = "trainer/overhead_s"
"""The critical path minus data wait and compute: batching, publishing, sampling, messages and the
loop's bookkeeping. The bookkeeping after a step (logging, checkpoints) counts in the next step."""

# Environment episodes (forge_rl/envs/rollout.py), over those played since the previous step.
EPISODES_PLAYED = "episodes/played"
"""Environment episodes played since the previous step."""
TURNS_PER_EPISODE = "episodes/turns_mean"
"""Mean model turns per episode played since the previous step."""
TOKENS_PER_EPISODE = "episodes/tokens_mean"
"""Tokens of the trajectory's sequences, context included (what the context budget counts)."""
GENERATED_TOKENS_PER_EPISODE = "episodes/generated_tokens_mean"
"""Mean tokens the model sampled per episode (the trainable ones; environment text aside)."""
TOOL_ERROR_RATE = "episodes/tool_error_rate"
"""Malformed turns (a tool call that does not parse, an unknown tool) per model turn."""
SPANNED_WEIGHT_UPDATE_FRACTION = "episodes/spanned_weight_update_fraction"
"""Episodes whose generated tokens carry more than one policy version (a partial rollout)."""
ENV_STEP_LATENCY_P50_S = "env/step_latency_p50_s"
"""Median wall time of the environment resets and steps that answered since the previous step (timeouts are counted as statuses)."""
ENV_STEP_LATENCY_P99_S = "env/step_latency_p99_s"
"""The 99th percentile of the same wall times."""
FORKED_SAMPLES_DROPPED = "episodes/forked_samples_dropped"
"""Samples after a prefix break, not trained (forge_rl/envs/rollout.py says why)."""
EPISODE_STATUS_PREFIX = "episodes/status/"
"""`episodes/status/<status>`: agents' views that ended so (forge_rl/envs/trajectory.py,
TrajectoryStatus); one per episode of a single-agent environment."""
AGENTS_PER_EPISODE = "episodes/agents_mean"
"""Agents whose views an episode trains (forge_rl/envs/graph.py); 1 for a single-agent environment."""
REWARD_BY_SEAT = "reward/by_seat"
"""`reward/by_seat/<seat>`: the mean reward of a multi-agent episode's agents of that seat, over
the completions of the step (ERRORED ones aside)."""
GENERATORS_IDLE_ON_ENV_FRACTION = "idle_fraction/generators_waiting_on_env"
"""Since the loops started, generator-seconds with no turn in flight while episodes waited on
environment calls (forge_rl/envs/rollout.py, EnvWaitClock), over all generator-seconds."""

TRAINER_BREAKDOWN = (
    TRAINER_DATA_WAIT_S, TRAINER_FORWARD_S, TRAINER_BACKWARD_S, TRAINER_OPTIMIZER_S,
    TRAINER_BATCHING_S, TRAINER_PUBLISH_S, TRAINER_OVERHEAD_S,
)  # fmt: skip
TRAINER_STEP_CLOCK = frozenset({"step_time_s", TRAINER_FORWARD_S, TRAINER_BACKWARD_S, TRAINER_OPTIMIZER_S})
"""The wall-clock readings among a `PolicyTrainer.train_step`'s metrics: everything else it
returns is a pure function of the weights and the batch (what parity tests compare)."""

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
        self._first_line_at = self._file.tell()
        """Where this logger's lines start in the file (a resumed run's earlier steps are before)."""

    def logged(self) -> list[dict]:
        """Every step's metrics this logger wrote, read back from its file: the run's history is
        kept there, not in memory (a dict of every step's ~80 figures is about 7 KB; at the demo's
        6 steps/s that grew the controller by 80 MB over a 30-minute soak)."""
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


def final_reward(history: Sequence[dict], num_steps: int = FINAL_REWARD_WINDOW) -> float:
    """Mean reward of the last `num_steps` steps: the figure a run and every benchmark report."""
    tail = history[-num_steps:]
    return sum(m[REWARD_MEAN] for m in tail) / len(tail)


def run_summary(history: Sequence[dict]) -> dict:
    """What a run reports about its training, from its per-step metrics (the run adds how it ran:
    wall time, engine start, recoveries, accounting). Benchmarks read the same function."""
    last = history[-1]
    return {
        **_environment_summary(history),
        "final_mean_reward": final_reward(history),
        "steps": len(history),
        "max_policy_age_seen": max(m[POLICY_AGE_MAX] for m in history),
        "max_dependency_age_seen": max(m.get(POLICY_AGE_DEPENDENCY_MAX, 0) for m in history),
        "dropped_samples": last[DROPPED_COMPLETIONS],
        "errored_samples": sum(m[COMPLETIONS_ERRORED] for m in history),
        "loop_time_s": last[WALL_TIME_S],
        "trainer_idle_fraction": last[TRAINER_IDLE_FRACTION],
        "generator_idle_fraction": last[GENERATORS_IDLE_FRACTION],
        **trainer_overhead_summary(history),
    }


def trainer_overhead_summary(history: Sequence[dict]) -> dict:
    """Where the train loop's time went, summed over the steps: `trainer_overhead_fraction` is the
    share of the step (compute plus overhead; waiting for data excluded, since that is generation's
    share) spent outside the trainer's forward, backward and optimizer. A run without the breakdown
    (a simulated trainer) reports none."""
    if TRAINER_OVERHEAD_S not in history[-1]:
        return {}
    totals = {name: sum(m.get(name, 0.0) for m in history) for name in TRAINER_BREAKDOWN}
    compute_s = totals[TRAINER_FORWARD_S] + totals[TRAINER_BACKWARD_S] + totals[TRAINER_OPTIMIZER_S]
    return {
        "trainer_overhead_fraction": totals[TRAINER_OVERHEAD_S] / max(compute_s + totals[TRAINER_OVERHEAD_S], 1e-9),
        "trainer_time_s": {name.removeprefix("trainer/").removesuffix("_s"): round(t, 3) for name, t in totals.items()},
    }


def generator_time_summary(history: Sequence[dict], forward_times: Sequence[dict]) -> dict:
    """Where the generators' time went over the loops, summed over generators: the engines' model
    time (`forward_times`, one per generator, forge_rl/engines/forward_clock.py), the rest of their
    busy time (a request in flight: scheduling, detokenization, messages, swaps), and idle. A
    replaced generator's engine counts from its replacement on, so its share is a lower bound. A
    simulation runs no model: nothing then."""
    if not forward_times or not all("forward_s" in t for t in forward_times):
        return {}
    last = history[-1]
    total_s = last[WALL_TIME_S] * len(forward_times)
    busy_s = (1.0 - last[GENERATORS_IDLE_FRACTION]) * total_s
    forward_s = min(sum(t["forward_s"] for t in forward_times), busy_s)
    return {
        "generator_time_s": {
            "forward": round(forward_s, 3),
            "busy_other": round(busy_s - forward_s, 3),
            "idle": round(total_s - busy_s, 3),
        },
        "generator_forward_fraction": forward_s / max(total_s, 1e-9),
    }


def _environment_summary(history: Sequence[dict], num_steps: int = FINAL_REWARD_WINDOW) -> dict:
    """For a run on an environment: turns per episode over the episodes of the last `num_steps`
    steps (the window of the final reward), and the generators' idle waiting on environments."""
    if TURNS_PER_EPISODE not in history[-1]:
        return {}
    tail = history[-num_steps:]
    num_episodes = sum(m[EPISODES_PLAYED] for m in tail)
    return {
        "mean_turns_per_episode": sum(m[TURNS_PER_EPISODE] * m[EPISODES_PLAYED] for m in tail) / max(num_episodes, 1),
        "generator_idle_waiting_on_env_fraction": history[-1][GENERATORS_IDLE_ON_ENV_FRACTION],
    }


def progress(message: str) -> None:
    """Human-facing status on stderr, so stdout stays machine-readable (the summary JSON line)."""
    print(f"[forge-rl] {message}", file=sys.stderr, flush=True)


def batch_metrics(
    episodes: list[Episode],
    train_version: int,
    normalize_std: bool = True,
    step_discount: float = 1.0,
    local_weight: float = 1.0,
) -> dict:
    """Reward and staleness of the episodes one step trained at `train_version`. Policy ages count
    the tokens that reach the loss only: a token masked for its age (`drop_policy: mask_tokens`)
    was never trained, so it must not raise `policy_age/max` above the bound. `normalize_std` and
    `step_discount`, `local_weight`: the loss's, which the advantages of `ZERO_ADVANTAGE_FRACTION`
    are taken with. `POLICY_AGE_DEPENDENCY_MAX` / `_MEAN` age each trained token by the oldest
    weights it depends on (`exact_versions`: those that sampled it and those whose KV it read),
    which is what the age bound holds."""
    rewards, components = [], collections.defaultdict(list)
    ages: collections.Counter[int] = collections.Counter()
    dependency_ages: collections.Counter[int] = collections.Counter()
    by_seat = collections.defaultdict(list)
    num_errored = num_tokens = num_truncated = 0
    for episode in episodes:
        for completion in episode.completions:
            if completion.status == CompletionStatus.ERRORED:
                num_errored += 1
                continue
            rewards.append(completion.reward)
            if completion.agent is not None:
                by_seat[f"{REWARD_BY_SEAT}/{completion.agent.split('/', 1)[0]}"].append(completion.reward)
            for name, value in completion.reward_components.items():
                components[f"{REWARD_COMPONENTS}/{name}"].append(value)
            num_tokens += completion.num_tokens
            num_truncated += completion.num_truncated_support
            for version, count in completion.trained_tokens_by_version().items():
                ages[train_version - version] += count
            for version, count in _trained_tokens_by_dependency(completion).items():
                dependency_ages[train_version - version] += count
    return {
        REWARD_MEAN: sum(rewards) / max(len(rewards), 1),
        COMPLETIONS_ERRORED: num_errored,
        TRUNCATED_KEPT_SETS: num_truncated,
        "completions/mean_tokens": num_tokens / max(len(rewards), 1),
        POLICY_AGE_MAX: max(ages, default=0),
        POLICY_AGE_MEAN: sum(age * n for age, n in ages.items()) / max(sum(ages.values()), 1),
        POLICY_AGE_HISTOGRAM: {str(age): count for age, count in sorted(ages.items())},
        POLICY_AGE_DEPENDENCY_MAX: max(dependency_ages, default=0),
        POLICY_AGE_DEPENDENCY_MEAN: sum(age * n for age, n in dependency_ages.items())
        / max(sum(dependency_ages.values()), 1),
        # Groups with no nonzero advantage on a trained token carry no signal; dynamic sampling
        # keeps this at 0, and without it a value near 1 means the task is solved or hopeless.
        ZERO_ADVANTAGE_FRACTION: sum(not has_signal(e, normalize_std, step_discount, local_weight) for e in episodes)
        / max(len(episodes), 1),
        **{name: sum(values) / len(values) for name, values in sorted(components.items())},
        **{name: sum(values) / len(values) for name, values in sorted(by_seat.items())},
    }


def _trained_tokens_by_dependency(completion: Completion) -> dict[int, int]:
    """Tokens that reach the loss, counted by the oldest weights each depends on (`exact_versions`)."""
    if completion.kv_versions is None and completion.generated is None:
        versions = completion.policy_versions
        if versions and min(versions) == versions[0]:  # one request, no older KV: its first version
            count = completion.num_trainable_tokens
            return {versions[0]: count} if count else {}
    return dict(collections.Counter(v for v, trains in zip(exact_versions(completion), completion.loss_mask) if trains))


@dataclasses.dataclass
class EpisodeStats:
    """Figures of the environment episodes played between two train steps; the loop starts a
    fresh one after each step's `figures`."""

    num_episodes: int = 0
    num_agents: int = 0
    num_turns: int = 0
    num_malformed_turns: int = 0
    num_tokens: int = 0
    num_generated_tokens: int = 0
    num_spanning_update: int = 0
    num_forked_samples_dropped: int = 0
    env_latencies_s: list[float] = dataclasses.field(default_factory=list)
    statuses: dict[str, int] = dataclasses.field(default_factory=dict)

    def observe(self, graph: EpisodeGraph) -> None:
        """One episode: its turns, tokens and statuses summed over its agents' views."""
        self.num_episodes += 1
        self.num_agents += len(graph.agents)
        for trajectory in graph.agents.values():
            self.num_turns += trajectory.num_turns
            self.num_malformed_turns += trajectory.num_malformed_turns
            self.num_tokens += sum(sample.num_tokens for sample in trajectory.samples)
            self.num_generated_tokens += trajectory.num_generated_tokens
            self.num_forked_samples_dropped += trajectory.num_forks
            self.env_latencies_s += trajectory.env_latencies_s
            self.statuses[trajectory.status.value] = self.statuses.get(trajectory.status.value, 0) + 1
        versions = {v for t in graph.agents.values() for span in t.generated_spans for v in span.policy_versions}
        self.num_spanning_update += len(versions) > 1

    def figures(self) -> dict:
        episodes = max(self.num_episodes, 1)
        return {
            EPISODES_PLAYED: self.num_episodes,
            AGENTS_PER_EPISODE: self.num_agents / episodes,
            TURNS_PER_EPISODE: self.num_turns / episodes,
            TOKENS_PER_EPISODE: self.num_tokens / episodes,
            GENERATED_TOKENS_PER_EPISODE: self.num_generated_tokens / episodes,
            TOOL_ERROR_RATE: self.num_malformed_turns / max(self.num_turns, 1),
            SPANNED_WEIGHT_UPDATE_FRACTION: self.num_spanning_update / episodes,
            ENV_STEP_LATENCY_P50_S: percentile(self.env_latencies_s, 50),
            ENV_STEP_LATENCY_P99_S: percentile(self.env_latencies_s, 99),
            FORKED_SAMPLES_DROPPED: self.num_forked_samples_dropped,
            **{f"{EPISODE_STATUS_PREFIX}{status}": count for status, count in sorted(self.statuses.items())},
        }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (nearest rank); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]
