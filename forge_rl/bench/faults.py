"""`forge-rl bench faults`: what generators killed mid-generation cost, with their work migrated
(generator.segment_tokens: a dead generator's groups continue on a live one from the tokens it had
returned) against re-issued (its prompts generated again from scratch).

The same run twice, real vLLM generators on the long-tail workload (configs/bench_long_tail_cpu.yaml:
completions forced to Pareto lengths, most short, some long), once per mode. Every
`kill_every_steps` steps, a random delay after the step (the same draws in both modes), the next
victim (generators in turn) has the tokens its requests in flight have sampled read
(`VLLMEngine.tokens_in_flight`: what its death loses; the SIGKILL follows in the turn the answer
arrives, so only the decode steps of that round trip are missed) and every process of it SIGKILLed; the
pool replaces it, the train loop going on meanwhile. A victim still recovering from its previous kill is waited for first, and the
last kill's victim serves again before the run ends.

Reported per mode: tokens wasted (the victims' tokens in flight at their kills, plus tokens a
continuation threw away as too old), tokens generated (those of every finished group, a
continued one's salvaged tokens included, plus the wasted), `wasted_fraction` (their ratio),
tokens salvaged, the run's wall time, and reward against wall time (`reward_by_time`: per step
(wall seconds, reward mean)). The headline is `wasted_fraction_reissue / wasted_fraction_migrate`.
The segments' own cost shows in `steps_per_s` (every segment after the first prefills its prefix
again).

Figures go to OUT_DIR/faults.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import GENERATED_TOKENS_TOTAL, REWARD_MEAN, WALL_TIME_S
from forge_rl.observability.metrics import progress
from forge_rl.observability.plot import read_metrics
from forge_rl.plumbing.reaper import kill_trees

MODES = ("reissue", "migrate")


@dataclass(frozen=True)
class FaultsBenchArgs:
    out_dir: Path = Path("runs/bench-faults")
    """Where faults.json and the two runs' directories go."""
    config: Path = Path("configs/bench_long_tail_cpu.yaml")
    """The recipe config both modes run (its steps, batch and workload, unless set below)."""
    num_generators: int = 2
    steps: int = 24
    kill_every_steps: int = 4
    """A kill after every this many steps (the last one at least this many steps before the end)."""
    segment_tokens: int = 16
    """generator.segment_tokens of the migrate mode."""
    max_new_tokens: int = 96
    long_tail_min_tokens: int = 8
    train_batch_size: int = 32
    group_size: int = 4
    prompts_in_flight_per_generator: int = 8
    kill_delay_max_s: float = 2.0
    """Each kill comes a random delay after its step, uniform in [0, this] (about a step of this benchmark's run)."""
    seed: int = 0
    """Draws the kills' delays (the same in both modes)."""
    recovery_timeout_s: float = 300.0
    """Longest wait for a victim to serve again; past it the benchmark fails."""


