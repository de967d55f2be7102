"""A running run's generator pool grown and shrunk from outside it (`forge-rl scale`,
forge_rl/run/scaling.py): from 1 generator to 3, then back to 2, while it trains.

A real run of the demo task with one real generator and segments (generator.segment_tokens). The
test makes its requests the way the command does (`request_scale`, read by the controller after
each step), from the train loop's between-steps hook so they land at known steps, and waits for
each answer there: the run cannot end before the pool has changed, however slow an engine's start
is here. Checks: the answers (two added, serving the newest version; the newest removed), each
step's `generator/count`, the removed generator's processes gone, processes.json naming the pool
as it is, and the prompt accounting exact.
"""

from __future__ import annotations

import asyncio
import json

import psutil
import pytest

from apps.grpo.main import run
from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.observability.metric_names import NUM_GENERATORS
from forge_rl.run.lifecycle import Lifecycle
from forge_rl.run.scaling import ANSWER_FILE, CONTROL_DIR, request_scale
from tests.support.helpers import assert_every_prompt_accounted_for

pytestmark = pytest.mark.integration

GROW_AT_STEP, SHRINK_AT_STEP, STEPS = 3, 8, 14


def _answer(run_path, request_id: str) -> dict | None:
    path = run_path / CONTROL_DIR / ANSWER_FILE
    if path.is_file() and (answer := json.loads(path.read_text()))["id"] == request_id:
        return answer
    return None


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory):
    config = GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name="scaled",
        steps=STEPS,
        num_generators=1,
        group_size=2,
        train_batch_size=8,
        prompts_in_flight_per_generator=4,
        generator=GeneratorConfig(max_new_tokens=8, segment_tokens=4),
        buffer=BufferConfig(max_policy_age=2, capacity_episodes=16),
    )
    run_path = config.run_dir / config.run_name
    seen: dict = {"answers": [], "processes": []}
    after_step = Lifecycle.after_step

    async def after_step_scaling(lifecycle, pipeline):
        if pipeline.step in (GROW_AT_STEP, SHRINK_AT_STEP):
            request = request_scale(run_path, 3 if pipeline.step == GROW_AT_STEP else 2, grace_s=2.0)
            await after_step(lifecycle, pipeline)  # reads the request, starts carrying it out
            while (answer := _answer(run_path, request)) is None:
                await asyncio.sleep(0.1)
            seen["answers"].append(answer)
            seen["processes"].append(json.loads((run_path / "processes.json").read_text())["generators"])
            return
        await after_step(lifecycle, pipeline)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Lifecycle, "after_step", after_step_scaling)
        summary = asyncio.run(run(config))
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    return summary, seen, metrics, config


def test_two_generators_were_added_serving_and_the_newest_removed(scaled_run):
    summary, seen, *_ = scaled_run
    grown, shrunk = seen["answers"]
    assert "error" not in grown and "error" not in shrunk
    assert [added["index"] for added in grown["added"]] == [1, 2]
    assert all(added["policy_version"] >= GROW_AT_STEP - 2 for added in grown["added"])  # not the model directory's
    assert grown["generators"] == [0, 1, 2]
    assert [removed["index"] for removed in shrunk["removed"]] == [2]
    assert shrunk["generators"] == [0, 1]
    assert summary["generator_recoveries"] == []  # nothing was replaced: removing is not a failure


def test_each_step_counts_the_pool_it_trained_with(scaled_run):
    _, _, metrics, _ = scaled_run
    counts = [m[NUM_GENERATORS] for m in metrics]
    assert counts[:GROW_AT_STEP] == [1] * GROW_AT_STEP
    assert counts[GROW_AT_STEP:SHRINK_AT_STEP] == [3] * (SHRINK_AT_STEP - GROW_AT_STEP)
    assert counts[SHRINK_AT_STEP:] == [2] * (STEPS - SHRINK_AT_STEP)


def test_the_removed_generators_processes_are_gone_and_processes_json_follows_the_pool(scaled_run):
    _, seen, *_ = scaled_run
    after_grow, after_shrink = seen["processes"]
    assert all(after_grow) and len(after_grow) == 3
    assert after_shrink[2] == [] and after_shrink[:2] == after_grow[:2]
    removed = after_grow[2]
    _, alive = psutil.wait_procs([psutil.Process(p) for p in removed if psutil.pid_exists(p)], timeout=30)
    assert not alive, f"the removed generator's processes outlived it: {alive}"


def test_no_prompt_is_lost_or_trained_twice(scaled_run):
    summary, *_, config = scaled_run
    assert summary["steps"] == config.steps
    assert_every_prompt_accounted_for(summary["accounting"], trained=config.steps * config.prompts_per_step)
