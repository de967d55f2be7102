"""What a run's metrics are made of: the figures of a trained batch (`batch_metrics`), of the
episodes played (`EpisodeStats`), the run summary (`run_summary`), and the progress line on
stderr. Their names are in `forge_rl.observability.metric_names`, where they go in
`forge_rl.observability.sinks`."""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from forge_rl.core.advantages import has_signal
from forge_rl.core.columns import exact_versions
from forge_rl.observability.metric_names import (
    AGENTS_PER_EPISODE,
    COMPLETIONS_ERRORED,
    DROPPED_COMPLETIONS,
    ENV_STEP_LATENCY_P50_S,
    ENV_STEP_LATENCY_P99_S,
    EPISODE_STATUS_PREFIX,
    EPISODES_PLAYED,
    FORKED_SAMPLES_DROPPED,
    GENERATED_TOKENS_PER_EPISODE,
    GENERATORS_IDLE_FRACTION,
    GENERATORS_IDLE_ON_ENV_FRACTION,
    POLICY_AGE_DEPENDENCY_MAX,
    POLICY_AGE_DEPENDENCY_MEAN,
    POLICY_AGE_HISTOGRAM,
    POLICY_AGE_MAX,
    POLICY_AGE_MEAN,
    REWARD_BY_SEAT,
    REWARD_COMPONENTS,
    REWARD_MEAN,
    SPANNED_WEIGHT_UPDATE_FRACTION,
    TOKENS_PER_EPISODE,
    TOOL_ERROR_RATE,
    TRAINER_BACKWARD_S,
    TRAINER_BREAKDOWN,
    TRAINER_FORWARD_S,
    TRAINER_IDLE_FRACTION,
    TRAINER_OPTIMIZER_S,
    TRAINER_OVERHEAD_S,
    TRUNCATED_KEPT_SETS,
    TURNS_PER_EPISODE,
    WALL_TIME_S,
    ZERO_ADVANTAGE_FRACTION,
)
from forge_rl.types import Completion, CompletionStatus, Episode

if TYPE_CHECKING:
    from forge_rl.envs.graph import EpisodeGraph


FINAL_REWARD_WINDOW = 5
"""Final mean reward = mean of the last steps' batch rewards (one step is noisy at small batches)."""


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
    time (`forward_times`, one per generator, `forge_rl.engines.forward_clock`), the rest of their
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
