"""The runs `forge-rl bench scale` (and `bench faults`, `bench elastic`) measure: a simulated run's
config at a generator count (`control_plane_config`), the run with its actor handles counted and its
event loops probed (`run_probed`), and the probes that run in processes of their own beside it."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from forge_rl.config import GRPOConfig
from forge_rl.observability.timeline import Timeline, watch_event_loop_lag

if TYPE_CHECKING:
    from forge_rl.bench.scale import ScaleArgs
    from forge_rl.run.loop import Pipeline, RunActors


class _CountingEndpoint:
    def __init__(self, endpoint, counts: collections.Counter, key: str):
        self._endpoint, self._counts, self._key = endpoint, counts, key

    def call_one(self, *args, **kwargs):
        self._counts[self._key] += 1
        return self._endpoint.call_one(*args, **kwargs)

    def call(self, *args, **kwargs):
        self._counts[self._key] += 1
        return self._endpoint.call(*args, **kwargs)


class _CountingActor:
    """An actor handle whose endpoint calls are counted (the loops call `.call_one()` / `.call()`)."""

    def __init__(self, actor, counts: collections.Counter, name: str):
        self._actor, self._counts, self._name = actor, counts, name

    def __getattr__(self, endpoint: str):
        return _CountingEndpoint(getattr(self._actor, endpoint), self._counts, f"{self._name}.{endpoint}")

    def __reduce_ex__(self, protocol):
        # Sent in a message (the train loop hands the rollouts to the trainer) as the handle it
        # wraps: calls made elsewhere are not the controller's.
        return self._actor.__reduce_ex__(protocol)


class RunProbe:
    """What one run's controller and rollouts do: endpoint calls per step (the controller's counted
    at the train loop's actor handles, the rollouts' counted by themselves), each event loop's lag,
    generator processes' memory."""

    def __init__(self, warmup_steps: int = 1):
        self.warmup_steps = warmup_steps
        """Steps left out of the steady-state figures: the first (its fill and start-up calls), or
        more (an asynchronous run's first A + 1, `async_vs_sync`)."""
        self.counts: collections.Counter = collections.Counter()
        self.step_marks: list[tuple[int, float, int, int]] = []
        """(step, wall time, controller calls so far, rollouts' calls so far) after each train step."""
        self.lags_s: list[tuple[float, float]] = []
        """(wall time, lag) of the controller's event loop."""
        self.floor_lags_s: list[tuple[float, float]] = []
        """(wall time, lag) of a process that runs the probe only (`probe_until_stdin_closes`)."""
        self.generator_rss: list[float] = []
        self.pipeline: Pipeline | None = None
        """The run's Pipeline, read once it ended (what the rollouts reported at the stop)."""
        self.actors: RunActors | None = None
        """The run's actor handles as the recipe made them (not counted)."""

    def install(self, after_step=None):
        """Count the calls of every Pipeline built from now on (the recipe builds one); with
        `after_step`, await `after_step(probe, step)` once each train step is done."""
        from forge_rl.pipeline.rollouts import ROLLOUT_CALLS_TOTAL
        from forge_rl.run import loop

        probe, original_init, original_step = self, loop.Pipeline.__init__, loop.Pipeline._finish_step

        def init(pipeline, config, actors):
            probe.pipeline, probe.actors = pipeline, actors
            counted = dataclasses.replace(
                actors,
                **{name: _CountingActor(getattr(actors, name), probe.counts, name) for name in ("rollouts", "trainer")},
            )
            original_init(pipeline, config, counted)

        async def finish_step(pipeline, sent, lifecycle, **how):
            result = await original_step(pipeline, sent, lifecycle, **how)
            if result is None:  # withheld at a stop
                return result
            probe.step_marks.append(
                (sent.step, time.time(), sum(probe.counts.values()), result.metrics[ROLLOUT_CALLS_TOTAL])
            )
            if after_step is not None:
                await after_step(probe, sent.step)
            return result

        loop.Pipeline.__init__, loop.Pipeline._finish_step = init, finish_step

        def restore():
            loop.Pipeline.__init__, loop.Pipeline._finish_step = original_init, original_step

        return restore

    def _pipeline(self) -> Pipeline:
        if self.pipeline is None:
            raise RuntimeError("bench scale: the run built no Pipeline (install the probe before the run)")
        return self.pipeline

    def held_at_stop(self) -> dict:
        """Prompts handed out and neither trained nor filtered nor dropped when the run ended,
        counted where they were (`forge_rl.pipeline.rollouts.Rollouts.stop_loops`): in the buffer (admitted, reached it,
        not taken), in the queue of prompts to generate again after a generator died, or cut short
        in a rollout."""
        return self._pipeline().rollouts_at_stop["held_at_stop"]

    def steady(self) -> dict:
        """Figures over the steps after the first `warmup_steps` (the first: its fill and start-up
        calls excluded)."""
        warm = [mark for mark in self.step_marks[:-1] if mark[0] >= self.warmup_steps] or self.step_marks
        (first_step, first_t, first_calls, first_rollout_calls) = warm[0]
        (last_step, last_t, last_calls, last_rollout_calls) = self.step_marks[-1]
        steps = max(last_step - first_step, 1)
        rollouts = self._pipeline().rollouts_at_stop
        controller_lag = _p99_ms([lag for t, lag in self.lags_s if first_t <= t <= last_t])
        rollouts_lag = _p99_ms([lag for t, lag in rollouts["event_loop_lags_s"] if first_t <= t <= last_t])
        floor_lag = _p99_ms([lag for t, lag in self.floor_lags_s if first_t <= t <= last_t])
        return {
            "controller_calls_per_step": (last_calls - first_calls) / steps,
            "rollouts_calls_per_step": (last_rollout_calls - first_rollout_calls) / steps,
            "steps_per_s": steps / max(last_t - first_t, 1e-9),
            "controller_event_loop_lag_p99_ms": controller_lag,
            "rollouts_event_loop_lag_p99_ms": rollouts_lag,
            "idle_process_event_loop_lag_p99_ms": floor_lag,
            # The worse of the two event loops the data path runs on.
            "event_loop_lag_p99_ms": max(
                (lag for lag in (controller_lag, rollouts_lag) if lag is not None), default=None
            ),
            "generator_rss_mib": max(self.generator_rss) / 2**20 if self.generator_rss else None,
            "calls_by_endpoint_total": dict(self.counts),
            "rollouts_calls_by_endpoint_total": rollouts["calls"],
        }


