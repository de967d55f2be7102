"""A scorer whose process dies is restarted and its calls in flight are scored again by the
replacement: every episode comes back once, scored once, none ERRORED for the death; a scorer
that keeps dying stops the run with the cause and the flag (forge_rl/scoring/restarts.py).

The scorer processes are a fake (FakeScorerProcesses): each incarnation scores by setting the
reward to its own number, and the test decides when one dies and how the death shows (its call
fails with ScorerLost, or the supervisor's watchdog reports it while the call hangs)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from forge_rl.errors import ScorerFailed, ScorerLost
from forge_rl.scoring.restarts import RestartingScorer, ScorerState
from forge_rl.types import Completion, Episode


def episode(episode_id: int) -> Episode:
    return Episode(episode_id, "M12=", "2", [1, 2], [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0])])


class FakeIncarnation:
    """One incarnation of the fake scorer: its score calls hang while `held`, fail with
    ScorerLost once `dead`, and otherwise set each completion's reward to its number."""

    def __init__(self, number: int):
        self.number = number
        self.held = asyncio.Event()
        self.dead = False
        self.calls_in_flight = 0
        self.num_scored = 0

    async def score(self, episodes: list[Episode]) -> list[Episode]:
        self.calls_in_flight += 1
        try:
            while self.held.is_set():
                await asyncio.sleep(0)
            if self.dead:
                raise ScorerLost(f"incarnation {self.number}'s process died")
            # A copy, as a call to another process returns: the caller's episodes stay unscored.
            scored = [
                dataclasses.replace(
                    e, completions=[dataclasses.replace(c, reward=float(self.number)) for c in e.completions]
                )
                for e in episodes
            ]
            self.num_scored += sum(len(e.completions) for e in episodes)
            return scored
        finally:
            self.calls_in_flight -= 1


class FakeScorerProcesses:
    """`start` and `retire` for RestartingScorer; starts numbered in `failing_starts` raise."""

    def __init__(self, failing_starts: tuple[int, ...] = ()):
        self.started: list[FakeIncarnation] = []
        self.retired: list[int] = []
        self.failing_starts = failing_starts

    async def start(self, number: int) -> FakeIncarnation:
        if number in self.failing_starts:
            raise RuntimeError(f"start {number} crashed")
        self.started.append(FakeIncarnation(number))
        return self.started[-1]

    def retire(self, incarnation: FakeIncarnation) -> None:
        self.retired.append(incarnation.number)


def score(restarts: RestartingScorer, episodes: list[Episode]):
    return restarts.call(lambda incarnation: incarnation.score(episodes), len(episodes))


