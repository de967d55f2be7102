"""Kill the reference model's process under a `token_logprobs` call: its supervisor
(forge_rl/actors/frozen_model_supervisor.py) restarts it from its directory on a fresh process and
sends the same call again, so the caller gets the answer it would have got (none lost, each once);
a death past reference.max_restarts stops the call with ScorerFailed naming the flag. Kill a
pinned (self-distillation) teacher that serves a version the store has moved past: its
replacement serves that version again, which the supervisor's lease kept in the store.

Driven, not timed: the reference's process is stopped (SIGSTOP) so it takes no message, a call is
sent, the supervisor reports it in flight, and only then the process is killed (SIGKILL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from monarch.actor import this_host

from forge_rl.actors.frozen_model_supervisor import FrozenModelSupervisor
from forge_rl.errors import ScorerFailed, raised_by_actor
from forge_rl.models.parallel import ParallelConfig
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.models.titan import read_hf_config
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.scoring.teacher import TeacherConfig, load_teacher_weights
from forge_rl.store.actors import spawn_store
from forge_rl.store.client import WeightStore
from forge_rl.training.reference import ReferenceConfig
from forge_rl.types import Completion, Episode

pytestmark = pytest.mark.integration

IN_FLIGHT_BOUND_S = 120.0
"""How long the kill waits for the supervisor to report the call in flight (it is at once); the
bound only turns a broken test into a failure, not a hang."""

HOLD_ATTEMPTS = 3
"""Stops and calls before the kill gives up holding a call in flight. Once in CI (2026-11-29) a
call to the stopped process was answered before the supervisor reported it in flight, with no
restart recorded: the stop had not held it, cause not found (not reproduced here: no restart, no
Monarch report of a stopped process in 10 s, its parent alive so its group is not orphaned).
The kill then stops it and sends the call again, saying so on stderr; a call answered by a
replacement (a restart recorded) still fails the test."""


def episodes() -> list[Episode]:
    """2 prompts x 2 completions of uneven lengths."""
    return [
        Episode(
            e,
            f"P{e}=",
            "",
            [1, 10 + e, 14],
            [
                Completion(token_ids=[5 + e + c + t for t in range(n)], logprobs=[-1.0] * n, policy_versions=[0] * n)
                for c, n in enumerate(lengths)
            ],
        )
        for e, lengths in enumerate([(3, 1), (2, 4)])
    ]


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


async def kill_under_a_call(supervisor) -> tuple[int, asyncio.Future]:
    """SIGKILL the frozen model's (last) process while a call to it is in flight; returns its pid
    and the call."""
    recoveries = len(await supervisor.recovery_events.call_one())
    unheld = []
    for _ in range(HOLD_ATTEMPTS):
        pid = (await supervisor.processes.call_one())[-1]
        os.kill(pid, signal.SIGSTOP)  # it takes no more messages: the call sent now stays in flight
        call = asyncio.ensure_future(supervisor.token_logprobs.call_one(episodes()))
        deadline = time.monotonic() + IN_FLIGHT_BOUND_S
        while await supervisor.calls_in_flight.call_one() < 1 and not call.done():
            if time.monotonic() > deadline:
                events = await supervisor.recovery_events.call_one()
                raise AssertionError(f"the call was not in flight within {IN_FLIGHT_BOUND_S} s; recoveries: {events}")
            await asyncio.sleep(0.05)
        if not call.done():
            os.kill(pid, signal.SIGKILL)
            return pid, call
        events = await supervisor.recovery_events.call_one()
        unheld.append(
            f"the call ended before it was in flight ({call.exception() or 'answered'}); stopped pid {pid} is "
            f"{_status(pid)}, serving now {await supervisor.processes.call_one()}"
        )
        print(f"kill_under_a_call: {unheld[-1]}; sending it again", file=sys.stderr)
        if call.exception() is not None or len(events) > recoveries:
            raise AssertionError(f"{unheld[-1]}; recoveries: {events}")
    raise AssertionError(f"no call held in flight in {HOLD_ATTEMPTS} attempts: {unheld}")


def test_a_killed_reference_model_is_restarted_and_answers_the_call_in_flight_until_max_restarts(model_dir):
    config = ReferenceConfig(max_restarts=1)
    pad_id = read_hf_config(model_dir)["pad_token_id"]

    async def main():
        procs = spawn_procs(this_host(), "supervisor")
        supervisor = procs.spawn("supervisor", FrozenModelSupervisor, "reference", config, str(model_dir), pad_id)
        try:
            await supervisor.start.call_one()
            before = await supervisor.token_logprobs.call_one(episodes())
            killed, call = await kill_under_a_call(supervisor)
            after = await call  # answered by the replacement
            restarts = await supervisor.wait_until_serving.call_one()
            pids_after = await supervisor.processes.call_one()
            stats = await supervisor.stats.call_one()
            _, call = await kill_under_a_call(supervisor)  # a second death: past reference.max_restarts
            with pytest.raises(Exception) as failed:
                await call
            events = await supervisor.recovery_events.call_one()
            return before, after, restarts, killed, pids_after, stats, events, failed.value
        finally:
            await supervisor.shutdown.call_one()
            await procs.stop()

    before, after, restarts, killed, pids_after, stats, events, failure = asyncio.run(main())
    assert after == before  # the same frozen weights, the same episodes: the same logprobs, once each
    assert [len(c) for e in after for c in e] == [3, 1, 2, 4]
    assert restarts == 1 and killed not in pids_after
    assert stats == {"reference/restarts": 1}
    assert events[0]["role"] == "reference model"
    assert events[0]["episodes_rescored"] == 2  # the call in flight at the kill, sent again
    assert events[0]["detected_at"] <= events[0]["restart_started_at"] <= events[0]["serving_at"]
    assert len(events) == 2  # the restart, then the death that exhausted reference.max_restarts
    assert isinstance(raised_by_actor(failure), ScorerFailed), failure
    assert "reference.max_restarts (1)" in str(raised_by_actor(failure))
    assert "--reference.max-restarts" in str(raised_by_actor(failure))


def refresh_then_kill(model_dir: Path, tmp_path: Path, config: TeacherConfig, ema_file: Path | None = None):
    """A teacher refreshed to version 1 (blended by `config.ema_decay` for an ema pin), then the
    store moves on to version 2 and the teacher is killed under a call. Returns its token logprobs
    before the refresh, after it, and from its replacement, the store's keys at the kill, its
    stats, and, for a teacher over several processes, the logprobs after the same refresh of a
    twin on one process."""
    from safetensors.torch import load_file

    version_1 = create_tiny_model(TinyModelConfig(seed=1), tmp_path / "version_1")  # the policy after a step
    root = Path("/dev/shm") / f"forge_rl-test-{config.pin}-teacher-{time.monotonic_ns()}"
    pad_id = read_hf_config(model_dir)["pad_token_id"]
    blend = config.ema_decay if config.pin == "ema" else None

    async def main():
        procs = spawn_procs(this_host(), "services")
        index, _ = await spawn_store(procs, root, extra_files_dir=model_dir)  # keeps the newest version only
        writer = WeightStore(index, root, extra_files_dir=model_dir)
        teacher = procs.spawn(
            "teacher",
            FrozenModelSupervisor,
            "teacher",
            config,
            str(model_dir),
            pad_id,
            index,
            str(root),
            None,
            None,
            None if ema_file is None else str(ema_file),
        )
        twin = None
        if config.num_procs > 1:
            one_process = dataclasses.replace(config, num_procs=1, parallel=ParallelConfig())
            twin = procs.spawn(  # an ema twin writes its average too: no lease of its holds version 1
                "twin",
                FrozenModelSupervisor,
                "twin",
                one_process,
                str(model_dir),
                pad_id,
                index,
                str(root),
                None,
                None,
                None if ema_file is None else str(ema_file.with_name("twin_ema.pt")),
            )
        teachers = [teacher] + ([twin] if twin is not None else [])
        try:
            await asyncio.gather(*(t.start.call_one() for t in teachers))
            initial = await teacher.token_logprobs.call_one(episodes())
            await writer.publish(1, load_file(str(version_1 / "model.safetensors")))
            for t in teachers:
                await t.stage.call_one(1, blend)
                await t.swap.call_one()
            refreshed = await teacher.token_logprobs.call_one(episodes())
            twin_refreshed = None if twin is None else await twin.token_logprobs.call_one(episodes())
            if twin is not None:
                await twin.shutdown.call_one()  # its lease goes: the store keeps what the teacher holds
                teachers.remove(twin)
            await writer.publish(2, load_file(str(model_dir / "model.safetensors")))  # the store moves on
            kept = await writer.keys("v")
            _, call = await kill_under_a_call(teacher)
            after = await call
            return initial, refreshed, after, kept, await teacher.stats.call_one(), twin_refreshed
        finally:
            for t in teachers:
                await t.shutdown.call_one()
            await procs.stop()
            writer.local.destroy()

    return asyncio.run(main())


TWO_PROCESSES = {
    "fsdp2": dict(num_procs=2, parallel=ParallelConfig(dp_shard=2)),
    "tp2": dict(num_procs=2, parallel=ParallelConfig(tp=2)),
}


def assert_same_logprobs(got, expected) -> None:
    """Equal up to the float error of summing in another order over sharded weights."""
    flat = [value for episode in got for completion in episode for value in completion]
    flat_expected = [value for episode in expected for completion in episode for value in completion]
    torch.testing.assert_close(torch.tensor(flat), torch.tensor(flat_expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["one process", "fsdp2"])
def test_a_killed_pinned_teacher_serves_its_version_again_though_the_store_moved_past_it(model_dir, tmp_path, layout):
    """Over two processes (FSDP2), each rank stages its shards of the version from the store, and
    serves what a teacher on one process serves; its replacement stages them again."""
    config = TeacherConfig(pin="lagged", versions_back=1, refresh_every_n_steps=2, **TWO_PROCESSES.get(layout, {}))
    initial, served, after, kept, stats, twin_served = refresh_then_kill(model_dir, tmp_path, config)
    assert served != initial  # it serves version 1, not the initial policy
    assert kept == ["v00000001", "v00000002"]  # version 1 kept past keep_latest by the teacher's lease
    assert after == served and stats == {"teacher/restarts": 1}
    if twin_served is not None:
        assert_same_logprobs(served, twin_served)


@pytest.mark.parametrize("layout", ["one process", "tp2"])
def test_a_killed_ema_teacher_serves_the_same_average_from_the_file_it_wrote_after_its_refresh(
    model_dir, tmp_path, layout
):
    """scorer.teacher.keep_ema_average: after a refresh the teacher writes its average (here half
    the initial policy, half version 1) to a file; its replacement loads that file, so it serves
    the same average, although the store has moved past version 1 and nothing else holds it. Over
    two processes (TP), the ranks blend their shards, rank 0 writes the gathered average, and it
    serves what a teacher on one process serves."""
    ema_file = tmp_path / "teacher_ema.pt"
    config = TeacherConfig(pin="ema", ema_decay=0.5, refresh_every_n_steps=2, **TWO_PROCESSES.get(layout, {}))
    initial, averaged, after, kept, stats, twin_averaged = refresh_then_kill(model_dir, tmp_path, config, ema_file)
    assert averaged != initial
    assert kept == ["v00000002"]  # the file holds the average: no lease keeps version 1
    assert after == averaged and stats == {"teacher/restarts": 1}
    assert load_teacher_weights(ema_file)["served_version"] == 1
    if twin_averaged is not None:
        assert_same_logprobs(averaged, twin_averaged)
        written, twin_written = load_teacher_weights(ema_file), load_teacher_weights(ema_file.with_name("twin_ema.pt"))
        assert written["served"].keys() == twin_written["served"].keys()
        for name, tensor in written["served"].items():  # the whole average, gathered from both ranks
            torch.testing.assert_close(tensor, twin_written["served"][name], rtol=0, atol=1e-6)