def _p99_ms(lags_s: list[float]) -> float | None:
    lags = sorted(lags_s)
    return 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None


def run_probed(config: GRPOConfig, after_step=None, warmup_steps: int = 1) -> tuple[dict, Path]:
    """Run `config` in this process with the probe (and `after_step`, see `RunProbe.install`);
    returns its figures (steady state: after `warmup_steps`) and the run directory."""
    from forge_rl.run.recipes import recipe

    probe = RunProbe(warmup_steps)
    restore = probe.install(after_step)

    async def measured():
        watcher = asyncio.create_task(watch_event_loop_lag(probe.lags_s))
        try:
            return await recipe("grpo")(config)
        finally:
            watcher.cancel()

    # Each in a process of its own: the machine's floor (the lag probe in a process that does
    # nothing else), and the generators' memory. Sampling 128 processes' memory from a thread of
    # this one would hold the GIL for tens of milliseconds every half second: most of the
    # controller's lag at G = 128.
    floor = _until_stdin_closes("probe_lag_until_stdin_closes()")
    memory = _until_stdin_closes(f"sample_generator_rss_until_stdin_closes({str(config.run_dir)!r})")
    try:
        summary = asyncio.run(measured())
    finally:
        restore()
        probe.floor_lags_s = [tuple(sample) for sample in json.loads(floor.communicate("", timeout=30)[0])]
        probe.generator_rss = json.loads(memory.communicate("", timeout=30)[0])
    figures = {
        **probe.steady(),
        **{key: summary[key] for key in ("simulated", "steps", "accounting", "generator_recoveries")},
        "held_at_stop": probe.held_at_stop(),
    }
    return figures, Path(summary["run_dir"])


