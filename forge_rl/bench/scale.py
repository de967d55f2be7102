"""`forge-rl bench scale`: the control plane at scale, on SIMULATED engines and trainer.

Every run is the GRPO recipe with real Monarch actors on this machine (dataset, scorer, buffer, the
generator pool and one process per generator, the trainer mesh), but with `generator.engine sim`
and `trainer.engine sim` (forge_rl/engines/simulated.py): no model runs, tokens are placeholders,
decode and train steps are timed waits. What is measured is forge_rl's own work.

1. Control-plane overhead at each generator count G (`--generator-counts`), with a zero-cost
   trainer step and prompts per step P = prompts_per_generator_step x G, so every generator has work:
       controller_calls_per_step   endpoint calls the controller process makes per train step,
                                   counted at the loops' actor handles (loop.RunActors) in the
                                   steady state (first step excluded); the pool's relay to each
                                   generator and the store's messages are not in it
       steps_per_s                 train steps per second in the steady state
       event_loop_lag_p99_ms       how late a 10 ms timer on the controller's event loop fires, p99
       max_concurrent_rollouts     most sequences decoding at once over all generators (timeline)
       generator_rss_mib           resident memory of one generator process (its actor and the
                                   simulated engine in it), the mean over generators
2. Async vs sync on a long-tail workload with the default GPU calibration (Qwen3-8B decode on one
   H100 per generator, a Qwen3-8B step on 8 H100s): forge-rl bench async-vs-sync's analysis of both
   runs (speedup, pipeline efficiency), and the analytic bound of docs/benchmarks.md:
       sync step  = straggler + train          (the slowest completion of the step's batch, then the step)
       async step >= max(train, generate, straggler / (A + 1))
   where generate is the step's tokens over the engines' throughput at full batch and A the
   staleness bound; `sim_efficiency_vs_bound` = the bound's speedup achieved.

Figures go to OUT_DIR/scale.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from forge_rl.bench.async_vs_sync import analyze
from forge_rl.config import GRPOConfig
from forge_rl.metrics import progress
from forge_rl.timeline import Timeline

_LAG_PROBE_S = 0.010
"""Period of the event-loop lag probe: a timer that should fire every 10 ms."""


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
    control_median_tokens: float = 32.0
    """Median completion length in the control-plane part: short, so a run measures the control
    plane rather than simulated decoding."""
    time_scale: float = 0.1
    """Wall seconds per simulated second, both parts (0.1: ten times faster than the GPUs would)."""
    async_generators: int = 8
    """Generators of the async-vs-sync part."""
    async_steps: int = 30
    """Train steps per run of the async-vs-sync part."""
    async_max_policy_age: int = 8
    """Staleness bound A of the asynchronous run."""
    skip_async_vs_sync: bool = False
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


class _Probe:
    """What one run's controller does, seen from inside its process: endpoint calls per step
    (counted at the loops' actor handles), the event loop's lag, generator processes' memory."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.step_marks: list[tuple[int, float, int]] = []
        """(step, monotonic time, calls so far) after each train step."""
        self.lags_s: list[float] = []
        self.generator_rss: list[float] = []

    def install(self):
        """Count the calls of every Pipeline built from now on (the recipe builds one)."""
        from forge_rl import loop

        probe, original_init, original_step = self, loop.Pipeline.__init__, loop.Pipeline._finish_step

        def init(pipeline, config, actors):
            score, stats = actors.score, actors.stats

            async def counted_score(episodes, timeline):
                probe.counts["score (recipe stage: scorer.score)"] += 1
                return await score(episodes, timeline)

            async def counted_stats():
                probe.counts["stats (recipe: scorer.stats)"] += 1
                return await stats()

            counted = dataclasses.replace(
                actors,
                **{name: _CountingActor(getattr(actors, name), probe.counts, name)
                   for name in ("dataset", "generators", "buffer", "trainer")},
                score=counted_score,
                stats=counted_stats,
            )
            original_init(pipeline, config, counted)

        async def finish_step(pipeline, sent, lifecycle, weight_updates):
            result = await original_step(pipeline, sent, lifecycle, weight_updates)
            probe.step_marks.append((sent.step, time.monotonic(), sum(probe.counts.values())))
            return result

        loop.Pipeline.__init__, loop.Pipeline._finish_step = init, finish_step
        return lambda: setattr(loop.Pipeline, "__init__", original_init) or setattr(
            loop.Pipeline, "_finish_step", original_step
        )

    async def watch_lag(self) -> None:
        """How late a timer fires on the controller's event loop, every _LAG_PROBE_S."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + _LAG_PROBE_S
            await asyncio.sleep(_LAG_PROBE_S)
            self.lags_s.append(max(0.0, loop.time() - due))

    def watch_memory(self, run_root: Path, stop: threading.Event) -> None:
        """In a thread, so sampling many processes never delays the event loop it measures:
        once the run wrote processes.json, its generators' resident memory every 0.5 s."""
        while not stop.wait(0.5):
            self._sample_rss(run_root)

    def _sample_rss(self, run_root: Path) -> None:
        for path in run_root.glob("*/processes.json"):
            pids = [pids[0] for pids in json.loads(path.read_text())["generators"] if pids]
            rss = []
            for pid in pids:
                try:
                    rss.append(psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass
            if rss:
                self.generator_rss.append(statistics.mean(rss))

    def steady(self) -> dict:
        """Figures over the steps after the first (its fill and start-up calls excluded)."""
        (first_step, first_t, first_calls), (last_step, last_t, last_calls) = self.step_marks[0], self.step_marks[-1]
        steps = max(last_step - first_step, 1)
        lags = sorted(self.lags_s)
        return {
            "controller_calls_per_step": (last_calls - first_calls) / steps,
            "steps_per_s": steps / max(last_t - first_t, 1e-9),
            "event_loop_lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None,
            "generator_rss_mib": max(self.generator_rss) / 2**20 if self.generator_rss else None,
            "calls_by_endpoint_total": dict(self.counts),
        }


def run_probed(config: GRPOConfig) -> tuple[dict, Path]:
    """Run `config` in this process with the probe; returns its figures and the run directory."""
    from forge_rl.recipes import recipe

    probe = _Probe()
    restore = probe.install()

    async def measured():
        watcher = asyncio.create_task(probe.watch_lag())
        try:
            return await recipe("grpo")(config)
        finally:
            watcher.cancel()

    stop = threading.Event()
    memory = threading.Thread(target=probe.watch_memory, args=(config.run_dir, stop), daemon=True)
    memory.start()
    try:
        summary = asyncio.run(measured())
    finally:
        stop.set()
        memory.join()
        restore()
    return {**probe.steady(), "simulated": summary["simulated"], "accounting": summary["accounting"]}, Path(
        summary["run_dir"]
    )


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


def control_plane(base: GRPOConfig, args: ScaleArgs, num_generators: int) -> dict:
    prompts_per_step = args.prompts_per_generator_step * num_generators
    config = dataclasses.replace(
        base,
        run_dir=args.out_dir / f"g{num_generators}",
        run_name=None,
        steps=args.steps,
        num_generators=num_generators,
        prompts_in_flight_per_generator=args.prompts_in_flight_per_generator,
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
            base.buffer, capacity_episodes=max(base.buffer.capacity_episodes, 4 * prompts_per_step)
        ),
    )
    started = time.monotonic()
    figures, run_path = run_probed(config)
    return {
        "num_generators": num_generators,
        "prompts_per_step": prompts_per_step,
        **figures,
        "max_concurrent_rollouts": max_concurrent_sequences(run_path),
        "run_s": time.monotonic() - started,
    }


def async_vs_sync(base: GRPOConfig, args: ScaleArgs) -> dict:
    """Both modes on the GPU-calibrated long-tail workload; the analytic bound from the sync run."""
    runs, steady = {}, {}
    for mode, max_policy_age in (("sync", 0), ("async", args.async_max_policy_age)):
        progress(f"bench scale: {mode} run, {args.async_generators} simulated generators")
        config = dataclasses.replace(
            base,
            run_dir=args.out_dir / "async_vs_sync" / mode,
            run_name=None,
            steps=args.async_steps,
            num_generators=args.async_generators,
            prompts_in_flight_per_generator=max(
                base.prompts_in_flight_per_generator,
                -(-(max_policy_age + 1) * base.prompts_per_step // args.async_generators),
            ),
            generator=dataclasses.replace(
                base.generator, sim=dataclasses.replace(base.generator.sim, time_scale=args.time_scale)
            ),
            trainer=dataclasses.replace(base.trainer, sim=dataclasses.replace(base.trainer.sim, time_scale=args.time_scale)),
            buffer=dataclasses.replace(
                base.buffer,
                max_policy_age=max_policy_age,
                capacity_episodes=max(base.buffer.capacity_episodes, (max_policy_age + 2) * base.prompts_per_step),
            ),
        )
        steady[mode], runs[mode] = run_probed(config)
    # The timeline analysis of bench async-vs-sync (busy times, pipeline efficiency); no reward to
    # time: a simulation learns nothing.
    per_mode = {mode: analyze(path, args.async_generators, target_reward=math.inf) for mode, path in runs.items()}
    sync, asynchronous = per_mode["sync"], per_mode["async"]
    # Steady state: the first step (the first fill) excluded, as in the control-plane figures.
    wall_per_step = {mode: 1.0 / figures["steps_per_s"] for mode, figures in steady.items()}
    speedup = wall_per_step["sync"] / wall_per_step["async"]
    # The analytic bound, from the sync run's own busy times (docs/benchmarks.md): a synchronous
    # step is the straggler's generation then the train step; an asynchronous one can be no
    # shorter than the train step, than the generation work, or than the straggler spread over the
    # A + 1 versions it may span.
    sync_train = sync["trainer_busy_s"] / sync["steps"]
    sync_generate = wall_per_step["sync"] - sync_train
    generate = _generation_s(config, sync["generated_tokens_per_s"] * sync["wall_per_step_s"])
    async_floor = max(sync_train, generate, sync_generate / (args.async_max_policy_age + 1))
    bound = wall_per_step["sync"] / async_floor
    return {
        "sim_async_speedup": speedup,
        "sim_async_speedup_bound": bound,
        "sim_efficiency_vs_bound": speedup / bound,
        "sim_pipeline_efficiency": asynchronous["pipeline_efficiency"],
        "sim_sync_wall_per_step_s": wall_per_step["sync"],
        "sim_async_wall_per_step_s": wall_per_step["async"],
        "sim_train_step_s": sync_train,
        "sim_async_floor_s": async_floor,
        "sim_generation_s": generate,
        "sync": sync,
        "async": asynchronous,
    }


def _generation_s(config: GRPOConfig, tokens_per_step: float) -> float:
    """Wall seconds the engines need for one step's tokens at the batch the asynchronous run keeps
    (every rollout loop's group in flight): tokens / (G x B / step_s(B, B x c)), with B sequences
    per engine and c the mean context of a sequence (prompt + half a completion)."""
    sim = config.generator.sim
    batch = min(config.prompts_in_flight_per_generator * config.group_size, config.generator.max_num_seqs)
    mean_completion = tokens_per_step / (config.prompts_per_step * config.group_size)
    step_s = sim.latency.step_s(batch, int(batch * (8 + mean_completion / 2)))
    return tokens_per_step / (config.num_generators * batch / step_s) * sim.time_scale


def _accounting_ok(record: dict, steps: int) -> bool:
    """Every step trained a full batch of distinct prompts, none twice, and no prompt is missing
    (unfinished_at_stop is what remains of those handed out, so it must not be negative)."""
    accounting = record["accounting"]
    return (
        accounting["trained"] == steps * record["prompts_per_step"]
        and accounting["trained_more_than_once"] == 0
        and accounting["unfinished_at_stop"] >= 0
    )


def main(args: ScaleArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    if not base.simulated:
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"{args.config} runs the real engine (generator.engine {base.generator.engine}); bench scale runs "
            "simulations only. Pass --config configs/sim_scale.yaml."
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
        "steps_per_s": [r.get("steps_per_s") for r in per_count],
        "event_loop_lag_p99_ms": [r.get("event_loop_lag_p99_ms") for r in per_count],
        "max_concurrent_rollouts": [r.get("max_concurrent_rollouts") for r in per_count],
        "generator_rss_mib": [r.get("generator_rss_mib") for r in per_count],
        "max_generators_sustained": max((r["num_generators"] for r in ok), default=0),
        "max_concurrent_rollouts_sustained": max((r["max_concurrent_rollouts"] for r in ok), default=0),
        "accounting_ok": all(_accounting_ok(r, args.steps) for r in ok),
        "time_scale": args.time_scale,
        "control_plane": per_count,
    }
    if not args.skip_async_vs_sync:
        summary.update(async_vs_sync(base, args))
    (args.out_dir / "scale.json").write_text(json.dumps(summary, indent=2))
    return summary
