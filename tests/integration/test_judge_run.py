"""A real GRPO run with an LLM judge (`--scorer.judge.path`) and a self-distillation teacher pinned
one version back, asynchronous (buffer.max_policy_age 1): ScorerSupervisor -> judge GeneratorActor
(its own vLLM engine) -> ScorerActor, end to end, and the judge killed under a judging call.

One run, three checks (tests below):

1. Every judged completion is counted once: `scorer/judge/verdicts` (every verdict that came back,
   parsable or not) + `scorer/judge/timed_out` is the number of completions scored, and the
   unparsable ones are ERRORED, never trained. The judge is the tiny random model (as the policy):
   its verdicts are two random characters, read with the pattern "a digit" (a score from 0 to 9),
   so about 40% parse and the rest are unparsable, and both paths run. The counters are read
   quiescent after step KILL_AFTER_STEP (no scoring call in flight: the test holds new ones back
   until those in flight return), so the equalities are exact.
2. The judge's processes (its vLLM engine's, then its GeneratorActor's) are SIGKILLed while a
   judging call is in flight: the supervisor restarts the incarnation and that call's episodes are
   judged again by the replacement; none is lost, trained twice or ERRORED for the death (the
   engine's death is seen by the supervisor's poll of its pids, or reaches the scorer first as
   vLLM's EngineDeadError, which must count as the judge's death, not as a failure of the
   completions: tests/unit/scoring/test_judge.py drives that path). Driven, not timed: the judge's engine processes are
   SIGSTOPped while no scoring call is in flight (the test holds new ones back until those in
   flight return), and the reward function is held (tests/support/held_reward.py); a scoring
   call that then reaches the held reward began after the stop, so its verdicts are surely
   pending; then the judge is killed.
3. The pinned teacher's version changes (after steps 2 and 4) while the generators decode: the
   run's timeline (timeline.jsonl) holds, for each teacher swap, a generate call that began before
   the swap and ended after it. Before each swap the test holds a generate call open (the probed
   rollouts keep its reply from its rollout, tests/support/scoring_probe.py) and releases it
   once the swap has ended: a swap that drained the generators, or waited for their calls, would
   never end, and the test fails by its bound. (A call merely seen in flight before the swap could
   end during a slow swap on a loaded machine: it did once, in a full run beside a soak.) (STEPS
   is 5, not 4, so that a step follows the last swap: the gate admits new prompts for it, and a
   generate call begins.)
"""

import asyncio
import dataclasses
import json
import os
import signal
import time

import pytest

from apps.grpo import main as grpo_main
from apps.grpo.main import run, spawn_actors
from forge_rl.actors import scoring_stage
from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.observability.timeline import Timeline
from forge_rl.run.lifecycle import Lifecycle
from forge_rl.scoring.judge import JudgeConfig
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.scoring.teacher import TeacherConfig, pinned_teacher_refresh
from forge_rl.tasks import TaskConfig
from forge_rl.types import CompletionStatus
from tests.support.held_reward import HOLD_DIR_ENV
from tests.support.helpers import assert_every_prompt_accounted_for
from tests.support.scoring_probe import ProbedRolloutsActor

pytestmark = pytest.mark.integration

STEPS = 5
KILL_AFTER_STEP = 1
REPLACED_BY_STEP = 2
EVENT_BOUND_S = 120.0
"""How long the test waits for what the run does anyway (a scoring call reaching the held reward,
a generate call beginning; at most a judge restart away): the bound only turns a broken test into
a failure, not a hang."""

