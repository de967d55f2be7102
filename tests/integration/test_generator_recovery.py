"""Kill a generator (actor and vLLM engine processes) in the middle of a real run: it is replaced.

Checks: the run finishes; the failure is detected within 5 s of the kill and the replacement
spawned at once; the replacement serves at the current policy version; the other generator keeps
serving meanwhile; no prompt is lost or trained twice.

The run is driven to each state instead of timed: the kill happens right after step KILL_AFTER_STEP
is checkpoint-due (from the lifecycle's between-steps hook, so at a known step), and the train loop
waits after step REPLACED_BY_STEP until the replacement serves, so the run cannot end before the
recovery however slow this machine's engine start is. Time bounds cover only what the pool
controls: detection is its own 0.5 s process poll, and the respawn starts in the same event-loop
turn as the detection.
"""

import asyncio
import json
import os
import signal
import time

import pytest

from apps.grpo.main import run
from forge_rl.buffer import BufferConfig
from forge_rl.config import GRPOConfig
from forge_rl.engines.vllm_engine import GeneratorConfig
from forge_rl.lifecycle import Lifecycle
from forge_rl.timeline import Timeline

pytestmark = pytest.mark.integration

KILL_AFTER_STEP = 5
REPLACED_BY_STEP = 15
"""The train loop waits after this step until generator 0 serves again."""
STEPS = 25
DETECTION_BOUND_S = 5.0
"""The pool polls its generators' processes every 0.5 s: 10 polls. Only a detection that waits for
something else (Monarch's own report took about 9 s) or never comes exceeds it."""
RESPAWN_BOUND_S = 2.0
"""Between detection and respawn there is only the event loop; stopping the dead mesh first (up
to the pool's 5 s stop timeout, which it must not wait for) would exceed it."""


@pytest.fixture(scope="module")
def recovered_run(tmp_path_factory):
    config = GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name="recovery",
        steps=STEPS,
        num_generators=2,
        prompts_in_flight_per_generator=8,
        generator=GeneratorConfig(max_new_tokens=2),
        buffer=BufferConfig(max_policy_age=1, capacity_episodes=32),
    )
    run_path = config.run_dir / config.run_name
    kill = {}
    after_step = Lifecycle.after_step

    async def after_step_driving_the_recovery(lifecycle, pipeline):
        await after_step(lifecycle, pipeline)
        pool = pipeline.actors.generators
        if pipeline.step == KILL_AFTER_STEP:  # SIGKILL generator 0's actor and engine processes
            kill.update(killed_at=time.time(), version_at_kill=pipeline.step)
            for pid in json.loads((run_path / "processes.json").read_text())["generators"][0]:
                os.kill(pid, signal.SIGKILL)
        if pipeline.step == REPLACED_BY_STEP:
            while not await pool.recovery_events.call_one():  # the pool's poll has not seen it yet
                await asyncio.sleep(0.1)
            await pool.wait_until_serving.call_one(0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Lifecycle, "after_step", after_step_driving_the_recovery)
        summary = asyncio.run(run(config))
    return summary, kill["killed_at"], kill["version_at_kill"], run_path, config


def test_the_run_finishes(recovered_run):
    summary, *_, config = recovered_run
    assert summary["steps"] == config.steps


def test_the_failure_is_detected_within_five_seconds_and_a_replacement_spawned_at_once(recovered_run):
    summary, killed_at, *_ = recovered_run
    [event] = summary["generator_recoveries"]
    assert event["generator"] == 0
    assert killed_at <= event["detected_at"] <= killed_at + DETECTION_BOUND_S
    assert event["detected_at"] <= event["respawn_started_at"] <= event["detected_at"] + RESPAWN_BOUND_S


def test_the_replacement_serves_at_the_current_version(recovered_run):
    """Serving follows its own engine start (spawning and importing take what the machine takes:
    not bounded here); it serves the newest weights, not the model directory's."""
    summary, killed_at, version_at_kill, *_ = recovered_run
    [event] = summary["generator_recoveries"]
    assert event["respawn_started_at"] + event["engine_start_s"] <= event["serving_at"]
    assert event["policy_version"] >= version_at_kill


def test_the_other_generator_keeps_serving_meanwhile(recovered_run):
    summary, killed_at, _, run_path, _ = recovered_run
    [event] = summary["generator_recoveries"]
    intervals = Timeline.load(run_path / "timeline.jsonl")
    started = json.loads((run_path / "timeline_origin.json").read_text())["unix_time"]
    outage = (killed_at - started, event["serving_at"] - started)
    # Batches handed to generator 1 after the kill and finished before generator 0 served again
    # (the outage lasts at least an engine start, 10-30 s; a batch of 2 tokens takes well under 1 s).
    served = [i for i in intervals if i.component == "generator1" and outage[0] < i.start_s and i.end_s < outage[1]]
    assert len(served) >= 5


def test_no_prompt_is_lost_or_trained_twice(recovered_run):
    summary, *_, config = recovered_run
    accounting = summary["accounting"]
    assert accounting["trained_more_than_once"] == 0
    assert accounting["prompts_handed_out"] == (
        accounting["trained"] + accounting["dropped"] + accounting["unfinished_at_stop"]
    )
    assert accounting["trained"] == config.steps * config.prompts_per_step
