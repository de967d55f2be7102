"""Kill the scorer's process under a scoring call in the middle of a real run: it is restarted and
the call's episodes are scored again.

Checks: the run finishes; the death is detected, the scorer restarted and serving again; the call
in flight at the kill was scored again (episodes_rescored); no prompt is lost, trained twice or
scored into the buffer twice.

Driven, not timed: from step KILL_AFTER_STEP's between-steps hook, a background task holds the
reward function (tests/support/held_reward.py), waits until a scoring call is inside it, so
surely in flight, SIGKILLs the scorer's process and releases the hold; the hook after step
REPLACED_BY_STEP waits for that task and for the scorer to serve again, so the run cannot end
before the recovery. The task runs beside the train loop, not in the hook: the batch the train
loop needs next may be the very episodes being held.
"""

import asyncio
import json
import os
import signal
import time

import pytest

from apps.grpo import main as grpo_main
from apps.grpo.main import run, spawn_actors
from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.run.lifecycle import Lifecycle
from forge_rl.tasks import TaskConfig
from tests.support.held_reward import HOLD_DIR_ENV
from tests.support.helpers import assert_every_prompt_accounted_for

pytestmark = pytest.mark.integration

KILL_AFTER_STEP = 2
REPLACED_BY_STEP = 4
STEPS = 6
HOLD_BOUND_S = 60.0
"""How long the kill waits for a scoring call to reach the held reward: rollouts run all along, so
one does within a step's time; the bound only turns a broken test into a failure, not a hang."""


@pytest.fixture(scope="module")
def recovered_run(tmp_path_factory):
    hold_dir = tmp_path_factory.mktemp("hold")
    config = GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name="scorer-recovery",
        steps=STEPS,
        train_batch_size=16,
        group_size=4,
        prompts_in_flight_per_generator=4,
        generator=GeneratorConfig(max_new_tokens=2),
        buffer=BufferConfig(max_policy_age=1),
        task=TaskConfig(reward="tests.support.held_reward:held_leading_number"),
    )
    run_path = config.run_dir / config.run_name
    kill: dict = {}
    after_step = Lifecycle.after_step

    async def after_step_driving_the_recovery(lifecycle, pipeline):
        await after_step(lifecycle, pipeline)
        if pipeline.step == KILL_AFTER_STEP:
            kill["task"] = asyncio.ensure_future(_kill_the_scorer_under_a_call(hold_dir, run_path, kill))
        if pipeline.step == REPLACED_BY_STEP:
            await kill.pop("task")
            kill["restarts_when_serving"] = await spawned["actors"].scoring.scorer.wait_until_serving.call_one()

    spawned = {}

    async def spawn_actors_kept(config, lifecycle):  # the hook needs the scorer's supervisor
        spawned["actors"] = await spawn_actors(config, lifecycle)
        return spawned["actors"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HOLD_DIR_ENV, str(hold_dir))
        patch.setattr(Lifecycle, "after_step", after_step_driving_the_recovery)
        patch.setattr(grpo_main, "spawn_actors", spawn_actors_kept)
        summary = asyncio.run(run(config))
    return summary, kill, config


async def _kill_the_scorer_under_a_call(hold_dir, run_path, kill: dict) -> None:
    (hold_dir / "hold").touch()
    deadline = time.monotonic() + HOLD_BOUND_S
    while not list(hold_dir.glob("held-*")):
        assert time.monotonic() < deadline, f"no scoring call reached the held reward within {HOLD_BOUND_S} s"
        await asyncio.sleep(0.05)
    scorer_pid = json.loads((run_path / "processes.json").read_text())["scorer"][0]
    kill["killed_at"] = time.time()
    os.kill(scorer_pid, signal.SIGKILL)
    (hold_dir / "hold").unlink()  # the replacement's reward is not held


def test_the_run_finishes(recovered_run):
    summary, _, config = recovered_run
    assert summary["steps"] == config.steps


def test_the_scorer_was_restarted_and_the_call_in_flight_scored_again(recovered_run):
    summary, kill, config = recovered_run
    [event] = summary["scorer_recoveries"]
    assert kill["killed_at"] <= event["detected_at"] <= event["restart_started_at"] <= event["serving_at"]
    assert event["episodes_rescored"] >= 1  # the held call, at least
    assert kill["restarts_when_serving"] == 1
    last_step = json.loads((config.run_dir / config.run_name / "metrics.jsonl").read_text().splitlines()[-1])
    assert last_step["scorer/restarts"] == 1


def test_no_prompt_is_lost_trained_twice_or_scored_twice(recovered_run):
    summary, _, config = recovered_run
    accounting = summary["accounting"]
    assert summary["errored_samples"] == 0  # the death is no completion's fault: none ERRORED for it
    assert accounting["requeued_after_generator_failure"] == 0  # rescored, not generated again
    assert_every_prompt_accounted_for(accounting, trained=config.steps * config.prompts_per_step)