JUDGE = JudgeConfig(
    template="{prompt}{completion}=",  # the tiny model's characters; the default template is English
    prompt_format="plain",  # the tiny model has no chat template
    verdict_pattern=r"(\d)",  # the last digit of the verdict is its score
    score_min=0,
    score_max=9,
    generator=GeneratorConfig(max_new_tokens=2),
    max_model_len=128,  # the tiny model's context
)
TEACHER = TeacherConfig(pin="lagged", versions_back=1, refresh_every_n_steps=2)
"""The initial policy until step 2, then version 1, after step 4 version 3 (forge_rl/scoring/teacher.py);
it stages versions 1, 3 and 5 after steps 1, 3 and 5."""


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory, model_dir):
    hold_dir = tmp_path_factory.mktemp("hold")
    config = GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name="judge",
        steps=STEPS,
        train_batch_size=16,
        group_size=4,
        prompts_in_flight_per_generator=4,
        generator=GeneratorConfig(max_new_tokens=8),
        buffer=BufferConfig(max_policy_age=1),
        task=TaskConfig(reward="tests.support.held_reward:held_leading_number"),
        scorer=ScorerConfig(judge=dataclasses.replace(JUDGE, path=model_dir), teacher=TEACHER),
    )
    spawned, kill = {}, {}

    async def spawn_actors_kept(config, lifecycle):  # the hooks need the scorer's supervisor
        spawned["actors"] = await spawn_actors(config, lifecycle)
        return spawned["actors"]

    after_step = Lifecycle.after_step

    async def after_step_driving_the_kill(lifecycle, pipeline):
        await after_step(lifecycle, pipeline)
        spawned["pipeline"] = pipeline
        scorer, rollouts = spawned["actors"].scoring.scorer, spawned["actors"].rollouts
        if pipeline.step == KILL_AFTER_STEP:
            await rollouts.hold_scoring.call_one()  # no scoring call in flight, new ones held
            try:
                kill["quiescent"] = await scorer.stats.call_one(), await rollouts.scoring_returned.call_one()
                # The serving incarnation's pids: the scorer's, the judge's, its engine's.
                _, judge_pid, *engine_pids = await scorer.processes.call_one()
                assert engine_pids, "the judge's engine processes are unknown"
                # Every scoring call from now on starts with its verdicts unable to come back, and
                # is held in the reward function (hold_dir/held-<pid> says one is).
                for pid in engine_pids:
                    os.kill(pid, signal.SIGSTOP)
                (hold_dir / "hold").touch()
            finally:
                await rollouts.release_scoring.call_one()
            kill["task"] = asyncio.ensure_future(
                _kill_the_judge_under_a_call(hold_dir, scorer, rollouts, kill, judge_pid, engine_pids)
            )
        if pipeline.step == REPLACED_BY_STEP:
            await kill.pop("task")
            kill["restarts_when_serving"] = await scorer.wait_until_serving.call_one()

    def refresh_while_a_generator_decodes(teacher, teacher_config):
        after_publish = pinned_teacher_refresh(teacher, teacher_config)

        async def refresh(step, policy_version, metrics, timeline):
            if step % teacher_config.refresh_every_n_steps != 0:
                return await after_publish(step, policy_version, metrics, timeline)
            # A swap: while a generate call is held open, so a swap that waited for the
            # generators' calls would never end (the test would fail by its bound, not pass).
            rollouts = spawned["actors"].rollouts
            await rollouts.hold_a_generate_call.call_one()
            try:
                return await after_publish(step, policy_version, metrics, timeline)
            finally:
                await rollouts.release_the_generate_call.call_one()

        return refresh

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HOLD_DIR_ENV, str(hold_dir))
        patch.setattr(Lifecycle, "after_step", after_step_driving_the_kill)
        patch.setattr(grpo_main, "spawn_actors", spawn_actors_kept)
        patch.setattr(grpo_main, "RolloutsActor", ProbedRolloutsActor)
        patch.setattr(scoring_stage, "pinned_teacher_refresh", refresh_while_a_generator_decodes)
        summary = asyncio.run(run(config))
    run_path = config.run_dir / config.run_name
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    returned = spawned["pipeline"].rollouts_at_stop["scoring_returned"]
    batches = spawned["pipeline"].rollouts_at_stop["batches"]
    return summary, metrics, kill, returned, batches, Timeline.load(run_path / "timeline.jsonl"), config


async def _kill_the_judge_under_a_call(
    hold_dir, scorer, rollouts, kill: dict, judge_pid: int, engine_pids: list[int]
) -> None:
    deadline = time.monotonic() + EVENT_BOUND_S
    while not list(hold_dir.glob("held-*")):
        assert time.monotonic() < deadline, f"no scoring call reached the held reward within {EVENT_BOUND_S} s"
        await asyncio.sleep(0.05)
    # A scoring call is inside the scorer, begun after the judge's engine stopped: its judge calls
    # went out with its reward calls and wait on the stopped engine.
    kill["in_flight"] = await rollouts.scoring_in_flight.call_one()
    kill["killed_at"] = time.time()
    # The engine first, as an out-of-memory kill would: the judge's actor lives on and answers the
    # calls in flight with vLLM's EngineDeadError (they must be judged again, not ERRORED); then,
    # once the supervisor saw the death, the actor's process.
    for pid in engine_pids:
        os.kill(pid, signal.SIGKILL)
    while not await scorer.recovery_events.call_one():
        assert time.monotonic() < deadline + EVENT_BOUND_S, "the supervisor never saw the judge's engine die"
        await asyncio.sleep(0.05)
    try:
        os.kill(judge_pid, signal.SIGKILL)
    except ProcessLookupError:  # the supervisor stopped it already
        pass
    (hold_dir / "hold").unlink()  # the replacement's reward is not held


def judge_failed(completion) -> bool:
    return completion.status == CompletionStatus.ERRORED and completion.error.startswith(
        ("judge: unparsable verdict", "judge: the judge gave no verdict")
    )


def test_the_run_finishes(judged_run):
    summary, metrics, *_ = judged_run
    assert summary["steps"] == STEPS
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))


