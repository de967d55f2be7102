"""The loops against named fakes of the actors: the train loop (forge_rl/run/loop.py) and the rollouts
(forge_rl/pipeline/rollouts.py, a real Rollouts called in this event loop as its actor would be): what they
do with failures."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.core.columns import exact_versions
from forge_rl.envs.calculator import make_calculator_env
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import EnvironmentConfig
from forge_rl.envs.runner import EpisodeLimits, SampledTurn
from forge_rl.errors import GeneratorFailed, GeneratorLost, TrainStepTimedOut
from forge_rl.observability import metric_names as m
from forge_rl.observability import metrics
from forge_rl.observability.sinks import MetricsLogger
from forge_rl.pipeline.rollouts import RolloutActors, Rollouts
from forge_rl.run.loop import Pipeline, RunActors
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.training.trainer_steps import BatchPrefetch, TrainStepResult
from forge_rl.types import Completion, CompletionStatus, Episode, completion_to_dict
from tests.support.fakes import (
    FakeActorError,
    FakeEndpoint,
    FakeLifecycle,
    FakePrompts,
    completions_for,
    endpoints,
    local_actor,
    pulling_trainer,
)
from tests.support.helpers import wait_until_async

CONFIG = GRPOConfig(
    steps=3,
    train_batch_size=4,
    group_size=2,
    prompts_in_flight_per_generator=2,
    buffer=BufferConfig(max_policy_age=1, capacity_episodes=8),
)


ROLLOUTS_ENDPOINTS = (
    "start",
    "wait_for_failure",
    "batch_for_trainer",
    "batch_taken",
    "withhold_batch",
    "step_done",
    "stop_loops",
    "state_dict",
    "load_state_dict",
)


def make_pipeline(generate=None, config: GRPOConfig = CONFIG, renderer=None, prompts=None) -> tuple[Pipeline, Rollouts]:
    """The train loop, and the rollouts it calls; `generate`: the generators' FAKE generate; by
    default every call succeeds with completions stamped with the calling generator's current
    version."""
    state = {"version": 0}

    async def generate_at_the_generators_version(index, prompts, group_size):
        await asyncio.sleep(0)  # a remote call yields to the event loop
        version = rollouts.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    async def train_step(episodes):
        state["version"] += 1
        metrics = {"num_tokens": 8, "step_skipped": 0, "policy_version": state["version"]}
        return TrainStepResult(state["version"], skipped=False, weights_dir="/nowhere", metrics=metrics)

    async def update_weights(index, policy_version):
        return {"policy_version": policy_version}

    async def wait_until_serving(index):
        return state["version"]

    async def score(episodes, timeline):
        return episodes

    async def no_stats():
        return {}

    generators = endpoints(
        generate=generate or generate_at_the_generators_version,
        update_weights=update_weights,
        wait_until_serving=wait_until_serving,
    )
    rollouts = Rollouts(config, RolloutActors(generators, score, no_stats, renderer), prompts or FakePrompts())
    pipeline = Pipeline(
        config,
        RunActors(rollouts=local_actor(rollouts, *ROLLOUTS_ENDPOINTS), trainer=pulling_trainer(train_step, rollouts)),
    )
    return pipeline, rollouts


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
        run(make_pipeline(generate)[0], tmp_path)


def test_prompts_of_a_lost_generator_are_handed_out_again_and_nothing_is_trained_twice(tmp_path):
    calls = {"n": 0}

    async def generate(index, prompts, group_size):
        calls["n"] += 1
        call = calls["n"]  # the calls overlap: each knows its own number
        await asyncio.sleep(0)  # a remote call yields to the event loop
        if call == 2:  # the second call's generator dies mid-request
            raise GeneratorLost(index, "its process died")
        version = rollouts.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    pipeline, rollouts = make_pipeline(generate)
    history, accounting = run(pipeline, tmp_path)

    assert len(history) == CONFIG.steps
    assert accounting["requeued_after_generator_failure"] == 1
    assert accounting["trained_more_than_once"] == 0
    assert accounting["trained"] == CONFIG.steps * CONFIG.prompts_per_step


SEGMENT_CONFIG = dataclasses.replace(
    CONFIG, generator=dataclasses.replace(CONFIG.generator, max_new_tokens=6, segment_tokens=2)
)


class DistinctPrompts(FakePrompts):
    """FakePrompts whose token ids tell the prompts apart ([1, 2, 3, its index]), and which hand
    out a resume's prompts to re-issue first."""

    def __init__(self):
        super().__init__()
        self.reissue: list[int] = []

    def next_episodes(self, num_prompts: int) -> list[Episode]:
        episodes = []
        for _ in range(num_prompts):
            if self.reissue:
                index = self.reissue.pop(0)
                episodes.append(Episode(index, f"prompt {index}", "7", [1, 2, 3]))
            else:
                episodes.extend(super().next_episodes(1))
        return [dataclasses.replace(e, prompt_token_ids=[1, 2, 3, e.episode_id]) for e in episodes]

    def load_state(self, cursor: int, reissue: list[int], data_fingerprint: str | None = None) -> None:
        self.cursor, self.reissue = cursor, list(reissue)


def fake_segments(rollouts, lose_first_continuation: bool = False, hold_versions_at: int | None = None):
    """A FAKE `generate_segment`: each piece is `segment_tokens` tokens (token i of a completion
    is i + 10), finished once the budget is sampled; with `lose_first_continuation` the first call
    that continues a group raises GeneratorLost (its generator died mid-segment, the group's
    first segment sampled). Records every call. `hold_versions_at`: the first pieces carry this
    version instead of the generator's."""
    calls: list[dict] = []

    async def generate_segment(index, prompt_token_ids, forced_length, heads, group_size, segment_tokens):
        first_continuation = heads is not None and not any(c["heads"] is not None for c in calls)
        calls.append({"index": index, "prompt": list(prompt_token_ids), "heads": heads})
        await asyncio.sleep(0)  # a remote call yields to the event loop
        if lose_first_continuation and first_continuation:
            raise GeneratorLost(index, "its process died")
        version = rollouts.gate.generator_versions[index]
        if heads is None and hold_versions_at is not None:
            version = hold_versions_at
        starts = [0] * group_size if heads is None else [len(head) for head in heads]
        pieces = []
        for start in starts:
            n = min(segment_tokens, SEGMENT_CONFIG.generator.max_new_tokens - start)
            tokens = [start + i + 10 for i in range(n)]
            done = start + n >= SEGMENT_CONFIG.generator.max_new_tokens
            pieces.append((Completion(tokens, [-0.5] * n, [version] * n, status=CompletionStatus.TRUNCATED), done))
        return pieces

    return generate_segment, calls