def _until_stdin_closes(call: str) -> subprocess.Popen:
    """`call` (a function of this module) in a fresh process; it runs until its stdin closes, then
    prints its result as JSON (`.communicate("")` ends it and reads it)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import json; from forge_rl.bench import scale_runs; print(json.dumps(scale_runs.{call}))",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def probe_lag_until_stdin_closes() -> list[tuple[float, float]]:
    """The event-loop lag probe alone in a process, until its stdin closes. What a loop that does
    nothing waits for a core on this machine at the moment: the floor under every other process's
    lag."""

    async def probing() -> list[tuple[float, float]]:
        samples: list[tuple[float, float]] = []
        watcher = asyncio.create_task(watch_event_loop_lag(samples))
        await asyncio.to_thread(sys.stdin.read)
        watcher.cancel()
        return samples

    return asyncio.run(probing())


def sample_generator_rss_until_stdin_closes(run_root: str) -> list[float]:
    """Until stdin closes: once the run wrote processes.json, the mean resident memory of its
    generators' actor processes every 0.5 s."""
    stdin_closed = threading.Event()

    def wait_for_stdin() -> None:
        sys.stdin.read()
        stdin_closed.set()

    threading.Thread(target=wait_for_stdin, daemon=True).start()
    samples = []
    while not stdin_closed.wait(0.5):
        for path in Path(run_root).glob("*/processes.json"):
            rss = []
            for pids in json.loads(path.read_text())["generators"]:
                try:
                    rss.append(psutil.Process(pids[0]).memory_info().rss)
                except (psutil.Error, IndexError):
                    pass
            if rss:
                samples.append(statistics.mean(rss))
    return samples


def max_concurrent_sequences(run_path: Path) -> int:
    """Most sequences in generate calls at once over all generators (from the run's timeline)."""
    events = []
    for interval in Timeline.load(run_path / "timeline.jsonl"):
        if interval.component.startswith("generator"):
            events += [(interval.start_s, interval.num_sequences), (interval.end_s, -interval.num_sequences)]
    in_flight = peak = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        in_flight += change
        peak = max(peak, in_flight)
    return peak


def control_plane_config(
    base: GRPOConfig, args: ScaleArgs, num_generators: int, run_dir: Path, steps: int
) -> GRPOConfig:
    """The control-plane workload at `num_generators`: a zero-cost trainer step, P =
    prompts_per_generator_step x G prompts per step, short completions."""
    prompts_per_step = args.prompts_per_generator_step * num_generators
    return dataclasses.replace(
        base,
        run_dir=run_dir,
        run_name=None,
        steps=steps,
        num_generators=num_generators,
        prompts_in_flight_per_generator=args.prompts_in_flight_per_generator,
        log=dataclasses.replace(base.log, event_loop_lag=True),
        train_batch_size=prompts_per_step * base.group_size,
        generator=dataclasses.replace(
            base.generator,
            sim=dataclasses.replace(
                base.generator.sim, time_scale=args.time_scale, length_median_tokens=args.control_median_tokens
            ),
        ),
        trainer=dataclasses.replace(
            base.trainer, sim=dataclasses.replace(base.trainer.sim, step_fixed_s=0.0, step_per_token_s=0.0)
        ),
        buffer=dataclasses.replace(
            base.buffer,
            max_policy_age=args.control_max_policy_age,
            capacity_episodes=max(base.buffer.capacity_episodes, (args.control_max_policy_age + 2) * prompts_per_step),
        ),
    )