def test_every_judged_completion_is_a_verdict_or_a_timeout_and_unparsable_ones_are_errored(judged_run):
    """Exact, from counters read with no scoring call in flight (after step KILL_AFTER_STEP, before
    the kill: one incarnation)."""
    _, _, kill, _, _, _, _ = judged_run
    stats, returned = kill["quiescent"]
    completions = [c for e in returned for c in e.completions]
    failed = [c for c in completions if judge_failed(c)]
    parsed = [c for c in completions if c.status != CompletionStatus.ERRORED]  # OK or TRUNCATED (trained)
    assert len(completions) == stats["scorer/completions"] > 0
    assert stats["scorer/judge/verdicts"] + stats["scorer/judge/timed_out"] == len(completions)
    assert stats["scorer/judge/unparsable"] + stats["scorer/judge/timed_out"] == stats["scorer/judge/errored"]
    assert stats["scorer/judge/errored"] == stats["scorer/errored"] == len(failed)
    assert len(failed) + len(parsed) == len(completions)  # nothing ERRORED but by the judge
    for c in parsed:  # reward = reward function + judge (the teacher's reward is per token; its outcome reward 0)
        assert 0 <= c.reward_components["judge"] <= 1
        assert c.reward == pytest.approx(c.reward_components["reward_fn"] + c.reward_components["judge"])


def test_unparsable_verdicts_are_never_trained(judged_run):
    summary, metrics, _, returned, batches, _, _ = judged_run
    completions = [c for e in returned for c in e.completions]
    assert any(judge_failed(c) for c in completions) and any(c.status != CompletionStatus.ERRORED for c in completions)
    assert len(batches) == STEPS
    for step_metrics, episodes in zip(metrics, batches):
        trained = [c for e in episodes for c in e.completions if c.status != CompletionStatus.ERRORED]
        errored = [c for e in episodes for c in e.completions if c.status == CompletionStatus.ERRORED]
        assert all(judge_failed(c) for c in errored)
        assert step_metrics["completions/errored"] == len(errored)
        # The trainer's own count of the tokens that reached its loss: the judged completions' only.
        assert step_metrics["num_tokens"] == sum(c.num_trainable_tokens for c in trained)
        assert step_metrics["num_tokens"] < sum(c.num_tokens for e in episodes for c in e.completions) or not errored
    assert summary["errored_samples"] == sum(m["completions/errored"] for m in metrics) > 0


def test_a_killed_judge_is_restarted_and_its_call_judged_again(judged_run):
    summary, metrics, kill, returned, _, _, _ = judged_run
    [event] = summary["scorer_recoveries"]
    assert kill["killed_at"] <= event["detected_at"] <= event["restart_started_at"] <= event["serving_at"]
    assert event["episodes_rescored"] >= 1  # the held call, at least
    assert kill["restarts_when_serving"] == 1
    assert metrics[-1]["scorer/restarts"] == 1
    # The calls in flight at the kill came back once each, judged (by the replacement: the killed
    # judge answered none of them), and no completion is ERRORED for the death.
    returned_ids = [e.episode_id for e in returned]
    assert kill["in_flight"] and all(returned_ids.count(i) == 1 for i in kill["in_flight"])
    for episode in returned:
        for c in episode.completions:
            assert c.status != CompletionStatus.ERRORED or judge_failed(c), c.error
            if c.status != CompletionStatus.ERRORED:
                assert "judge" in c.reward_components
    # Over both incarnations (each one's counters as last read, forge_rl/scoring/restarts.py), every
    # completion scored had its verdict or timeout counted: a verdict is counted before its
    # completion is.
    for m in metrics:
        assert m["scorer/judge/verdicts"] + m["scorer/judge/timed_out"] >= m["scorer/completions"]


def test_no_prompt_is_lost_trained_twice_or_scored_twice(judged_run):
    summary, _, _, returned, _, _, config = judged_run
    accounting = summary["accounting"]
    assert accounting["requeued_after_generator_failure"] == 0  # judged again, not generated again
    assert_every_prompt_accounted_for(accounting, trained=config.steps * config.prompts_per_step)
    returned_ids = [e.episode_id for e in returned]
    assert len(returned_ids) == len(set(returned_ids))  # scored into the buffer once each


def test_the_pinned_teacher_swaps_versions_while_generators_decode(judged_run):
    """Asynchronous self-distillation: each teacher swap (its version change) lies inside a generate
    call, so the generators decoded across it; the generators serve every version meanwhile."""
    summary, metrics, _, _, _, intervals, _ = judged_run
    assert [m["teacher/policy_version"] for m in metrics] == [0, 1, 1, 3, 3]
    assert all(m["scorer/teacher/errored"] == 0 for m in metrics)
    swaps = [i for i in intervals if i.component == "teacher_swap"]
    generates = [i for i in intervals if i.component.startswith("generator")]
    assert len(swaps) == STEPS // TEACHER.refresh_every_n_steps
    for swap in swaps:
        spanning = [g for g in generates if g.start_s < swap.start_s and g.end_s > swap.end_s]
        assert spanning, f"no generate call was in flight across the teacher swap at {swap.start_s:.3f} s"
    assert [i.component for i in intervals].count("teacher_stage") == 3
    assert summary["generator_recoveries"] == []
    assert min(metrics[-1]["generator/policy_versions"]) >= STEPS - 2  # max_policy_age + 1 behind at most