async def until(condition) -> None:
    """Let the event loop run until `condition()` holds (the fakes advance only by being run)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_a_call_that_fails_because_the_scorer_died_is_scored_again_by_the_replacement():
    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=3)
        first = await restarts.start()
        first.dead = True
        scored = await score(restarts, [episode(0), episode(1)])
        return processes, restarts, scored

    processes, restarts, scored = asyncio.run(main())
    assert [e.episode_id for e in scored] == [0, 1]  # none lost, each once
    assert [c.reward for e in scored for c in e.completions] == [2.0, 2.0]  # scored by incarnation 2
    assert [i.num_scored for i in processes.started] == [0, 2]  # none scored twice
    assert processes.retired == [1]
    [event] = restarts.recoveries
    assert "incarnation 1's process died" in event["reason"] and event["episodes_rescored"] == 2
    assert event["detected_at"] <= event["restart_started_at"] <= event["serving_at"]
    assert restarts.state == ScorerState.SERVING and restarts.num_restarts == 1


def test_a_death_seen_by_the_watchdog_cancels_the_calls_in_flight_and_scores_them_again():
    """A call to a dead process may not fail for a while (Monarch's report is slow): the watchdog's
    `lost` cancels it, and the same episodes go to the replacement at once."""

    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=3)
        first = await restarts.start()
        first.held.set()  # its calls never return: a dead process's call that Monarch has not failed yet
        calls = [asyncio.ensure_future(score(restarts, [episode(i)])) for i in range(3)]
        await until(lambda: first.calls_in_flight == 3)
        restarts.lost(restarts.current, "a scorer-side process exited")
        restarts.lost(restarts.current, "a second report of the same death")  # ignored: it is restarting
        return processes, restarts, await asyncio.gather(*calls)

    processes, restarts, scored = asyncio.run(main())
    assert [e.episode_id for batch in scored for e in batch] == [0, 1, 2]
    assert all(c.reward == 2.0 for batch in scored for e in batch for c in e.completions)
    [event] = restarts.recoveries
    assert event["episodes_rescored"] == 3 and processes.retired == [1]


def test_counters_add_up_over_incarnations_and_a_rescored_completion_counts_once():
    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=3)
        first = await restarts.start()
        await score(restarts, [episode(0)])
        restarts.observed_stats(restarts.current, {"scorer/completions": first.num_scored})  # read at a step
        first.dead = True
        await score(restarts, [episode(1), episode(2)])  # scored by the replacement only
        second = processes.started[1]
        restarts.observed_stats(restarts.current, {"scorer/completions": second.num_scored})
        return restarts.stats()

    assert asyncio.run(main()) == {"scorer/completions": 3, "scorer/restarts": 1}


def test_a_stats_read_its_scorer_never_answers_is_ended_by_the_death_and_the_last_read_stands():
    """Stats are read on a port (forge_rl/plumbing/port_calls.py): a dead scorer never answers, so
    the watchdog's `lost` ends the read, and the dead incarnation's last read is carried over."""

    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=3)
        await restarts.start()

        async def answered(incarnation):
            return {"scorer/completions": 4}

        await restarts.read_stats(answered)
        never_answered = asyncio.Event()
        read = asyncio.ensure_future(restarts.read_stats(lambda incarnation: never_answered.wait()))
        await until(lambda: len(restarts.current.in_flight) == 1)
        restarts.lost(restarts.current, "a scorer-side process exited")
        await read  # returns: the read was the dead incarnation's, not the caller's, to cancel
        await until(lambda: restarts.state == ScorerState.SERVING)
        return restarts.stats()

    assert asyncio.run(main()) == {"scorer/completions": 4, "scorer/restarts": 1}


def test_a_scorer_that_keeps_dying_stops_the_run_naming_the_cause_and_the_flag():
    async def main():
        processes = FakeScorerProcesses(failing_starts=(3,))
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=2)
        (await restarts.start()).dead = True
        waiting = asyncio.ensure_future(score(restarts, [episode(0)]))
        await until(lambda: restarts.num_restarts == 1 and restarts.state == ScorerState.SERVING)
        processes.started[-1].dead = True  # incarnation 2 dies too; start 3 crashes, and the budget is spent
        with pytest.raises(ScorerFailed) as failed:
            await waiting
        with pytest.raises(ScorerFailed):  # and so does every later call, at once
            await score(restarts, [episode(1)])
        return restarts, str(failed.value)

    restarts, message = asyncio.run(main())
    assert restarts.state == ScorerState.FAILED and restarts.num_restarts == 2
    assert "scorer.max_restarts (2)" in message and "--scorer.max-restarts" in message
    assert "restart 2 failed: RuntimeError: start 3 crashed" in message


def test_with_no_restarts_allowed_the_first_death_stops_the_run():
    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=0)
        (await restarts.start()).dead = True
        with pytest.raises(ScorerFailed, match=r"max_restarts \(0\).*incarnation 1's process died"):
            await score(restarts, [episode(0)])
        return processes

    assert len(asyncio.run(main()).started) == 1


def test_other_errors_of_a_call_reach_the_caller_and_restart_nothing():
    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=3)
        await restarts.start()

        async def bug(incarnation):
            raise ValueError("not a death")

        with pytest.raises(ValueError, match="not a death"):
            await restarts.call(bug, 1)
        return restarts

    restarts = asyncio.run(main())
    assert restarts.recoveries == [] and restarts.num_restarts == 0


def test_a_death_while_the_run_stops_is_not_repaired():
    async def main():
        processes = FakeScorerProcesses()
        restarts = RestartingScorer(processes.start, processes.retire, max_restarts=3)
        (await restarts.start()).dead = True
        restarts.stop()
        with pytest.raises(ScorerLost):
            await score(restarts, [episode(0)])
        return processes

    assert len(asyncio.run(main()).started) == 1


def test_a_frozen_model_restarted_by_the_same_core_is_named_in_its_error_and_counter():
    """The reference model's and the teacher's supervisors (forge_rl/actors/frozen_model_supervisor.py)
    reuse this core with their own name, budget flag and counter."""

    async def main():
        processes = FakeScorerProcesses(failing_starts=(2,))
        restarts = RestartingScorer(
            processes.start,
            processes.retire,
            max_restarts=1,
            role="reference model",
            budget_flag="reference.max_restarts",
            restarts_metric="reference/restarts",
        )
        (await restarts.start()).dead = True
        with pytest.raises(ScorerFailed) as failed:
            await score(restarts, [episode(0)])
        return restarts, str(failed.value)

    restarts, message = asyncio.run(main())
    assert message.startswith("the reference model's processes died and reference.max_restarts (1) restarts")
    assert "raise --reference.max-restarts" in message and "scorer" not in message
    assert restarts.stats() == {"reference/restarts": 1}
