"""Roles pinned to cores (launch.placement.generator_cpus / trainer_cpus) in a real run: every
thread of the generator's processes (the actor's and the vLLM engine processes it starts) may run
on the generator's cores only, and every thread of the trainer's on the trainer's.

Read from the live processes between two steps (the between-steps hook), not after the run."""

import asyncio
import json
import os
from pathlib import Path

import pytest

from apps.grpo.main import run
from forge_rl.config import GRPOConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.plumbing.placement import LaunchConfig, PlacementConfig
from forge_rl.run.lifecycle import Lifecycle

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two roles apart needs two cores"),
]


def threads_cores(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid` -> the cores it may run on (Cpus_allowed_list). A thread that
    ends between the listing and the read (the weight store's writer, say) is left out: it runs
    nowhere."""
    cores = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        allowed = next(
            line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")
        )
        cores[int(task.name)] = parse_core_list(allowed)
    return cores


def parse_core_list(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}."""
    cores = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def test_each_role_runs_on_its_own_cores_with_every_thread_and_engine_process(tmp_path):
    generator_core, trainer_core = sorted(os.sched_getaffinity(0))[:2]
    config = GRPOConfig(
        run_dir=tmp_path,
        run_name="pinned",
        steps=2,
        train_batch_size=8,
        group_size=4,
        generator=GeneratorConfig(max_new_tokens=2),
        launch=LaunchConfig(placement=PlacementConfig(generator_cpus=(generator_core,), trainer_cpus=(trainer_core,))),
    )
    seen: dict[str, dict[int, dict[int, set[int]]]] = {}
    after_step = Lifecycle.after_step

    async def after_step_reading_the_cores(lifecycle, pipeline):
        await after_step(lifecycle, pipeline)
        if pipeline.step == 1:
            processes = json.loads((lifecycle.run_path / "processes.json").read_text())
            [generator_pids] = processes["generators"]
            seen["generator"] = {pid: threads_cores(pid) for pid in generator_pids}
            seen["trainer"] = {pid: threads_cores(pid) for pid in processes["trainer"]}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Lifecycle, "after_step", after_step_reading_the_cores)
        summary = asyncio.run(run(config))

    assert summary["steps"] == 2
    assert len(seen["generator"]) >= 2, f"the generator's engine processes are missing: {seen['generator']}"
    for role, core in (("generator", generator_core), ("trainer", trainer_core)):
        for pid, threads in seen[role].items():
            assert threads, f"{role} process {pid} has no thread"
            off = {tid: cores for tid, cores in threads.items() if cores != {core}}
            assert not off, f"{role} process {pid}: threads not pinned to core {core}: {off}"