def test_a_group_decoded_in_segments_is_joined_in_order(tmp_path):
    pipeline, rollouts = make_pipeline(config=SEGMENT_CONFIG, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(rollouts)
    rollouts.actors.generators.generate_segment = FakeEndpoint(generate_segment)
    taken = []
    step_done = rollouts.step_done

    async def recording_step_done(step, skipped, policy_version):
        taken.extend(rollouts.taken[step].episodes)
        return await step_done(step, skipped, policy_version)

    rollouts.step_done = recording_step_done
    pipeline.actors.rollouts = local_actor(rollouts, *ROLLOUTS_ENDPOINTS)
    run(pipeline, tmp_path)
    assert taken and all(c.token_ids == list(range(10, 16)) for e in taken for c in e.completions)
    # Three calls per group: the first segment, then two continuations of both completions (fewer
    # for a group the run's end cut short).
    heads = collections.Counter(repr(c["heads"]) for c in calls)
    assert list(heads) == ["None", repr([[10, 11]] * 2), repr([[10, 11, 12, 13]] * 2)]
    assert heads["None"] >= heads[repr([[10, 11]] * 2)] >= heads[repr([[10, 11, 12, 13]] * 2)] >= len(taken)


def test_a_lost_generators_segments_are_continued_on_the_next_and_counted(tmp_path):
    pipeline, rollouts = make_pipeline(config=SEGMENT_CONFIG, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(rollouts, lose_first_continuation=True)
    rollouts.actors.generators.generate_segment = FakeEndpoint(generate_segment)
    history, accounting = run(pipeline, tmp_path)

    at = next(i for i, c in enumerate(calls) if c["heads"] is not None)
    lost = calls[at]
    # The next call for that prompt continued from exactly the heads the lost call had been given.
    resumed = next(c for c in calls[at + 1 :] if c["prompt"] == lost["prompt"])
    assert resumed["heads"] == lost["heads"]
    assert accounting["continued_after_generator_failure"] == 1
    assert accounting["salvaged_tokens"] == sum(len(head) for head in lost["heads"])
    assert accounting["salvage_discarded_tokens"] == 0
    assert accounting["trained_more_than_once"] == 0
    assert accounting["trained"] == SEGMENT_CONFIG.steps * SEGMENT_CONFIG.prompts_per_step


def test_the_generator_that_took_over_a_migrated_group_dying_in_turn_passes_it_on_again(tmp_path):
    """Lost twice: the second generator's continuation fails too; the third continues from
    everything the first two sampled, and the prompt is still trained once."""
    pipeline, rollouts = make_pipeline(config=SEGMENT_CONFIG, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(rollouts)
    losses = {"left": 2}

    async def lose_the_first_two_continuations_of_prompt_zero(index, prompt_token_ids, forced_length, heads, *rest):
        if prompt_token_ids[-1] == 0 and heads is not None and losses["left"]:
            calls.append({"index": index, "prompt": list(prompt_token_ids), "heads": heads, "lost": True})
            losses["left"] -= 1
            raise GeneratorLost(index, "its process died")
        return await generate_segment(index, prompt_token_ids, forced_length, heads, *rest)

    rollouts.actors.generators.generate_segment = FakeEndpoint(lose_the_first_two_continuations_of_prompt_zero)
    _, accounting = run(pipeline, tmp_path)
    of_zero = [c for c in calls if c["prompt"][-1] == 0]
    assert [c["heads"] for c in of_zero[:4]] == [None, [[10, 11]] * 2, [[10, 11]] * 2, [[10, 11]] * 2]
    assert [c.get("lost", False) for c in of_zero[:4]] == [False, True, True, False]
    assert accounting["continued_after_generator_failure"] == 2
    assert accounting["requeued_after_generator_failure"] == 2
    assert accounting["trained_more_than_once"] == 0


@pytest.mark.parametrize("drop_policy", ["drop_episode", "mask_tokens"])
def test_salvaged_tokens_already_too_old_restart_the_completion_or_are_masked(drop_policy, tmp_path):
    """A head sampled at a version the trainer can no longer take (-5, with max_policy_age 1):
    drop_episode starts its completion afresh (its whole group would be dropped for it), counted
    as discarded; mask_tokens continues it, and the buffer masks those tokens."""
    config = dataclasses.replace(
        SEGMENT_CONFIG, buffer=dataclasses.replace(SEGMENT_CONFIG.buffer, drop_policy=drop_policy)
    )
    pipeline, rollouts = make_pipeline(config=config, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(rollouts, lose_first_continuation=True, hold_versions_at=-5)
    rollouts.actors.generators.generate_segment = FakeEndpoint(generate_segment)
    _, accounting = run(pipeline, tmp_path)
    at = next(i for i, c in enumerate(calls) if c["heads"] is not None)
    lost = calls[at]
    resumed = next(c for c in calls[at + 1 :] if c["prompt"] == lost["prompt"])
    if drop_policy == "drop_episode":
        assert resumed["heads"] is None  # every completion restarted: one request for the group
        assert accounting["salvage_discarded_tokens"] == sum(len(head) for head in lost["heads"])
        assert accounting["salvaged_tokens"] == 0
    else:
        assert resumed["heads"] == lost["heads"]
        assert accounting["salvaged_tokens"] == sum(len(head) for head in lost["heads"])
    assert accounting["trained_more_than_once"] == 0


def state_with_partial_groups() -> dict:
    """The rollouts' state (as a checkpoint's controller state holds it) taken while groups wait
    on their second segment: their first segments (2 tokens each) are their partial groups."""
    _, rollouts = make_pipeline(config=SEGMENT_CONFIG, prompts=DistinctPrompts())
    held = asyncio.Event()

    async def hold_continuations(index, prompt_token_ids, forced_length, heads, group_size, segment_tokens):
        if heads is not None:
            held.set()
            await asyncio.Event().wait()  # until the run is torn down
        return [(Completion([10, 11], [-0.5] * 2, [0] * 2), False) for _ in range(group_size)]

    rollouts.actors.generators.generate_segment = FakeEndpoint(hold_continuations)

    async def state_once_held() -> dict:
        rollouts.start(None, None)
        await held.wait()
        state = rollouts.state_dict(include_episodes=True)
        await rollouts.stop_loops(finish_updates=False)
        return state

    state = asyncio.run(asyncio.wait_for(state_once_held(), 30))
    return {**state, "dataset_cursor": state["prompts"]["cursor"]}


def test_a_checkpoint_keeps_groups_mid_generation_and_a_resume_continues_them(tmp_path):
    """The rollouts' state taken while a group waits on its second segment holds the group as of
    its first; a resume from that state continues it from there (its prompt re-issued once)."""
    state = state_with_partial_groups()
    assert state["partial_groups"], "no group was mid-generation"
    assert {g["episode_id"] for g in state["partial_groups"]} <= set(state["reissue"])
    assert all(c["token_ids"] == [10, 11] for g in state["partial_groups"] for c in g["completions"])

    pipeline, resumed = make_pipeline(config=SEGMENT_CONFIG, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(resumed)
    resumed.actors.generators.generate_segment = FakeEndpoint(generate_segment)
    asyncio.run(resumed.load_state_dict(state, 0))
    history, accounting = run(pipeline, tmp_path)
    first_calls = {}
    for call in calls:
        first_calls.setdefault(tuple(call["prompt"]), call)
    continued = sorted(prompt[-1] for prompt, call in first_calls.items() if call["heads"] is not None)
    # Those prompts' first calls continued the saved heads; every other prompt began afresh.
    assert continued == sorted(g["episode_id"] for g in state["partial_groups"])
    assert all(first_calls[(1, 2, 3, i)]["heads"] == [[10, 11]] * 2 for i in continued)
    assert accounting["continued_after_resume"] == len(state["partial_groups"])
    assert accounting["salvaged_tokens"] == 4 * len(state["partial_groups"])
    assert accounting["trained_more_than_once"] == 0


@pytest.mark.parametrize("change", ["no segments", "a budget as long as the heads"])
def test_a_resume_with_other_generation_settings_starts_afresh_or_takes_the_heads_as_done(change, tmp_path):
    """Resumed without generator.segment_tokens, the saved groups' prompts are generated from the
    start (their tokens counted as discarded); with max_new_tokens lowered to the heads' length,
    each head is a finished completion (nothing more is asked of a generator for it)."""
    state = state_with_partial_groups()
    generator = SEGMENT_CONFIG.generator
    generator = (
        dataclasses.replace(generator, segment_tokens=None)
        if change == "no segments"
        else dataclasses.replace(generator, max_new_tokens=2)
    )
    config = dataclasses.replace(SEGMENT_CONFIG, generator=generator)
    pipeline, resumed = make_pipeline(config=config, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(resumed)
    resumed.actors.generators.generate_segment = FakeEndpoint(generate_segment)
    asyncio.run(resumed.load_state_dict(state, 0))
    _, accounting = run(pipeline, tmp_path)
    saved_tokens = 2 * SEGMENT_CONFIG.group_size * len(state["partial_groups"])
    if change == "no segments":
        assert accounting["salvage_discarded_tokens"] == saved_tokens and accounting["continued_after_resume"] == 0
    else:
        assert accounting["continued_after_resume"] == len(state["partial_groups"])
        saved_ids = {group["episode_id"] for group in state["partial_groups"]}
        assert not any(call["prompt"][-1] in saved_ids for call in calls)  # all done: no generator asked
    assert accounting["trained_more_than_once"] == 0


@pytest.mark.parametrize(
    "partial_groups, message",
    [
        (
            [{"episode_id": 999, "completions": [], "finished": []}],
            "its prompt 999 is not among the checkpoint's prompts to re-issue",
        ),
        ([{"episode_id": 0, "completions": [{"token_ids": [1]}], "finished": [False]}], "partial group 0 is malformed"),
        ([{"completions": [], "finished": []}], "KeyError"),
        (
            [
                {
                    "episode_id": 1,
                    "completions": [completion_to_dict(Completion([3, 70], [-0.1] * 2, [0] * 2))],
                    "finished": [False],
                }
            ],
            "token id 70 is outside the model's vocabulary (0 to 63)",
        ),
    ],
)
def test_a_checkpoints_malformed_partial_group_is_named_with_its_problem(partial_groups, message):
    from forge_rl.pipeline.partial_groups import partial_groups_problem

    assert message in partial_groups_problem(partial_groups, [0, 1], 64, saved_tokenizer=None, tokenizer=None)


def test_partial_groups_sampled_under_another_tokenizer_are_named_as_such():
    from forge_rl.pipeline.partial_groups import partial_groups_problem

    group = {"episode_id": 0, "completions": [completion_to_dict(Completion([3], [-0.1], [0]))], "finished": [False]}
    assert partial_groups_problem([group], [0], 64, "aaaa", "aaaa") is None
    assert "sampled under another tokenizer (fingerprint aaaa; the model directory's is bbbb)" in (
        partial_groups_problem([group], [0], 64, "aaaa", "bbbb")
    )


@pytest.mark.parametrize("on_error", ["refuse", "regenerate"])
def test_a_resume_refuses_a_corrupt_partial_group_or_generates_its_prompts_afresh(on_error, tmp_path):
    """A saved group with a token id outside the vocabulary: refused (nothing starts), or, with
    checkpoint.partial_groups_on_error regenerate, every saved group's prompt generated from the
    start, its tokens counted as discarded, each prompt still trained once."""
    state = state_with_partial_groups()
    state["partial_groups"][0]["completions"][0]["token_ids"][0] = 10**6
    config = dataclasses.replace(
        SEGMENT_CONFIG, checkpoint=dataclasses.replace(SEGMENT_CONFIG.checkpoint, partial_groups_on_error=on_error)
    )
    pipeline, resumed = make_pipeline(config=config, prompts=DistinctPrompts())
    generate_segment, calls = fake_segments(resumed)
    resumed.actors.generators.generate_segment = FakeEndpoint(generate_segment)
    if on_error == "refuse":
        with pytest.raises(
            ValueError, match="token id 1000000 is outside the model's vocabulary.*partial-groups-on-error regenerate"
        ):
            asyncio.run(resumed.load_state_dict(state, 0))
        return
    asyncio.run(resumed.load_state_dict(state, 0))
    _, accounting = run(pipeline, tmp_path)
    assert accounting["salvage_discarded_tokens"] == 2 * SEGMENT_CONFIG.group_size * len(state["partial_groups"])
    assert accounting["continued_after_resume"] == 0 and accounting["salvaged_tokens"] == 0
    first_calls = {}
    for call in calls:
        first_calls.setdefault(tuple(call["prompt"]), call)
    assert all(call["heads"] is None for call in first_calls.values())  # every prompt began afresh
    assert accounting["trained_more_than_once"] == 0


def test_a_wrapped_generator_loss_is_recovered_and_any_other_error_keeps_its_remote_report(tmp_path):
    calls = {"n": 0}

    async def generate(index, prompts, group_size):
        calls["n"] += 1
        call = calls["n"]  # the calls overlap: each knows its own number
        await asyncio.sleep(0)
        if call == 2:
            raise FakeActorError(GeneratorLost(index, "its process died"))
        if call == 5:
            raise FakeActorError(ValueError("prompt longer than the context"))
        version = rollouts.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    pipeline, rollouts = make_pipeline(generate)
    with pytest.raises(FakeActorError, match="traceback of the remote process"):
        run(pipeline, tmp_path)
    assert rollouts.accounting.requeued == 1


def test_a_train_step_past_its_timeout_fails_the_run_naming_the_step_the_timeout_and_the_flag(tmp_path):
    """A hung trainer (its step never returns, by construction) stops the run instead of hanging it;
    forge_rl/run/lifecycle.py then adds the resume command to the message (tests/unit/core/test_checkpoint.py)."""

    async def generate(index, prompts, group_size):
        await asyncio.sleep(0)
        return [dataclasses.replace(p, completions=completions_for(p, group_size, 0)) for p in prompts]

    async def train_step_that_hangs(episodes):
        await asyncio.Event().wait()  # never set

    pipeline, rollouts = make_pipeline(generate, dataclasses.replace(CONFIG, train_step_timeout_s=0.5))
    pipeline.actors.trainer = pulling_trainer(train_step_that_hangs, rollouts)

    with pytest.raises(TrainStepTimedOut) as raised:
        run(pipeline, tmp_path)
    assert raised.value.step == 1
    assert "train step 1 did not finish within train_step_timeout_s (0.5 s)" in str(raised.value)
    assert "raise --train-step-timeout-s" in str(raised.value)


def test_a_steps_timeout_counts_from_when_its_batch_left_the_buffer_not_from_its_wait_for_data(tmp_path):
    """Step 1's episodes come only once the train loop has waited past train_step_timeout_s for
    them, and so asked the rollouts when the batch left (a step within its timeout never asks):
    the run trains on, since a step's wait for data is not timed."""
    released, asked = asyncio.Event(), []

    async def generate(index, prompts, group_size):
        await released.wait()
        version = rollouts.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    pipeline, rollouts = make_pipeline(generate, dataclasses.replace(CONFIG, train_step_timeout_s=1.0))
    batch_taken = pipeline.actors.rollouts.batch_taken.function

    async def asked_then_released(step):
        asked.append(step)
        released.set()
        return await batch_taken(step)

    pipeline.actors.rollouts.batch_taken = FakeEndpoint(asked_then_released)
    history, accounting = run(pipeline, tmp_path)
    assert [h[m.STEP] for h in history] == [1, 2, 3]
    assert asked[0] == 1
    assert accounting["trained"] == CONFIG.steps * CONFIG.prompts_per_step


def test_a_stop_cancels_the_weight_updates_in_flight_instead_of_leaving_them_to_fail_unseen(tmp_path):
    """Before, updates still in flight at Ctrl-C outlived the loops, then failed when the pool
    stopped, and asyncio printed "Task exception was never retrieved" for each."""
    updates_in_flight, updates_cancelled = [], []

    async def generate(index, prompts, group_size):
        await asyncio.sleep(0)
        return [dataclasses.replace(p, completions=completions_for(p, group_size, 0)) for p in prompts]

    async def update_weights_that_hang(index, policy_version):
        updates_in_flight.append(policy_version)
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            updates_cancelled.append(policy_version)
            raise

    async def wait_until_serving(index):
        return 0

    pipeline, rollouts = make_pipeline(generate)
    rollouts.actors.generators = endpoints(
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
    assert updates_in_flight and sorted(updates_cancelled) == sorted(updates_in_flight)


def test_the_next_steps_batch_reaches_the_trainer_while_the_step_before_it_trains(tmp_path):
    """One step ahead: the trainer takes one call at a time, yet step 1 finishes only once step 2's
    batch has left the buffer for the trainer, which deadlocks (and fails by the run's timeout)
    unless the trainer asks for it while step 1 trains (BatchPrefetch)."""
    pipeline, rollouts = make_pipeline()
    train_step = pipeline.actors.trainer.train_step.function
    trained: list[int] = []

    async def train_step_that_waits_for_the_next_batch(episodes):
        trained.append(len(trained) + 1)
        if trained == [1]:
            await wait_until_async(lambda: rollouts._taken_through >= 2, "step 2's batch taken while step 1 trains")
        return await train_step(episodes)

    pipeline.actors.trainer = pulling_trainer(train_step_that_waits_for_the_next_batch, rollouts)
    history, accounting = run(pipeline, tmp_path)
    assert [h[m.STEP] for h in history] == [1, 2, 3]
    assert accounting["trained"] == CONFIG.steps * CONFIG.prompts_per_step
    assert accounting["trained_more_than_once"] == 0


def _stopped_while_step_1_trains(pipeline: Pipeline, rollouts: Rollouts, tmp_path, stop_when, what: str) -> list[dict]:
    """Run `pipeline` with a shutdown checkpoint wanted, its trainer's step 1 held until a stop
    (the run task cancelled, as Ctrl-C does) has come once `stop_when()` held; the logged steps."""
    train_step = pipeline.actors.trainer.train_step.function
    stopped, steps_begun = asyncio.Event(), []

    async def step_1_trains_until_the_stop(episodes):
        steps_begun.append(len(steps_begun) + 1)
        if steps_begun == [1]:
            await stopped.wait()
        return await train_step(episodes)

    class StopWaitsForSteps(FakeLifecycle):
        stop_waits_for_steps = True

    async def scenario():
        logger = MetricsLogger(tmp_path / "metrics.jsonl", pipeline.config.steps, progress_every_s=1e9)
        run_task = asyncio.ensure_future(pipeline.run(tmp_path, logger, StopWaitsForSteps()))
        await wait_until_async(stop_when, what)
        run_task.cancel()
        stopped.set()
        with pytest.raises(asyncio.CancelledError):
            await run_task
        history = logger.logged()
        logger.close()
        return history

    pipeline.actors.trainer = pulling_trainer(step_1_trains_until_the_stop, rollouts)
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_stop_trains_the_batch_the_trainer_took_ahead_and_withholds_the_rest(tmp_path):
    """A stop arrives while step 1 trains, after the trainer took step 2's batch ahead: step 2 is
    trained and accounted (the shutdown checkpoint holds it as trained), step 3's batch (its
    prompts never finish) is withheld, and nothing is left taken and untrained."""
    pipeline, rollouts = make_pipeline(_generate_only_the_first_prompts(2 * CONFIG.prompts_per_step))
    history = _stopped_while_step_1_trains(
        pipeline, rollouts, tmp_path, lambda: rollouts._taken_through >= 2, "step 2's batch taken ahead"
    )
    assert [h[m.STEP] for h in history] == [1, 2]
    assert pipeline.step == 2 and not pipeline.step_in_flight
    assert rollouts.taken == {}
    accounting = pipeline.rollouts_at_stop["accounting"]
    assert accounting["trained"] == 2 * CONFIG.prompts_per_step and accounting["trained_more_than_once"] == 0


@pytest.mark.parametrize("kv", ["re-encoded", "reused"])
def test_partial_rollouts_train_on_past_a_straggler_and_mask_only_its_tokens_that_depend_on_over_age_weights(
    tmp_path, kv
):
    """buffer.wait_for_stragglers false, age bound 2: the first prompt's rollout is still decoding
    at step 3, its last chance; the run trains on without it. It comes back once its generator
    serves version 4, its first tokens sampled at 0 and its last at 4, and is trained with every
    token that depends on version 0 masked: every trained token within the bound by the oldest
    weights it depends on, the prompt trained once or counted as dropped, nothing lost. Where the
    swap re-encoded its KV (an abort resubmission: `Completion.kv_versions` says so) the version-4
    token depends on version 4 alone and is trained; where the swap kept its KV (swap_kv reuse) it
    attends to what version 0 encoded, and the straggler has nothing left to train."""
    config = dataclasses.replace(
        CONFIG,
        steps=8,
        buffer=BufferConfig(
            max_policy_age=2, capacity_episodes=8, wait_for_stragglers=False, drop_policy="mask_tokens"
        ),
    )
    straggler_ids: list[int] = []

    async def generate(index, prompts, group_size):
        await asyncio.sleep(0)
        if not straggler_ids:
            straggler_ids.extend(p.episode_id for p in prompts)
            await wait_until_async(lambda: rollouts.gate.generator_versions[index] >= 4, "version 4 served")
            stale_then_fresh = [
                Completion(
                    [5, 6, 2],
                    [-0.5] * 3,
                    [0, 0, 4],
                    reward=float(i % 2),
                    **({"kv_versions": [0, 0, 4]} if kv == "re-encoded" else {}),
                )
                for i in range(group_size)
            ]
            return [dataclasses.replace(p, completions=stale_then_fresh) for p in prompts]
        version = rollouts.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    pipeline, rollouts = make_pipeline(generate, config)
    train_step = pipeline.actors.trainer.train_step.function
    trained: list[tuple[int, list[Episode]]] = []  # (version trained at, batch)

    async def recording_train_step(episodes):
        trained.append((len(trained), episodes))
        if len(trained) == 5:
            # The fake trainer takes no time: step 5 (version 4) trains until the straggler is
            # back, so the steps cannot run past its fresh token's bound before it arrives.
            await wait_until_async(lambda: 0 not in rollouts.gate.in_flight_versions, "the straggler back")
        return await train_step(episodes)

    pipeline.actors.trainer = pulling_trainer(recording_train_step, rollouts)
    history, accounting = run(pipeline, tmp_path)

    assert [h[m.STEP] for h in history] == list(range(1, 9))
    stragglers = [(version, e) for version, batch in trained for e in batch if e.episode_id in straggler_ids]
    if kv == "re-encoded":
        ((straggler_version, straggler),) = stragglers
        assert straggler_version in (5, 6)  # after its last chance under the bound (step 3, version 2)
        for completion in straggler.completions:
            assert completion.trainable == [False, False, True]  # the version-0 tokens masked, the fresh one kept
        assert history[-1]["buffer/dropped_tokens"] == 2 * config.group_size
    else:
        assert stragglers == []
        assert history[-1]["buffer/dropped_tokens"] == 3 * config.group_size
        assert history[-1]["buffer/dropped_episodes"] == 1
    for version, batch in trained:
        for completion in (c for e in batch for c in e.completions):
            ages = [version - v for v, trains in zip(exact_versions(completion), completion.loss_mask) if trains]
            assert max(ages) <= 2
    assert accounting["trained"] == config.steps * config.prompts_per_step
    assert accounting["dropped"] == (0 if kv == "re-encoded" else 1)
    assert accounting["trained_more_than_once"] == 0


def _generate_only_the_first_prompts(num_prompts: int):
    """A FAKE generate that serves the first `num_prompts` prompts and then never returns, so the
    batches after them wait at the gate for good."""
    served = {"n": 0}

    async def generate(index, prompts, group_size):
        if served["n"] >= num_prompts:
            await asyncio.Event().wait()
        served["n"] += len(prompts)
        return [dataclasses.replace(p, completions=completions_for(p, group_size, 0)) for p in prompts]

    return generate


def test_a_withheld_batch_is_not_taken_whether_it_waits_at_the_gate_or_has_not_been_asked_for():
    _, rollouts = make_pipeline(_generate_only_the_first_prompts(0))

    async def scenario():
        rollouts.start(None, None)
        waiting = asyncio.ensure_future(rollouts.next_batch(1))
        await wait_until_async(lambda: rollouts._waiting is not None, "step 1 waiting at the gate")
        await rollouts.withhold_batch(1)
        assert await waiting is None
        await rollouts.withhold_batch(2)  # before its call: the call returns at once
        assert await rollouts.next_batch(2) is None
        await rollouts.stop_loops(False)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert rollouts.taken == {} and rollouts.gate.next_train_version == 0


def test_a_stop_withholds_the_batch_sent_ahead_while_it_waits_and_accounts_for_the_step_that_trained(tmp_path):
    """Step 1 trains and a stop arrives meanwhile; step 2's batch, asked for ahead, waits at the
    gate (its prompts never finish): the stop withholds it, so nothing leaves the buffer untrained."""
    pipeline, rollouts = make_pipeline(_generate_only_the_first_prompts(CONFIG.prompts_per_step))
    history = _stopped_while_step_1_trains(
        pipeline, rollouts, tmp_path, lambda: rollouts._waiting is not None, "step 2 waiting at the gate"
    )
    assert [h[m.STEP] for h in history] == [1]
    assert pipeline.step == 1 and not pipeline.step_in_flight
    assert rollouts.taken == {}
    assert pipeline.rollouts_at_stop["accounting"]["trained"] == CONFIG.prompts_per_step


def test_a_stop_while_a_steps_batch_waits_at_the_gate_withholds_it_and_the_one_asked_for_ahead(tmp_path):
    """Step 1 trains; step 2's batch never comes (its prompts never finish), and step 3's was asked
    for ahead. A stop (the run task cancelled, with a shutdown checkpoint wanted) withholds both:
    nothing leaves the buffer, no step is left in flight, so the shutdown checkpoint may be taken."""
    pipeline, rollouts = make_pipeline(_generate_only_the_first_prompts(CONFIG.prompts_per_step))

    class StopWaitsForSteps(FakeLifecycle):
        stop_waits_for_steps = True

    async def scenario():
        logger = MetricsLogger(tmp_path / "metrics.jsonl", CONFIG.steps, progress_every_s=1e9)
        run_task = asyncio.ensure_future(pipeline.run(tmp_path, logger, StopWaitsForSteps()))
        # Step 1 accounted for (the controller's step_done) and step 2's batch at the gate: the
        # gate can hold step 2 while step 1's accounting is still in flight.
        await wait_until_async(
            lambda: pipeline.step == 1 and rollouts._waiting is not None and rollouts._waiting[0] == 2,
            "step 1 accounted for and step 2 at the gate",
        )
        run_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run_task
        logger.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert pipeline.step == 1 and not pipeline.step_in_flight
    assert rollouts.taken == {}
    assert pipeline.rollouts_at_stop["accounting"]["trained"] == CONFIG.prompts_per_step


def test_a_stop_goes_on_without_rollouts_that_do_not_answer_within_the_stops_budget(tmp_path, capsys):
    """As the test above, but the rollouts never answer `withhold_batch` nor `stop_loops` (a process
    too slow or hung): the stop waits for them no longer than the stop's budget allows
    (forge_rl/run/lifecycle.py `stop_timeout`), says what it did not get, and goes on."""
    pipeline, rollouts = make_pipeline(_generate_only_the_first_prompts(CONFIG.prompts_per_step))

    class StopWithAShortBudget(FakeLifecycle):
        stop_waits_for_steps = True
        steps_done = 0

        def stop_timeout(self, bound_s: float) -> float:
            return 0.05

        async def after_step(self, pipeline) -> None:
            self.steps_done = pipeline.step

    async def never(*args):
        await asyncio.Event().wait()

    async def scenario():
        logger = MetricsLogger(tmp_path / "metrics.jsonl", CONFIG.steps, progress_every_s=1e9)
        lifecycle = StopWithAShortBudget()
        run_task = asyncio.ensure_future(pipeline.run(tmp_path, logger, lifecycle))
        # Step 1 done (the loop awaits step 2's answer from then on: its batch was sent ahead),
        # and step 2's batch waiting at the gate.
        await wait_until_async(
            lambda: lifecycle.steps_done == 1 and rollouts._waiting is not None and rollouts._waiting[0] == 2,
            "step 1 done and step 2 at the gate",
        )
        pipeline.actors.rollouts.withhold_batch = FakeEndpoint(never)
        pipeline.actors.rollouts.stop_loops = FakeEndpoint(never)
        run_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run_task
        logger.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    said = capsys.readouterr().err
    assert "did not withhold step 2's batch within 0.1 s; the stop goes on without it" in said
    assert "did not stop the rollout loops within 0.1 s" in said
    assert pipeline.rollouts_at_stop == {}


def test_no_batch_is_sent_ahead_past_a_checkpoint(tmp_path):
    """A checkpoint holds the buffer as of its step: step 3's batch leaves the buffer only after
    step 2 (followed by a checkpoint) is accounted for."""
    step_when_sent: list[int] = []

    pipeline, rollouts = make_pipeline()
    train_step = pipeline.actors.trainer.train_step.function

    async def recording_train_step(episodes):
        step_when_sent.append(pipeline.step)
        return await train_step(episodes)

    class CheckpointAfterStep2(FakeLifecycle):
        def checkpoint_due(self, step: int) -> bool:
            return step == 2

    pipeline.actors.trainer = pulling_trainer(recording_train_step, rollouts)
    logger = MetricsLogger(tmp_path / "metrics.jsonl", CONFIG.steps, progress_every_s=1e9)
    asyncio.run(asyncio.wait_for(pipeline.run(tmp_path, logger, CheckpointAfterStep2()), 30))
    logger.close()
    # Step 3's batch reaches the trainer only once step 2 is accounted for; the others may come earlier.
    assert step_when_sent[2] == 2 and max(step_when_sent[:2]) <= 1


# Environment episodes ------------------------------------------------------------------------------
# The same loops with `environment.name` set: a prompt is group_size calculator episodes, each turn
# sampled by `generate_turn` on the generator (here ScriptedCalculatorPolicy, a named fake that
# stamps each token with the version its generator serves), rewarded by the environment.

ENV_CONFIG = dataclasses.replace(
    CONFIG,
    environment=EnvironmentConfig(
        name="calculator", limits=EpisodeLimits(max_turns=3, max_total_tokens=64, max_tokens_per_turn=16)
    ),
)


class ScriptedCalculatorPolicy:
    """A fake generator that solves the calculator: the tool call on the first turn, the tool's
    result on the second. Records each turn it samples (prefix, ids, versions), the witness of
    what the trainer must see."""

    def __init__(self, tokenizer: PromptTokenizer, pipeline_versions):
        self.tokenizer = tokenizer
        self.versions = pipeline_versions
        """generator index -> the policy version it serves now."""
        self.turns: list[tuple[list[int], list[int], list[int]]] = []

    async def generate_turn(self, index: int, prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        await asyncio.sleep(0)  # a remote call yields to the event loop
        text = self.tokenizer.decode(prefix_token_ids)
        reply = text.rsplit("R", 1)[1].rstrip("=") if "R" in text else "C" + text.split("=")[0]
        token_ids = self.tokenizer.encode_text(reply) + [self.tokenizer.eos_id]
        versions = [self.versions(index)] * len(token_ids)
        self.turns.append((list(prefix_token_ids), token_ids, versions))
        return SampledTurn(token_ids, [-0.25] * len(token_ids), versions, "stop")


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


def make_env_pipeline(tokenizer: PromptTokenizer, config: GRPOConfig = ENV_CONFIG):
    """The loops over fakes, with environment episodes; returns (pipeline, rollouts, policy, trained batches)."""

    async def generate(index, prompts, group_size):
        raise AssertionError("environment episodes are sampled turn by turn, never as single-turn prompts")

    pipeline, rollouts = make_pipeline(generate, config, PlainTextRenderer(tokenizer))
    policy = ScriptedCalculatorPolicy(tokenizer, lambda index: rollouts.gate.generator_versions[index])
    rollouts.actors.generators.generate_turn = FakeEndpoint(policy.generate_turn)
    trained: list[tuple[int, list[Episode]]] = []
    train_step = pipeline.actors.trainer.train_step.function

    async def recording_train_step(episodes):
        trained.append((rollouts.gate.next_train_version - 1, episodes))
        return await train_step(episodes)

    pipeline.actors.trainer = pulling_trainer(recording_train_step, rollouts)
    return pipeline, rollouts, policy, trained


def test_environment_episodes_reach_the_trainer_as_sampled_with_context_masked_and_the_environment_reward(
    tmp_path, char_tokenizer
):
    pipeline, _, policy, trained = make_env_pipeline(char_tokenizer)
    history, accounting = run(pipeline, tmp_path)

    assert accounting["trained"] == ENV_CONFIG.steps * ENV_CONFIG.prompts_per_step
    sampled = {tuple(prefix + ids): (prefix, ids) for prefix, ids, _ in policy.turns}
    for _, episodes in trained:
        for episode in episodes:
            assert episode.prompt_token_ids == [] and len(episode.completions) == ENV_CONFIG.group_size
            for completion in episode.completions:
                # Two turns (call, answer), rewarded by the calculator; every generated run of the
                # sequence is a turn exactly as the generator sampled it, after exactly its prefix.
                assert (completion.reward, completion.num_turns, completion.end_reason) == (1.0, 2, "done")
                runs = generated_runs(completion)
                assert len(runs) == 2
                for start, end in runs:
                    prefix, ids = sampled[tuple(completion.token_ids[:end])]
                    assert (prefix, ids) == (completion.token_ids[:start], completion.token_ids[start:end])
                # Context (prompt, tool result) is in the sequence, never in the loss, no logprob.
                assert completion.loss_mask == completion.generated
                assert all(lp == 0.0 for lp, g in zip(completion.logprobs, completion.generated) if not g)
                assert char_tokenizer.decode(completion.token_ids).startswith(episode.prompt_text)
    # A step's episode figures are over the episodes played during it: which steps those are depends
    # on how far the rollouts ran ahead (a last step may play none), so every step that played some.
    played = [row for row in history if row[m.EPISODES_PLAYED] > 0]
    assert sum(row[m.EPISODES_PLAYED] for row in played) >= accounting["trained"]
    for row in played:
        assert row[m.TURNS_PER_EPISODE] == 2 and row[m.TOOL_ERROR_RATE] == 0
        assert row[f"{m.EPISODE_STATUS_PREFIX}done"] == row[m.EPISODES_PLAYED]
    for row in history:
        assert 0 <= row[m.GENERATORS_IDLE_ON_ENV_FRACTION] <= 1 and row[m.ENV_STEP_LATENCY_P99_S] >= 0


def generated_runs(completion: Completion) -> list[tuple[int, int]]:
    """[start, end) of each run of generated tokens: one per turn."""
    runs, start = [], None
    for position, generated in enumerate(completion.generated + [False]):
        if generated and start is None:
            start = position
        elif not generated and start is not None:
            runs.append((start, position))
            start = None
    return runs


class ToolWaitingForAnUpdate:
    """A calculator whose tool, for episodes of one prompt, answers only once the generator serves
    a newer version: those episodes span a weight update by construction."""

    def __init__(self, env, waits: bool, updated: asyncio.Event, on_wait):
        self.env, self.waits, self.updated, self.on_wait = env, waits, updated, on_wait

    async def reset(self):
        return await self.env.reset()

    async def step(self, turn_text):
        if self.waits and turn_text.startswith("C"):
            self.on_wait()
            await self.updated.wait()
        return await self.env.step(turn_text)


def test_an_episode_spanning_a_weight_update_keeps_each_tokens_version_stays_in_flight_and_trains_within_the_age_bound(
    tmp_path, char_tokenizer
):
    pipeline, rollouts, policy, trained = make_env_pipeline(char_tokenizer)
    updated = asyncio.Event()
    in_flight_while_waiting = []

    def make_env(seed, index):
        def on_wait():
            in_flight_while_waiting.append(dict(rollouts.gate.in_flight_versions))

        return ToolWaitingForAnUpdate(make_calculator_env(seed, index), index == 1, updated, on_wait)

    rollouts.make_env = make_env
    update_weights = rollouts.actors.generators.update_weights.function

    async def update_then_release(index, policy_version):
        result = await update_weights(index, policy_version)
        await rollouts.gate.generator_serves(index, policy_version)
        updated.set()
        return result

    rollouts.actors.generators.update_weights = FakeEndpoint(update_then_release)
    history, _ = run(pipeline, tmp_path)

    # While its tool waits, the episode is counted in flight at the version it started at, so the
    # train loop cannot take the last batch that may still train it without it.
    assert len(in_flight_while_waiting) == ENV_CONFIG.group_size
    assert all(in_flight.get(0, 0) >= 1 for in_flight in in_flight_while_waiting)
    spanning = [
        (train_version, c)
        for train_version, episodes in trained
        for e in episodes
        if e.episode_id == 1
        for c in e.completions
    ]
    assert len(spanning) == ENV_CONFIG.group_size
    for _, completion in spanning:
        generated_versions = [v for v, g in zip(completion.policy_versions, completion.generated) if g]
        assert generated_versions[0] == 0 and generated_versions[-1] == 1  # the call at 0, the answer at 1
        assert completion.oldest_policy_version == 0
    for train_version, episodes in trained:  # the bound holds on every trained token
        for completion in (c for e in episodes for c in e.completions):
            ages = [train_version - v for v, trains in zip(completion.policy_versions, completion.loss_mask) if trains]
            assert max(ages) <= ENV_CONFIG.buffer.max_policy_age
    assert max(step[m.SPANNED_WEIGHT_UPDATE_FRACTION] for step in history) > 0


class FailingCalculator:
    """A calculator that raises in reset (how "reset") or never answers a step (how "hang": it
    awaits an Event never set, so only the episode's env_step_timeout_s ends it)."""

    def __init__(self, env, how: str):
        self.env, self.how = env, how

    async def reset(self):
        if self.how == "reset":
            raise ConnectionError("the tool's server is gone")
        return await self.env.reset()

    async def step(self, turn_text):
        await asyncio.Event().wait()


def test_an_environment_that_raises_or_hangs_errors_its_episodes_which_are_counted_never_trained_and_the_run_goes_on(
    tmp_path, char_tokenizer
):
    limits = dataclasses.replace(ENV_CONFIG.environment.limits, env_step_timeout_s=0.1)
    config = dataclasses.replace(ENV_CONFIG, environment=dataclasses.replace(ENV_CONFIG.environment, limits=limits))
    pipeline, rollouts, _, trained = make_env_pipeline(char_tokenizer, config)
    failing = {1: "reset", 2: "hang"}

    def make_env(seed, index):
        env = make_calculator_env(seed, index)
        return FailingCalculator(env, failing[index]) if index in failing else env

    rollouts.make_env = make_env
    history, accounting = run(pipeline, tmp_path)

    assert accounting["trained"] == config.steps * config.prompts_per_step  # the run went on
    by_id = {e.episode_id: e for _, episodes in trained for e in episodes}
    assert failing.keys() <= by_id.keys()
    for episode_id, how in failing.items():
        for completion in by_id[episode_id].completions:
            assert completion.status == CompletionStatus.ERRORED and not any(completion.loss_mask)
            assert completion.end_reason == ("env_error" if how == "reset" else "env_timeout")
    for episode in (e for i, e in by_id.items() if i not in failing):
        assert all(c.status == CompletionStatus.OK and c.reward == 1.0 for c in episode.completions)
    errored = config.group_size * len(failing)
    assert sum(h[m.COMPLETIONS_ERRORED] for h in history) == errored
    assert sum(h.get(f"{m.EPISODE_STATUS_PREFIX}env_error", 0) for h in history) == config.group_size
    assert sum(h.get(f"{m.EPISODE_STATUS_PREFIX}env_timeout", 0) for h in history) == config.group_size


def test_each_step_reports_its_data_wait_and_overhead_beside_the_trainers_compute(tmp_path):
    pipeline, rollouts = make_pipeline()
    versions = iter(range(1, 100))

    async def train_step(episodes):  # a FAKE trainer that reports its compute as PolicyTrainer does
        version = next(versions)
        compute = {m.TRAINER_FORWARD_S: 0.0, m.TRAINER_BACKWARD_S: 0.0, m.TRAINER_OPTIMIZER_S: 0.0}
        metrics = {"num_tokens": 8, "step_skipped": 0, "policy_version": version, **compute}
        return TrainStepResult(version, skipped=False, weights_dir="/nowhere", metrics=metrics)

    pipeline.actors.trainer = pulling_trainer(train_step, rollouts)
    history, _ = run(pipeline, tmp_path)

    assert all(h[m.TRAINER_DATA_WAIT_S] >= 0 and h[m.TRAINER_OVERHEAD_S] >= 0 for h in history)
    # The steps' critical paths follow one another: together they never exceed the loops' time.
    assert sum(h[m.TRAINER_DATA_WAIT_S] + h[m.TRAINER_OVERHEAD_S] for h in history) <= pipeline.timeline.now()
    summary = metrics.trainer_overhead_summary(history)
    assert summary["trainer_overhead_fraction"] == pytest.approx(1.0)  # no compute at all: all overhead


@pytest.mark.parametrize("num_generators,prompts_per_step", [(1, 2), (8, 16)])
def test_the_controller_makes_the_same_calls_per_step_whatever_the_generators_and_prompts(
    tmp_path, num_generators, prompts_per_step
):
    """The push path's contract (issue 16): per step the train loop calls the trainer once and
    the rollouts once (the step's accounting; when the batch left the buffer only for a step
    slower than its timeout), and the trainer takes its batch from the rollouts itself; the calls
    per prompt and per generator are the rollouts' own."""
    config = dataclasses.replace(
        CONFIG,
        num_generators=num_generators,
        train_batch_size=prompts_per_step * CONFIG.group_size,
        buffer=dataclasses.replace(CONFIG.buffer, capacity_episodes=4 * prompts_per_step),
    )
    pipeline, rollouts = make_pipeline(config=config)
    calls: list[str] = []
    for actor_name in ("rollouts", "trainer"):
        actor = getattr(pipeline.actors, actor_name)
        for name, endpoint in vars(type(actor)).items():
            if isinstance(endpoint, FakeEndpoint):
                setattr(actor, name, FakeEndpoint(_counted(endpoint.function, f"{actor_name}.{name}", calls)))
    history, accounting = run(pipeline, tmp_path)

    assert accounting["trained"] == config.steps * prompts_per_step
    per_run = ["rollouts.start", "rollouts.wait_for_failure", "trainer.wait_for_publish", "rollouts.stop_loops"]
    per_step = ["trainer.train_next_step", "rollouts.step_done"]
    per_step_by_the_trainer = ["rollouts.batch_for_trainer"]  # its one rank takes the batch itself
    assert sorted(calls) == sorted(per_run + (per_step + per_step_by_the_trainer) * config.steps)
    assert rollouts.calls["generators.generate"] >= config.steps * prompts_per_step  # the rollouts' own


def test_the_rollouts_handle_goes_to_the_trainer_with_the_first_step_only(tmp_path):
    """A mesh handle pickles by value (3.4 KB): the trainer keeps the first step's (BatchPrefetch),
    and a step that came without one before any did is refused, naming the cause."""
    pipeline, _ = make_pipeline()
    handles = []
    train_next_step = pipeline.actors.trainer.train_next_step.function

    async def recorded(step, rollouts_handle, *rest):
        handles.append(rollouts_handle)
        return await train_next_step(step, rollouts_handle, *rest)

    pipeline.actors.trainer.train_next_step = FakeEndpoint(recorded)
    history, _ = run(pipeline, tmp_path)

    assert len(history) == len(handles) == CONFIG.steps
    assert handles[0] is pipeline.actors.rollouts and handles[1:] == [None] * (CONFIG.steps - 1)
    with pytest.raises(RuntimeError, match="step 3 came without the rollouts.*first step it sends"):
        BatchPrefetch().take(3, None, 1)


def _counted(function, name: str, calls: list[str]):
    async def counted(*args, **kwargs):
        calls.append(name)
        return await function(*args, **kwargs)

    return counted


def test_removing_the_pools_last_generator_or_one_it_lacks_is_refused_naming_the_fix():
    _, rollouts = make_pipeline()
    with pytest.raises(ValueError, match="generator 5 is not in the pool"):
        asyncio.run(rollouts.remove_generator(5, grace_s=0.0))
    with pytest.raises(ValueError, match="the pool's last: a run needs one. Add one before removing it"):
        asyncio.run(rollouts.remove_generator(0, grace_s=0.0))


def test_a_generator_added_and_one_removed_mid_run_leave_the_accounting_exact(tmp_path):
    """FAKE pool: generator 1 joins after the first step, generator 0 leaves after the second
    (its groups in flight get no grace: they are cut and handed out again)."""
    pipeline, rollouts = make_pipeline(config=dataclasses.replace(CONFIG, steps=6))
    removed = []

    async def add_generator():
        return {"index": 1, "policy_version": rollouts.gate.generator_versions[0], "engine_start_s": 0.0}

    async def remove_generator(index):
        removed.append(index)

    rollouts.actors.generators.add_generator = FakeEndpoint(add_generator)
    rollouts.actors.generators.remove_generator = FakeEndpoint(remove_generator)
    step_done = rollouts.step_done
    changes = []

    async def changing_step_done(step, skipped, policy_version):
        figures = await step_done(step, skipped, policy_version)
        if step == 1:
            changes.append(await rollouts.add_generator())
        if step == 2:
            changes.append(await rollouts.remove_generator(0, grace_s=0.0))
        return figures

    rollouts.step_done = changing_step_done
    pipeline.actors.rollouts = local_actor(rollouts, *ROLLOUTS_ENDPOINTS)
    history, accounting = run(pipeline, tmp_path)
    assert removed == [0] and rollouts.generators == [1]
    assert [h[m.NUM_GENERATORS] for h in history][:2] == [1, 2]
    assert history[-1][m.NUM_GENERATORS] == 1
    assert accounting["trained_more_than_once"] == 0
    assert accounting["trained"] == 6 * CONFIG.prompts_per_step


@pytest.mark.parametrize("num_generators", [1, 2])
def test_an_environment_turn_lost_with_its_generator_is_sampled_again_and_the_episode_goes_on(
    num_generators, tmp_path, char_tokenizer
):
    """Generator 0 is lost in the middle of an episode's second turn: that turn is sampled again
    (on generator 1, or on generator 0's replacement when it is the only one), and the episode,
    its first turn and its environment kept, ends as it would have."""
    config = dataclasses.replace(ENV_CONFIG, num_generators=num_generators)
    pipeline, rollouts, policy, trained = make_env_pipeline(char_tokenizer, config)
    lost = []

    async def losing_one_second_turn(index, prefix_token_ids, max_new_tokens):
        if not lost and index == 0 and "R" in char_tokenizer.decode(prefix_token_ids):
            lost.append(list(prefix_token_ids))
            raise FakeActorError(GeneratorLost(index, "its process died"))
        return await policy.generate_turn(index, prefix_token_ids, max_new_tokens)

    rollouts.actors.generators.generate_turn = FakeEndpoint(losing_one_second_turn)
    _, accounting = run(pipeline, tmp_path)
    assert len(lost) == 1
    assert accounting["turns_moved_after_generator_failure"] == 1
    assert accounting["requeued_after_generator_failure"] == 0  # nothing generated again but the turn
    assert accounting["trained_more_than_once"] == 0
    assert accounting["trained"] == config.steps * config.prompts_per_step
    # The lost turn's prefix was sampled again, exactly, once: its episode went on from it (its
    # twin in the group, the same scripted episode, sampled the same prefix).
    assert [prefix for prefix, _, _ in policy.turns].count(lost[0]) == config.group_size
    for _, episodes in trained:
        for episode in episodes:
            assert all(c.num_turns == 2 and c.reward == 1.0 for c in episode.completions)


@pytest.mark.parametrize("num_generators", [2, 1])
def test_a_generator_that_cannot_be_replaced_leaves_the_pool_unless_it_was_the_last(num_generators, tmp_path):
    """Generator 0 dies and the pool gives it up (its host is gone): with another generator the
    run goes on without it, its prompt handed out again there; alone, the run stops naming why."""
    config = dataclasses.replace(CONFIG, num_generators=num_generators, steps=4)
    calls = {"n": 0}

    async def generate(index, prompts, group_size):
        calls["n"] += 1
        call = calls["n"]
        await asyncio.sleep(0)  # a remote call yields to the event loop
        if index == 0 and call == 1:
            raise FakeActorError(GeneratorLost(index, "its process died"))
        version = rollouts.gate.generator_versions[index]
        return [dataclasses.replace(p, completions=completions_for(p, group_size, version)) for p in prompts]

    async def wait_until_serving(index):
        raise FakeActorError(GeneratorFailed(index, "3 attempts failed, last: its host is gone"))

    pipeline, rollouts = make_pipeline(generate, config)
    rollouts.actors.generators.wait_until_serving = FakeEndpoint(wait_until_serving)
    if num_generators == 1:
        with pytest.raises(
            (FakeActorError, GeneratorFailed), match="generator 0 could not be replaced: 3 attempts failed"
        ):
            run(pipeline, tmp_path)
        return
    history, accounting = run(pipeline, tmp_path)
    assert rollouts.generators == [1] and history[-1][m.NUM_GENERATORS] == 1
    assert accounting["requeued_after_generator_failure"] == 1
    assert accounting["trained_more_than_once"] == 0
    assert accounting["trained"] == config.steps * config.prompts_per_step