def main(args: FaultsBenchArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    if args.kill_every_steps < 1 or args.steps < 2 * args.kill_every_steps:
        raise ValueError(
            f"--kill-every-steps ({args.kill_every_steps}) must be >= 1 and --steps ({args.steps}) at least twice "
            "it: every kill needs steps after it. Lower --kill-every-steps or raise --steps."
        )
    base = load_yaml_config(GRPOConfig, args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figures = {}
    for mode in MODES:
        progress(
            f"bench faults: {mode} run, {args.num_generators} generators, a kill every {args.kill_every_steps} steps"
        )
        figures[mode] = run_mode(run_config(base, args, mode), args)
    summary = {
        "benchmark": "faults",
        "num_generators": args.num_generators,
        "steps": args.steps,
        "kill_every_steps": args.kill_every_steps,
        "segment_tokens": args.segment_tokens,
        **{f"wasted_fraction_{mode}": figures[mode]["wasted_fraction"] for mode in MODES},
        **{f"kills_{mode}": len(figures[mode]["kills"]) for mode in MODES},
        # None when the migrated run wasted nothing (every kill fell between two segments).
        "wasted_reissue_over_migrate": (
            figures["reissue"]["wasted_fraction"] / figures["migrate"]["wasted_fraction"]
            if figures["migrate"]["wasted_fraction"]
            else None
        ),
        "salvaged_tokens_migrate": figures["migrate"]["salvaged_tokens"],
        "steps_per_s_migrate_over_reissue": figures["migrate"]["steps_per_s"]
        / max(figures["reissue"]["steps_per_s"], 1e-12),
        "accounting_ok": all(figures[mode]["accounting_ok"] for mode in MODES),
        "modes": figures,
    }
    (args.out_dir / "faults.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_config(base: GRPOConfig, args: FaultsBenchArgs, mode: str) -> GRPOConfig:
    return dataclasses.replace(
        base,
        run_dir=args.out_dir,
        run_name=mode,
        steps=args.steps,
        num_generators=args.num_generators,
        train_batch_size=args.train_batch_size,
        group_size=args.group_size,
        prompts_in_flight_per_generator=args.prompts_in_flight_per_generator,
        task=dataclasses.replace(
            base.task, completion_lengths="long_tail", long_tail_min_tokens=args.long_tail_min_tokens
        ),
        generator=dataclasses.replace(
            base.generator,
            max_new_tokens=args.max_new_tokens,
            segment_tokens=args.segment_tokens if mode == "migrate" else None,
        ),
    )


def run_mode(config: GRPOConfig, args: FaultsBenchArgs) -> dict:
    from forge_rl.bench.scale_runs import run_probed

    assert config.run_name is not None  # run_config names each mode's run
    shutil.rmtree(config.run_dir / config.run_name, ignore_errors=True)  # this benchmark's previous run
    killer = _KillInTurn(
        config.num_generators,
        args.kill_every_steps,
        config.steps,
        args.kill_delay_max_s,
        args.seed,
        args.recovery_timeout_s,
    )
    started = time.monotonic()
    figures, run_path = run_probed(config, after_step=killer.after_step)
    wall_s = time.monotonic() - started
    metrics = read_metrics(run_path)
    accounting = figures["accounting"]
    wasted = sum(kill["tokens_in_flight"] for kill in killer.kills) + accounting["salvage_discarded_tokens"]
    kept = metrics[-1][GENERATED_TOKENS_TOTAL] if metrics else 0
    return {
        "kills": killer.kills,
        "tokens_wasted": wasted,
        "tokens_generated": kept + wasted,
        "wasted_fraction": wasted / max(kept + wasted, 1),
        "salvaged_tokens": accounting["salvaged_tokens"],
        "continued_after_generator_failure": accounting["continued_after_generator_failure"],
        "requeued_after_generator_failure": accounting["requeued_after_generator_failure"],
        "steps_per_s": figures["steps_per_s"],
        "wall_s": wall_s,
        "final_reward": metrics[-1][REWARD_MEAN] if metrics else None,
        "reward_by_time": [(m[WALL_TIME_S], m[REWARD_MEAN]) for m in metrics],
        "accounting_ok": accounting["trained_more_than_once"] == 0
        and accounting["trained"] == config.steps * config.prompts_per_step,
        "run_dir": str(run_path),
    }


class _KillInTurn:
    """Driven by train steps (the probe's `after_step`), timed by a seeded clock: after every
    `every` steps short of the last `every`, the next generator in turn is SIGKILLed a random
    delay later (uniform in [0, max_delay_s], the same draws in both modes: a fault does not wait
    for a convenient moment), its tokens in flight read first; the train loop goes on meanwhile.
    After the second-to-last step every kill is done and every victim serves again."""

    def __init__(
        self, num_generators: int, every: int, steps: int, max_delay_s: float, seed: int, recovery_timeout_s: float
    ):
        self.num_generators, self.every, self.steps = num_generators, every, steps
        self.max_delay_s, self.rng = max_delay_s, random.Random(seed)
        self.recovery_timeout_s = recovery_timeout_s
        self.kills: list[dict] = []
        self._pending: list[asyncio.Task] = []

    async def after_step(self, probe, step: int) -> None:
        pool = probe.actors.generators
        if step % self.every == 0 and step <= self.steps - self.every:
            victim = len(self._pending) % self.num_generators
            delay_s = self.rng.uniform(0.0, self.max_delay_s)
            self._pending.append(asyncio.create_task(self._kill(pool, victim, step, delay_s, len(self._pending) + 1)))
        if step == self.steps - 1:  # the run ends with every generator serving
            await asyncio.wait_for(self._all_served(pool), self.recovery_timeout_s)

    async def _all_served(self, pool) -> None:
        await asyncio.gather(*self._pending)
        await asyncio.gather(*(pool.wait_until_serving.call_one(i) for i in range(self.num_generators)))

    async def _kill(self, pool, index: int, step: int, delay_s: float, number: int) -> None:
        # A victim of an earlier kill is replaced first (waited for in the order the kills were made).
        await asyncio.gather(*self._pending[: number - 1])
        await pool.wait_until_serving.call_one(index)
        await asyncio.sleep(delay_s)
        processes = [psutil.Process(pid) for pid in (await pool.processes.call_one())[index]]
        tokens = await pool.tokens_in_flight.call_one(index)
        kill_trees(processes)  # in the turn its tokens in flight were read
        self.kills.append({"step": step, "generator": index, "delay_s": delay_s, "tokens_in_flight": tokens})
        progress(f"bench faults: killed generator {index} {delay_s:.2f} s after step {step}, {tokens} tokens in flight")
        # Detection is the pool's own process poll; until it ran, the slot still reads as serving.
        while len(await pool.recovery_events.call_one()) < number:
            await asyncio.sleep(0.05)
