"""The loops (forge_rl/loop.py) against named fakes of the actors: what they do with failures."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from forge_rl.buffer import BufferConfig
from forge_rl.config import GRPOConfig
from forge_rl.errors import GeneratorLost, TrainStepTimedOut
from forge_rl.loop import Pipeline, RunActors
from forge_rl.metrics import MetricsLogger
from forge_rl.trainer import TrainStepResult
from tests.fakes import FakeBuffer, FakeDataset, FakeLifecycle, completions_for, endpoints
from tests.helpers import wait_until_async

CONFIG = GRPOConfig(steps=3, train_batch_size=4, group_size=2, prompts_in_flight_per_generator=2,
                    buffer=BufferConfig(max_policy_age=1, capacity_episodes=8))


def make_pipeline(generate, config: GRPOConfig = CONFIG) -> Pipeline:
    state = {"version": 0}

    async def train_step(episodes):
        state["version"] += 1
        metrics = {"num_tokens": 8, "step_skipped": 0, "policy_version": state["version"]}
        return TrainStepResult(state["version"], skipped=False, weights_dir="/nowhere", metrics=metrics)

    async def update_weights(index, policy_version, weights_dir):
        return {"policy_version": policy_version}

    async def wait_until_serving(index):
        return state["version"]

    async def score(episodes, timeline):
        return episodes

    async def no_stats():
        return {}

    actors = RunActors(
        dataset=FakeDataset(),
        generators=endpoints(generate=generate, update_weights=update_weights, wait_until_serving=wait_until_serving),
        buffer=FakeBuffer(config.buffer),
        trainer=endpoints(train_step=train_step),
        score=score,
        stats=no_stats,
    )
    return Pipeline(config, actors)


def run(pipeline: Pipeline, tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl", pipeline.config.steps, progress_every_s=1e9)
    try:
        return asyncio.run(asyncio.wait_for(pipeline.run(tmp_path, logger, FakeLifecycle()), 30))
    finally:
        logger.close()


def test_a_rollout_that_fails_unexpectedly_fails_the_run_instead_of_dying_unseen(tmp_path):
    """Before, a rollout task's exception stayed inside gather(return_exceptions=True), its episode
    stayed counted in flight, and the train loop waited for it forever."""

    async def generate(index, prompts, group_size):
        raise ValueError("the engine died in a way nobody expected")

    with pytest.raises(ValueError, match="nobody expected"):
        run(make_pipeline(generate), tmp_path)


def test_prompts_of_a_lost_generator_are_handed_out_again_and_nothing_is_trained_twice(tmp_path):
    calls = {"n": 0}

    async def generate(index, prompts, group_size):
        calls["n"] += 1
        await asyncio.sleep(0)  # a remote call yields to the event loop
        if calls["n"] == 2:  # the second call's generator dies mid-request
            raise GeneratorLost(index, "its process died")
        version = pipeline.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    pipeline = make_pipeline(generate)
    history, accounting = run(pipeline, tmp_path)

    assert len(history) == CONFIG.steps
    assert accounting["requeued_after_generator_failure"] == 1
    assert accounting["trained_more_than_once"] == 0
    assert accounting["trained"] == CONFIG.steps * CONFIG.prompts_per_step


class FakeActorError(Exception):
    """Stands in for Monarch's ActorError: the endpoint's exception travels as `.exception`."""

    def __init__(self, exception: BaseException):
        super().__init__(f"actor failed: {exception!r} (traceback of the remote process)")
        self.exception = exception


def test_a_wrapped_generator_loss_is_recovered_and_any_other_error_keeps_its_remote_report(tmp_path):
    calls = {"n": 0}

    async def generate(index, prompts, group_size):
        calls["n"] += 1
        await asyncio.sleep(0)
        if calls["n"] == 2:
            raise FakeActorError(GeneratorLost(index, "its process died"))
        if calls["n"] == 5:
            raise FakeActorError(ValueError("prompt longer than the context"))
        version = pipeline.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    pipeline = make_pipeline(generate)
    with pytest.raises(FakeActorError, match="traceback of the remote process"):
        run(pipeline, tmp_path)
    assert pipeline.accounting.requeued == 1


def test_a_train_step_past_its_timeout_fails_the_run_naming_the_step_the_timeout_and_the_flag(tmp_path):
    """A hung trainer (its step never returns, by construction) stops the run instead of hanging it;
    forge_rl/lifecycle.py then adds the resume command to the message (tests/unit/test_checkpoint.py)."""

    async def generate(index, prompts, group_size):
        await asyncio.sleep(0)
        return [dataclasses.replace(p, completions=completions_for(p, group_size, 0)) for p in prompts]

    async def train_step_that_hangs(episodes):
        await asyncio.Event().wait()  # never set

    pipeline = make_pipeline(generate, dataclasses.replace(CONFIG, train_step_timeout_s=0.5))
    pipeline.actors.trainer = endpoints(train_step=train_step_that_hangs)

    with pytest.raises(TrainStepTimedOut) as raised:
        run(pipeline, tmp_path)
    assert raised.value.step == 1
    assert "train step 1 did not finish within train_step_timeout_s (0.5 s)" in str(raised.value)
    assert "raise --train-step-timeout-s" in str(raised.value)



def test_a_stop_cancels_the_weight_updates_in_flight_instead_of_leaving_them_to_fail_unseen(tmp_path):
    """Before, updates still in flight at Ctrl-C outlived the loops, then failed when the pool
    stopped, and asyncio printed "Task exception was never retrieved" for each."""
    updates_in_flight, updates_cancelled = [], []

    async def generate(index, prompts, group_size):
        await asyncio.sleep(0)
        return [dataclasses.replace(p, completions=completions_for(p, group_size, 0)) for p in prompts]

    async def update_weights_that_hang(index, policy_version, weights_dir):
        updates_in_flight.append(policy_version)
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            updates_cancelled.append(policy_version)
            raise

    async def wait_until_serving(index):
        return 0

    pipeline = make_pipeline(generate)
    pipeline.actors.generators = endpoints(
        generate=generate, update_weights=update_weights_that_hang, wait_until_serving=wait_until_serving
    )

    async def stopped_with_an_update_in_flight():
        logger = MetricsLogger(tmp_path / "metrics.jsonl", CONFIG.steps, progress_every_s=1e9)
        loops = asyncio.ensure_future(pipeline.run(tmp_path, logger, FakeLifecycle()))
        await wait_until_async(lambda: updates_in_flight, "a weight update in flight")
        loops.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loops
        logger.close()

    asyncio.run(asyncio.wait_for(stopped_with_an_update_in_flight(), 30))
    assert updates_in_flight and updates_cancelled == updates_in_flight
