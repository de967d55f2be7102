"""`forge-rl bench scale`: the control plane at scale, on SIMULATED engines and trainer.

Every run is the GRPO recipe with real Monarch actors on this machine (the rollouts' process with the
buffer and the prompts, the scorer, the generator pool and one process per generator, the trainer
mesh), but with `generator.engine sim`
and `trainer.engine sim` (forge_rl/engines/simulated.py): no model runs, tokens are placeholders,
decode and train steps are timed waits. What is measured is forge_rl's own work. Each simulated
generator stands in for an engine on a GPU host of its own, so in parts 1 and 3 its process yields
the cores to the run's others (Linux's SCHED_IDLE, `generator.sim.idle_priority`;
`sim_generators_idle_priority` in the figures): 128 of them otherwise took 0.7 of the 2 cores here
from the control plane. Part 2's eight run as the rest: there their answers set the pace.

1. Control-plane overhead at each generator count G (`--generator-counts`), with a zero-cost
   trainer step and prompts per step P = prompts_per_generator_step x G, so every generator has work:
       controller_calls_per_step   endpoint calls the controller process makes per train step,
                                   counted at the train loop's actor handles (loop.RunActors) in
                                   the steady state (first step excluded)
       rollouts_calls_per_step     the same for the rollouts' process (forge_rl/pipeline/rollouts.py,
                                   counted there): per prompt and per generator; the pool's relay
                                   to each generator and the store's messages are in neither
       steps_per_s                 train steps per second in the steady state
       event_loop_lag_p99_ms       how late a 10 ms timer fires, p99 over the steady state, on the
                                   worse of the controller's and the rollouts' event loops (each
                                   also reported), beside the same probe in a process that does
                                   nothing else (idle_process_event_loop_lag_p99_ms: what waiting
                                   for a core costs any process on the machine at that load)
       max_concurrent_rollouts     most sequences decoding at once over all generators (timeline)
       generator_rss_mib           resident memory of one generator process (its actor and the
                                   simulated engine in it), the mean over generators
2. Async vs sync on a long-tail workload with the default GPU calibration (Qwen3-8B decode on one
   H100 per generator, a Qwen3-8B step on 8 H100s; `async_prompts_per_step` x 8 completions a
   step, log-normal lengths cut at 4,096 tokens): forge-rl bench async-vs-sync's analysis of both
   runs (speedup, pipeline efficiency), and the analytic bound of docs/benchmarks/README.md:
       sync step  = straggler + train          (the slowest completion of the step's batch, then the step)
       async step >= max(train, generate, straggler / (A + 1))
   where generate is the step's tokens over the engines' throughput at full batch and A the
   staleness bound; `sim_efficiency_vs_bound` = the bound's speedup achieved, and
   `sim_token_efficiency_vs_bound` the same in tokens that reached the loss per second (the bound
   trains a synchronous step's tokens per step). That bound takes
   generate at the largest batch and the straggler at the synchronous run's speed; no batch gives
   both. `sim_efficiency_vs_uniform_batch_bound` holds both to one batch size B, the best:
       async step >= min over B of max(train, generate(B), longest x decode_step(B) / (A + 1))
   (`uniform_batch_floor`; longest: the expected longest completion of a step's batch).
   `sim_efficiency_vs_waiting_bound` adds what no run that waits for its stragglers can beat,
   however it schedules (`waiting_straggler_floor`): the longest of A + 1 steps' completions
   (Lwin), decoded alone, must fit in the A + 1 steps it may span:
       async step >= max(train, generate, straggler / (A + 1), Lwin x decode_step(1) / (A + 1))
   A third run, asynchronous with partial rollouts (`buffer.wait_for_stragglers` false: the trainer
   waits for no straggler; one past its last step is trained later with its over-age tokens
   masked), against the same bound: `sim_partial_async_speedup`, `sim_partial_efficiency_vs_bound`,
   `sim_partial_token_efficiency_vs_bound` (in trained tokens: its steps train fewer, the masked
   ones excluded) and `sim_partial_dropped_token_fraction` (generated tokens that reached no loss). This part runs
   at `async_time_scale` (1.0: the GPU timings as calibrated).
3. Faults at scale: the control-plane run with `fault_generators` generators; once step
   `fault_kill_after_step` is done, every process of a tenth of them (chosen from `fault_seed`) is
   SIGKILLed. The generator pool must detect each death and replace the generator; the train loop
   waits after step `fault_replaced_by_step` until the replacements serve, so the run cannot end
   before the recovery, and trains on to `fault_steps` with them. Reported: generators killed,
   detected, replaced, detection and replacement latencies, steps completed, prompts requeued,
   trained twice and lost, and `faults_accounting_ok` (`judge_accounting`).

Figures go to OUT_DIR/scale.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from forge_rl.bench.async_vs_sync import analyze
from forge_rl.config import GRPOConfig
from forge_rl.core.deadlines import within
from forge_rl.observability.metrics import GENERATED_TOKENS_TOTAL, progress
from forge_rl.observability.plot import read_metrics
from forge_rl.observability.timeline import Timeline, watch_event_loop_lag
from forge_rl.plumbing.reaper import kill_trees

if TYPE_CHECKING:
    from forge_rl.run.loop import Pipeline, RunActors


@dataclass(frozen=True)
class ScaleArgs:
    config: Path = Path("configs/sim_scale.yaml")
    """Simulation config both parts start from (generator.engine and trainer.engine sim)."""
    generator_counts: tuple[int, ...] = (1, 8, 32, 128)
    """Generator counts of the control-plane part."""
    steps: int = 20
    """Train steps per control-plane run (the first is excluded from the steady-state figures)."""
    prompts_per_generator_step: int = 1
    """Prompts per train step per generator in the control-plane part (P = this x G)."""
    prompts_in_flight_per_generator: int = 4
    """Rollout loops per generator (each a prompt of group_size sequences) in the control-plane part."""
    control_max_policy_age: int = 3
    """buffer.max_policy_age of the control-plane part. The gate keeps at most (A + 1) x P prompts
    admitted and not yet trained, the most that can all be trained within the bound at P a step
    (forge_rl/core/admission.py). A + 1 = prompts_in_flight_per_generator (with P = G prompts a step)
    lets every rollout loop hold a prompt: 4,096 sequences at G = 128. The config's A = 2 left a
    quarter of the loops idle (3,072)."""
    control_median_tokens: float = 32.0
    """Median completion length in the control-plane part: short, so a run measures the control
    plane rather than simulated decoding."""
    time_scale: float = 0.1
    """Wall seconds per simulated second in the control-plane and faults parts (0.1: ten times
    faster than the GPUs would; the control plane's own costs then weigh ten times more)."""
    async_time_scale: float = 1.0
    """Wall seconds per simulated second in the async-vs-sync part. 1.0: the GPU-calibrated timings
    as they are (its five runs take about 20 minutes). Faster, the 2 shared cores that run the
    control plane, eight simulated engines and the trainer's process become what limits the
    asynchronous runs, not the schedule (docs/benchmarks/README.md, "scale")."""
    async_generators: int = 8
    """Generators of the async-vs-sync part."""
    async_prompts_per_step: int = 128
    """Prompts per train step of the async-vs-sync part (x group_size 8: 1,024 completions, a
    Qwen3-8B step of about 7.5 s on 8 H100s). A staleness bound counts train steps, and the
    workload's longest completions (cut at 4,096 tokens) take 36-39 s decoded at the batch the
    engines need: at 32 prompts a step (2.26 s) they span 17 steps, so no run that waits for them
    keeps pace below A = 16 (docs/benchmarks/README.md, "scale"); at 128 they fit in the
    A + 1 = 9 steps of the headline A = 8."""
    async_steps: int = 20
    """Train steps per asynchronous run of the async-vs-sync part, the first left out of the
    steady-state figures. An asynchronous run at staleness bound A trains A more, and leaves its
    first A + 1 out: the gate's first fill is admitted at version 0, and those groups' deadlines
    (and their longest completions' stalls) all fall within the first A + 1 steps, a start-up
    transient (docs/benchmarks/README.md, "scale")."""
    async_sync_steps: int = 8
    """Train steps of the async-vs-sync part's synchronous run, the first left out: every step has
    the same shape (its slowest completion, then the train step; about 36 s at 128 prompts)."""
    async_max_policy_age: int = 8
    """Staleness bound A of the asynchronous runs whose figures are the headline ones."""
    async_more_max_policy_ages: tuple[int, ...] = (4,)
    """More staleness bounds, each with its own asynchronous runs (about 3 minutes each at time
    scale 1) against the same synchronous run: `sim_by_max_policy_age` in the figures. At A = 4 the
    workload's longest completions (cut at 4,096 tokens), decoded at the engines' batch, about fill
    the A + 1 = 5 train steps they may span: where the tail starts to set the pace. (At 32 prompts a
    step they kept a waiting run below 0.75 of the bound at A = 8, docs/benchmarks/README.md.)"""
    skip_async_vs_sync: bool = False
    skip_partial_rollouts: bool = False
    """Skip the async-vs-sync part's third run: asynchronous with partial rollouts
    (buffer.wait_for_stragglers false, over-age tokens masked)."""
    fault_generators: int = 128
    """Generators of the faults part: the control plane's largest scale, where a tenth (13) are
    replaced at once while the others serve; about 2 minutes on 2 shared cores (20 takes about
    20 s, docs/benchmarks/README.md)."""
    fault_kill_fraction: float = 0.1
    """Share of the faults part's generators whose processes are SIGKILLed (at least one)."""
    fault_prompts_in_flight_per_generator: int = 2
    """Rollout loops per generator in the faults part: 2, not 4. The gate admits fewer prompts than
    4 x P loops and the loops that win admissions are mostly the same ones, so some generators
    would seldom have a call in progress to lose (docs/benchmarks/README.md, "scale")."""
    fault_seed: int = 0
    """Chooses which generators are killed (`choose_victims`)."""
    fault_steps: int = 20
    """Train steps of the faults run."""
    fault_kill_after_step: int = 5
    """The victims are killed once this step is done."""
    fault_replaced_by_step: int = 10
    """After this step the train loop waits until every victim's replacement serves."""
    fault_recovery_timeout_s: float = 120.0
    """Longest wait for the replacements at fault_replaced_by_step; past it the faults part fails."""
    skip_faults: bool = False
    out_dir: Path = Path("runs/bench-scale")


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


class _Probe:
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
        counted where they were (forge_rl/pipeline/rollouts.py `stop`): in the buffer (admitted, reached it,
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
    """Run `config` in this process with the probe (and `after_step`, see `_Probe.install`);
    returns its figures (steady state: after `warmup_steps`) and the run directory."""
    from forge_rl.run.recipes import recipe

    probe = _Probe(warmup_steps)
    restore = probe.install(after_step)

    async def measured():
        watcher = asyncio.create_task(watch_event_loop_lag(probe.lags_s))
        try:
            return await recipe("grpo")(config)
        finally:
            watcher.cancel()

    # Each in a process of its own: the machine's floor (the lag probe in a process that does
    # nothing else), and the generators' memory. Sampling 128 processes' memory from a thread of
    # this one held the GIL for tens of milliseconds every half second: that was most of the
    # controller's measured lag at G = 128.
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
        [sys.executable, "-c", f"import json; from forge_rl.bench import scale; print(json.dumps(scale.{call}))"],
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


def control_plane(base: GRPOConfig, args: ScaleArgs, num_generators: int) -> dict:
    config = control_plane_config(base, args, num_generators, args.out_dir / f"g{num_generators}", args.steps)
    started = time.monotonic()
    figures, run_path = run_probed(config)
    return {
        "num_generators": num_generators,
        "prompts_per_step": config.prompts_per_step,
        **figures,
        "max_concurrent_rollouts": max_concurrent_sequences(run_path),
        "run_s": time.monotonic() - started,
    }


def async_vs_sync(base: GRPOConfig, args: ScaleArgs) -> dict:
    """Both modes on the GPU-calibrated long-tail workload; the analytic bound from the sync run.
    The asynchronous runs at `async_max_policy_age` give the headline figures; those at each of
    `async_more_max_policy_ages` go under `sim_by_max_policy_age`, against the same sync run."""
    progress(f"bench scale: sync run, {args.async_generators} simulated generators")
    sync_steady, sync_run = run_probed(
        _async_part_config(base, args, "sync", 0, wait_for_stragglers=True, steps=args.async_sync_steps)
    )
    sync = analyze(sync_run, args.async_generators, target_reward=math.inf)
    sync["steady_wall_per_step_s"] = 1.0 / sync_steady["steps_per_s"]
    sync["steady_trained_tokens_per_step"] = steady_trained_tokens_per_step(read_metrics(sync_run), warmup_steps=1)
    per_age = {}
    for max_policy_age in (args.async_max_policy_age, *args.async_more_max_policy_ages):
        suffix = "" if max_policy_age == args.async_max_policy_age else f"_A{max_policy_age}"
        # async_partial: the asynchronous run with partial rollouts (buffer.wait_for_stragglers
        # false): the trainer never waits for a straggler; one that misses its last step under the
        # age bound is trained later with its over-age tokens masked.
        variants = (("async", True),) + ((("async_partial", False),) if not args.skip_partial_rollouts else ())
        runs, steady = {}, {}
        for mode, wait_for_stragglers in variants:
            progress(f"bench scale: {mode} run, A = {max_policy_age}, {args.async_generators} simulated generators")
            # The same steady-state steps in every asynchronous run: after its first A + 1.
            config = _async_part_config(
                base, args, mode + suffix, max_policy_age, wait_for_stragglers, steps=args.async_steps + max_policy_age
            )
            steady[mode], runs[mode] = run_probed(config, warmup_steps=max_policy_age + 1)
        per_age[max_policy_age] = _async_figures(config, max_policy_age, sync, runs, steady, args.async_generators)
    figures = dict(per_age[args.async_max_policy_age])
    figures["sim_by_max_policy_age"] = {
        str(age): {key: value for key, value in age_figures.items() if key not in ("sync", "async", "async_partial")}
        for age, age_figures in per_age.items()
    }
    return figures


def _async_part_config(
    base: GRPOConfig, args: ScaleArgs, mode: str, max_policy_age: int, wait_for_stragglers: bool, steps: int
) -> GRPOConfig:
    prompts_per_step = args.async_prompts_per_step
    return dataclasses.replace(
        base,
        run_dir=args.out_dir / "async_vs_sync" / mode,
        run_name=None,
        steps=steps,
        num_generators=args.async_generators,
        train_batch_size=prompts_per_step * base.group_size,
        # Every loop can hold a prompt of the (A + 1) x P the gate admits at most.
        prompts_in_flight_per_generator=max(
            base.prompts_in_flight_per_generator, -(-(max_policy_age + 1) * prompts_per_step // args.async_generators)
        ),
        # At the same priority as the rest: eight stand-ins take little of the cores, and their
        # answers are the simulated GPUs' pace, which an idle-priority process behind a busy
        # core delays (partial rollouts 0.807 of the bound against 0.838, docs/benchmarks/README.md).
        generator=dataclasses.replace(
            base.generator,
            sim=dataclasses.replace(base.generator.sim, time_scale=args.async_time_scale, idle_priority=False),
        ),
        trainer=dataclasses.replace(
            base.trainer, sim=dataclasses.replace(base.trainer.sim, time_scale=args.async_time_scale)
        ),
        buffer=dataclasses.replace(
            base.buffer,
            max_policy_age=max_policy_age,
            capacity_episodes=max(base.buffer.capacity_episodes, (max_policy_age + 2) * prompts_per_step),
            wait_for_stragglers=wait_for_stragglers,
            drop_policy=base.buffer.drop_policy if wait_for_stragglers else "mask_tokens",
        ),
    )


def _async_figures(
    config: GRPOConfig,
    max_policy_age: int,
    sync: dict,
    runs: dict[str, Path],
    steady: dict[str, dict],
    num_generators: int,
) -> dict:
    """The asynchronous runs at one staleness bound (`runs`: "async", and "async_partial" unless
    skipped; `config`: theirs) against the synchronous run's analysis `sync` and its bounds."""
    # The timeline analysis of bench async-vs-sync (busy times, pipeline efficiency); no reward to
    # time: a simulation learns nothing.
    per_mode = {mode: analyze(path, num_generators, target_reward=math.inf) for mode, path in runs.items()}
    metrics = {mode: read_metrics(path) for mode, path in runs.items()}
    asynchronous = per_mode["async"]
    # Steady state: the first step (the first fill) excluded, as in the control-plane figures.
    wall_per_step = {"sync": sync["steady_wall_per_step_s"]}
    wall_per_step.update({mode: 1.0 / figures["steps_per_s"] for mode, figures in steady.items()})
    speedup = wall_per_step["sync"] / wall_per_step["async"]
    # The analytic bound, from the sync run's own busy times (docs/benchmarks/README.md): a synchronous
    # step is the straggler's generation then the train step; an asynchronous one can be no
    # shorter than the train step, than the generation work, or than the straggler spread over the
    # A + 1 versions it may span.
    sync_train = sync["trainer_busy_s"] / sync["steps"]
    sync_generate = wall_per_step["sync"] - sync_train
    generate = _generation_s(config, sync["generated_tokens_per_s"] * sync["wall_per_step_s"])
    async_floor = max(sync_train, generate, sync_generate / (max_policy_age + 1))
    bound = wall_per_step["sync"] / async_floor
    # The bound above takes the generation term at the largest batch and the straggler term at the
    # synchronous run's speed, which no single batch size gives at once; this one holds both to the
    # same batch (the best one): what any policy that keeps its engines' batches equal can reach.
    tokens_per_step = sync["generated_tokens_per_s"] * sync["wall_per_step_s"]
    longest = expected_longest_completion(config)
    uniform_floor, uniform_batch = uniform_batch_floor(config, tokens_per_step, sync_train, max_policy_age, longest)
    uniform_bound = wall_per_step["sync"] / uniform_floor
    # What no run that waits for its stragglers can beat, however it schedules: the bound's terms
    # with the straggler's taken at the longest completion of A + 1 steps, decoded alone.
    window_floor, window_longest = waiting_straggler_floor(config, max_policy_age)
    waiting_bound = wall_per_step["sync"] / max(async_floor, window_floor)
    # The same bound in tokens that reached the loss per second (a step of the bound trains the
    # synchronous step's tokens): a run that masks or drops tokens trains fewer per step, and its
    # steps per second alone would count the masked ones as trained.
    trained_per_step = {
        mode: steady_trained_tokens_per_step(run_metrics, warmup_steps=max_policy_age + 1)
        for mode, run_metrics in metrics.items()
    }
    bound_tokens_per_s = sync["steady_trained_tokens_per_step"] / async_floor

    def token_efficiency(mode: str) -> float:
        return trained_per_step[mode] / wall_per_step[mode] / bound_tokens_per_s

    partial = {}
    if "async_partial" in runs:
        # Against the same bound: its straggler term bounds a run that waits for stragglers, so
        # one that does not can only come closer to the others.
        masking = whole_group_masking_ceiling(config, tokens_per_step, sync_train, max_policy_age)
        partial_speedup = wall_per_step["sync"] / wall_per_step["async_partial"]
        last = metrics["async_partial"][-1]
        partial = {
            "sim_partial_async_speedup": partial_speedup,
            "sim_partial_efficiency_vs_bound": partial_speedup / bound,
            "sim_partial_token_efficiency_vs_bound": token_efficiency("async_partial"),
            # What a run that trains whole groups can reach in trained tokens with uniform batches.
            "sim_partial_token_efficiency_ceiling": masking["ceiling"],
            "sim_partial_ceiling_batch_sequences": masking["batch"],
            "sim_partial_ceiling_masked_fraction": masking["masked_fraction"],
            "sim_partial_ceiling_masked_by_own_length_fraction": masking["masked_by_own_length_fraction"],
            "sim_partial_async_wall_per_step_s": wall_per_step["async_partial"],
            # Generated tokens that reached no loss: over-age tokens masked, completions dropped.
            "sim_partial_dropped_token_fraction": last["buffer/dropped_tokens"] / last[GENERATED_TOKENS_TOTAL],
            "sim_partial_trainer_idle_fraction": per_mode["async_partial"]["trainer_idle_fraction"],
            "async_partial": per_mode["async_partial"],
        }
    return {
        "sim_max_policy_age": max_policy_age,
        "sim_async_warmup_steps": max_policy_age + 1,
        "sim_async_speedup": speedup,
        "sim_async_speedup_bound": bound,
        "sim_efficiency_vs_bound": speedup / bound,
        "sim_token_efficiency_vs_bound": token_efficiency("async"),
        "sim_bound_trained_tokens_per_s": bound_tokens_per_s,
        "sim_async_speedup_waiting_bound": waiting_bound,
        "sim_efficiency_vs_waiting_bound": speedup / waiting_bound,
        "sim_waiting_straggler_floor_s": window_floor,
        "sim_expected_longest_completion_in_age_window_tokens": window_longest,
        "sim_async_speedup_uniform_batch_bound": uniform_bound,
        "sim_efficiency_vs_uniform_batch_bound": speedup / uniform_bound,
        "sim_uniform_batch_floor_s": uniform_floor,
        "sim_uniform_batch_sequences": uniform_batch,
        "sim_expected_longest_completion_tokens": longest,
        "sim_pipeline_efficiency": asynchronous["pipeline_efficiency"],
        "sim_async_trainer_idle_fraction": asynchronous["trainer_idle_fraction"],
        "sim_sync_wall_per_step_s": wall_per_step["sync"],
        "sim_async_wall_per_step_s": wall_per_step["async"],
        "sim_train_step_s": sync_train,
        "sim_async_floor_s": async_floor,
        "sim_generation_s": generate,
        "sync": sync,
        "async": asynchronous,
        **partial,
    }


def steady_trained_tokens_per_step(metrics: list[dict], warmup_steps: int) -> float:
    """Mean tokens that reached the loss per step (`num_tokens`: masked tokens excluded), over the
    steps after the first `warmup_steps`, as the steady-state step times."""
    steady = metrics[warmup_steps:] or metrics
    return sum(m["num_tokens"] for m in steady) / len(steady)


def _decode_step_s(config: GRPOConfig, batch: int, mean_completion: float) -> float:
    """Wall seconds of one simulated decode step of `batch` sequences, each holding a prompt and
    half a completion of mean length `mean_completion` (its mean context over its life)."""
    sim = config.generator.sim
    return sim.latency.step_s(batch, int(batch * (8 + mean_completion / 2))) * sim.time_scale


def _generation_s(config: GRPOConfig, tokens_per_step: float) -> float:
    """Wall seconds the engines need for one step's tokens at the batch the asynchronous run keeps
    (every rollout loop's group in flight): tokens / (G x B / step_s(B, B x c)), with B sequences
    per engine and c the mean context of a sequence (prompt + half a completion)."""
    batch = min(config.prompts_in_flight_per_generator * config.group_size, config.generator.max_num_seqs)
    return _batch_timing(config, tokens_per_step, batch)[1]


def _batch_timing(config: GRPOConfig, tokens_per_step: float, batch: int) -> tuple[float, float]:
    """At `batch` sequences per engine: (its decode step step_s(B), the engines' time Gen(B) for a
    step's `tokens_per_step`)."""
    mean_completion = tokens_per_step / (config.prompts_per_step * config.group_size)
    step_s = _decode_step_s(config, batch, mean_completion)
    return step_s, tokens_per_step / (config.num_generators * batch) * step_s


def expected_longest_completion(config: GRPOConfig, num_steps: int = 1) -> float:
    """Expected longest of `num_steps` steps' P x group_size simulated completion lengths each (n in
    all; log-normal, median m, sigma s, cut at generator.max_new_tokens L): E[max] = integral over
    0..L of 1 - F(x)^n dx, F the log-normal's distribution function."""
    sim, cut = config.generator.sim, config.generator.max_new_tokens
    n = num_steps * config.prompts_per_step * config.group_size

    def below(x: float) -> float:
        if x <= 0:
            return 0.0
        if sim.length_sigma == 0:
            return float(x >= sim.length_median_tokens)
        return 0.5 * (1 + math.erf(math.log(x / sim.length_median_tokens) / (sim.length_sigma * math.sqrt(2))))

    points = 4096
    width = cut / points
    return sum((1 - below((k + 0.5) * width) ** n) * width for k in range(points))


def uniform_batch_floor(
    config: GRPOConfig, tokens_per_step: float, train_s: float, max_policy_age: int, longest: float
) -> tuple[float, int]:
    """The asynchronous step's floor when every engine decodes batches of one size B, whichever B
    is best (docs/benchmarks/README.md): min over B of max(T, Gen(B), Lmax x step_s(B) / (A + 1)). A larger
    batch generates a step's tokens sooner (Gen falls) but decodes each sequence's tokens slower,
    the step's longest completion (`longest` = Lmax tokens, `expected_longest_completion`, which
    must be trained within A + 1 versions of its admission) among them. Returns (floor, B)."""
    floors = [
        (max(train_s, generate, longest * step_s / (max_policy_age + 1)), batch)
        for batch, step_s, generate in _uniform_batches(config, tokens_per_step)
    ]
    return min(floors)


def _uniform_batches(config: GRPOConfig, tokens_per_step: float):
    """For each batch size B an engine may keep: (B, step_s(B), Gen(B)), as `_batch_timing`."""
    for batch in range(1, config.generator.max_num_seqs + 1):
        yield batch, *_batch_timing(config, tokens_per_step, batch)


def waiting_straggler_floor(config: GRPOConfig, max_policy_age: int) -> tuple[float, float]:
    """A floor on the asynchronous step of any run that trains every admitted group whole within
    A + 1 versions of its admission and waits for its stragglers, however it schedules: the
    longest of A + 1 steps' completions (Lwin tokens, `expected_longest_completion`) decodes no
    faster than alone on its engine (batch 1, the latency model's fastest step), from its first
    token to its last, and the A + 1 steps it may span must last that long:
    Lwin x step_s(1) / (A + 1). Even a scheduler that knew every length in advance meets it; one
    that does not decodes the straggler among others, slower. Returns (floor, Lwin)."""
    longest = expected_longest_completion(config, num_steps=max_policy_age + 1)
    return longest * _decode_step_s(config, 1, longest) / (max_policy_age + 1), longest


def whole_group_masking_ceiling(
    config: GRPOConfig, tokens_per_step: float, train_s: float, max_policy_age: int, groups: int = 20_000, seed: int = 0
) -> dict:
    """What partial rollouts (over-age tokens masked) can reach in tokens that reached the loss,
    when a group trains only once its last completion ends (GRPO's baseline needs all of it) and
    every engine decodes batches of one size B: a token may be at most A versions old when trained,
    so of a group whose last completion ends late, the tokens of every member generated more than
    (A + 1) x step before that end are masked, the short members' included. For each B, the step
    is max(T, Gen(B)), a sequence gains a token per decode step step_s(B), and the masked fraction
    is measured on `groups` groups of the simulated lengths (`SimEngineConfig.draw_length`, seeded);
    the ceiling is the best B's (trained tokens per second over the bound's, at most 1 per step).
    A scheduler that decoded the long completions on emptier engines could mask less; one that
    trains no group whole is not GRPO. Returns the ceiling, its B, its masked fraction, and the
    masked fraction by each completion's own length alone (what the group's wait adds is the rest)."""
    import numpy as np

    sim, cut, size = config.generator.sim, config.generator.max_new_tokens, config.group_size
    rng = random.Random(seed)
    lengths = np.array([[sim.draw_length(rng, cut) for _ in range(size)] for _ in range(groups)], dtype=float)
    group_end = lengths.max(axis=1, keepdims=True)
    total = lengths.sum()
    best = None
    for batch, token_s, generate in _uniform_batches(config, tokens_per_step):
        step_s = max(train_s, generate)
        window = (max_policy_age + 1) * step_s / token_s  # tokens a sequence gains while A + 1 steps pass
        masked = np.minimum(lengths, np.maximum(group_end - window, 0.0)).sum() / total
        ceiling = train_s / step_s * (1.0 - masked)
        if best is None or ceiling > best[0]:
            own = np.minimum(lengths, np.maximum(lengths - window, 0.0)).sum() / total
            best = (ceiling, batch, masked, own)
    assert best is not None  # generator.max_num_seqs >= 1: at least one batch size
    ceiling, batch, masked, own = best
    return {
        "ceiling": float(ceiling),
        "batch": batch,
        "masked_fraction": float(masked),
        "masked_by_own_length_fraction": float(own),
    }


def lost_prompts(accounting: dict, held_at_stop: dict) -> int:
    """Prompts handed out that are neither trained, filtered, skipped, dropped (each counted with
    its reason by the run's accounting) nor held when the run ended (`_Probe.held_at_stop`).
    unfinished_at_stop is the accounting's remainder; the held prompts are counted apart, so a
    prompt a dead generator took with it shows here (and a prompt counted twice as a negative)."""
    return accounting["unfinished_at_stop"] - sum(held_at_stop.values())


def judge_accounting(record: dict, steps: int) -> bool:
    """Every step trained a full batch of distinct prompts, none twice, and every prompt handed
    out is accounted for (`lost_prompts` is 0)."""
    accounting = record["accounting"]
    return (
        accounting["trained"] == steps * record["prompts_per_step"]
        and accounting["trained_more_than_once"] == 0
        and lost_prompts(accounting, record["held_at_stop"]) == 0
    )


def choose_victims(num_generators: int, fraction: float, seed: int) -> list[int]:
    """The generators to kill: round(fraction x num_generators) of them (at least one), drawn
    from `seed`, so a rerun kills the same ones."""
    count = min(num_generators, max(1, round(fraction * num_generators)))
    return sorted(random.Random(seed).sample(range(num_generators), count))


_IN_FLIGHT_WAIT_S = 10.0
"""Longest wait, once the kill step is done, for a victim to be generating; past it, it is killed anyway."""


class _Faults:
    """Driven by train steps (the probe's `after_step`), never by a clock: once `kill_after_step`
    is done, each victim is SIGKILLed (every process of it: the generator actor's and any engine
    process below it) as soon as it has a generate call in progress, so the kill takes prompts
    with it; the train loop goes on meanwhile (holding it would starve the generators of
    admissions). After `replaced_by_step` the train loop waits until each victim was detected and
    serves again."""

    def __init__(self, victims: list[int], kill_after_step: int, replaced_by_step: int, recovery_timeout_s: float):
        self.victims = victims
        self.kill_after_step, self.replaced_by_step = kill_after_step, replaced_by_step
        self.recovery_timeout_s = recovery_timeout_s
        self.killed_at: dict[int, float] = {}
        """Victim -> when its processes were SIGKILLed (time.time(), the pool's clock)."""
        self.killed_pids: list[int] = []
        self._kills: list[asyncio.Task] = []

    async def after_step(self, probe: _Probe, step: int) -> None:
        if probe.actors is None:
            raise RuntimeError("bench scale: a train step ended before the probe saw the run's actors")
        pool = probe.actors.generators
        if step == self.kill_after_step:
            pids = await pool.processes.call_one()
            if not all(pids[index] for index in self.victims):
                raise RuntimeError(f"the pool knows no process of some of generators {self.victims}: {pids}")
            self._kills = [asyncio.create_task(self._kill(index, pids[index], pool)) for index in self.victims]
        if step == self.replaced_by_step:
            await within(
                self.recovery_timeout_s,
                self._replaced(pool),
                lambda: TimeoutError(
                    f"generators {self.victims} were not replaced within --fault-recovery-timeout-s "
                    f"({self.recovery_timeout_s:g} s) of step {step}"
                ),
            )

    async def _kill(self, index: int, pids: list[int], pool) -> None:
        processes = [psutil.Process(pid) for pid in pids]
        try:
            async with asyncio.timeout(_IN_FLIGHT_WAIT_S):
                while not (await pool.generate_calls_in_flight.call_one())[index]:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            progress(f"bench scale: generator {index} was not generating within {_IN_FLIGHT_WAIT_S:g} s; killed idle")
        self.killed_at[index] = time.time()
        kill_trees(processes)  # in the turn that saw the call in progress
        self.killed_pids += pids
        progress(f"bench scale: killed generator {index} (pids {pids})")

    async def _replaced(self, pool) -> None:
        await asyncio.gather(*self._kills)
        # Detection is the pool's own process poll (every 0.5 s); until it ran, a victim's slot
        # still reads as serving, so wait for its recovery event first.
        while {event["generator"] for event in await pool.recovery_events.call_one()} < set(self.victims):
            await asyncio.sleep(0.1)
        await asyncio.gather(*(pool.wait_until_serving.call_one(index) for index in self.victims))


def fault_figures(record: dict, victims: list[int], killed_at: dict[int, float]) -> dict:
    """What the faults run showed, from its summary (`record`, as run_probed returns it)."""
    events: dict[int, dict] = {}
    for event in record["generator_recoveries"]:  # the first recovery of each generator
        events.setdefault(event["generator"], event)
    detected = [events[i] for i in victims if i in events]
    replaced = [event for event in detected if "serving_at" in event]
    accounting = record["accounting"]
    return {
        "faults_generators": record["num_generators"],
        "faults_killed": len(victims),
        "faults_victims": victims,
        "faults_detected": len(detected),
        "faults_replaced": len(replaced),
        "faults_other_recoveries": len(record["generator_recoveries"]) - len(detected),
        "faults_detection_s": [event["detected_at"] - killed_at[event["generator"]] for event in detected],
        "faults_replacement_s": [event["serving_at"] - event["detected_at"] for event in replaced],
        "faults_steps_completed": record["steps"],
        "faults_prompts_requeued": accounting["requeued_after_generator_failure"],
        "faults_trained_twice": accounting["trained_more_than_once"],
        "faults_lost": lost_prompts(accounting, record["held_at_stop"]),
        "faults_accounting_ok": judge_accounting(record, record["steps_wanted"]),
        "faults_all_replaced": len(replaced) == len(victims),
    }


def faults(base: GRPOConfig, args: ScaleArgs) -> dict:
    """The control-plane workload at fault_generators generators, a tenth of them killed mid-run."""
    victims = choose_victims(args.fault_generators, args.fault_kill_fraction, args.fault_seed)
    config = dataclasses.replace(
        control_plane_config(base, args, args.fault_generators, args.out_dir / "faults", args.fault_steps),
        prompts_in_flight_per_generator=args.fault_prompts_in_flight_per_generator,
    )
    driver = _Faults(victims, args.fault_kill_after_step, args.fault_replaced_by_step, args.fault_recovery_timeout_s)
    started = time.monotonic()
    figures, _ = run_probed(config, after_step=driver.after_step)
    record = {
        "num_generators": config.num_generators,
        "prompts_per_step": config.prompts_per_step,
        "steps_wanted": config.steps,
        **figures,
        "killed_pids": driver.killed_pids,
        "run_s": time.monotonic() - started,
    }
    return {**fault_figures(record, victims, driver.killed_at), "faults_run": record}


def main(args: ScaleArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    if not base.simulated:
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"{args.config} runs the real engine (generator.engine {base.generator.engine}); bench scale runs "
            "simulations only. Pass --config configs/sim_scale.yaml."
        )
    if not args.skip_faults and not 0 < args.fault_kill_after_step < args.fault_replaced_by_step < args.fault_steps:
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"fault_kill_after_step ({args.fault_kill_after_step}) < fault_replaced_by_step "
            f"({args.fault_replaced_by_step}) < fault_steps ({args.fault_steps}) must hold, so the victims are killed "
            "mid-run and the run trains on with their replacements. Fix --fault-kill-after-step, "
            "--fault-replaced-by-step or --fault-steps, or pass --skip-faults."
        )
    ages = (args.async_max_policy_age, *args.async_more_max_policy_ages)
    if not args.skip_async_vs_sync and (min(ages) < 1 or len(set(ages)) < len(ages)):
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"The async-vs-sync part's staleness bounds (async_max_policy_age {args.async_max_policy_age}, "
            f"async_more_max_policy_ages {list(args.async_more_max_policy_ages)}) must be distinct and >= 1 (A = 0 "
            "is the synchronous run, made anyway). Fix --async-max-policy-age or --async-more-max-policy-ages "
            "(pass it with no value for none)."
        )
    if not args.skip_async_vs_sync and (
        min(args.async_steps, args.async_sync_steps) < 2 or args.async_prompts_per_step < 1
    ):
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"async_steps ({args.async_steps}) and async_sync_steps ({args.async_sync_steps}) must be >= 2 (each "
            f"run's first step is left out of its figures) and async_prompts_per_step ({args.async_prompts_per_step}) "
            ">= 1. Fix --async-steps, --async-sync-steps or --async-prompts-per-step."
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    per_count = []
    for num_generators in args.generator_counts:
        progress(f"bench scale: control plane with {num_generators} simulated generators")
        try:
            per_count.append(control_plane(base, args, num_generators))
        except Exception as e:  # recorded: how many generators fit is one of the figures
            progress(f"bench scale: {num_generators} generators failed: {type(e).__name__}: {e}")
            per_count.append({"num_generators": num_generators, "error": f"{type(e).__name__}: {e}"})
        (args.out_dir / "scale.json").write_text(json.dumps({"control_plane": per_count}, indent=2))
    ok = [r for r in per_count if "error" not in r]
    summary = {
        "simulated": True,
        "date": time.strftime("%Y-%m-%d"),
        "generator_counts": [r["num_generators"] for r in per_count],
        "controller_calls_per_step": [r.get("controller_calls_per_step") for r in per_count],
        "rollouts_calls_per_step": [r.get("rollouts_calls_per_step") for r in per_count],
        "steps_per_s": [r.get("steps_per_s") for r in per_count],
        "event_loop_lag_p99_ms": [r.get("event_loop_lag_p99_ms") for r in per_count],
        "controller_event_loop_lag_p99_ms": [r.get("controller_event_loop_lag_p99_ms") for r in per_count],
        "rollouts_event_loop_lag_p99_ms": [r.get("rollouts_event_loop_lag_p99_ms") for r in per_count],
        "idle_process_event_loop_lag_p99_ms": [r.get("idle_process_event_loop_lag_p99_ms") for r in per_count],
        "max_concurrent_rollouts": [r.get("max_concurrent_rollouts") for r in per_count],
        "generator_rss_mib": [r.get("generator_rss_mib") for r in per_count],
        "max_generators_sustained": max((r["num_generators"] for r in ok), default=0),
        "max_concurrent_rollouts_sustained": max((r["max_concurrent_rollouts"] for r in ok), default=0),
        "accounting_ok": all(judge_accounting(r, args.steps) for r in ok),
        "time_scale": args.time_scale,
        "async_time_scale": args.async_time_scale,
        # The generators' processes yield the cores to the control plane (SimEngineConfig.idle_priority)
        # in the control-plane and faults parts; the async-vs-sync part runs them as the rest.
        "sim_generators_idle_priority": base.generator.sim.idle_priority,
        "control_plane": per_count,
    }
    if not args.skip_async_vs_sync:
        summary.update(async_vs_sync(base, args))
    if not args.skip_faults:
        progress(f"bench scale: faults, {args.fault_generators} simulated generators, a tenth killed")
        try:
            summary.update(faults(base, args))
        except Exception as e:  # recorded, like a generator count that failed: the JSON line says why
            progress(f"bench scale: the faults run failed: {type(e).__name__}: {e}")
            summary.update(faults_error=f"{type(e).__name__}: {e}", faults_accounting_ok=False)
    (args.out_dir / "scale.json").write_text(json.dumps(summary, indent=2))
    return summary
