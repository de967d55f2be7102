"""`forge-rl bench scale`'s faults part: the control-plane run with a tenth of its generators
SIGKILLed mid-run, and the judgement of what the pool detected, replaced, requeued and lost."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import TYPE_CHECKING

import psutil

from forge_rl.bench.scale_runs import RunProbe, control_plane_config, run_probed
from forge_rl.config import GRPOConfig
from forge_rl.core.deadlines import within
from forge_rl.observability.metrics import progress
from forge_rl.plumbing.reaper import kill_trees

if TYPE_CHECKING:
    from forge_rl.bench.scale import ScaleArgs


def lost_prompts(accounting: dict, held_at_stop: dict) -> int:
    """Prompts handed out that are neither trained, filtered, skipped, dropped (each counted with
    its reason by the run's accounting) nor held when the run ended (`RunProbe.held_at_stop`).
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

    async def after_step(self, probe: RunProbe, step: int) -> None:
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
