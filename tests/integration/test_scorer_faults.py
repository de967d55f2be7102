"""The scorer actor on a real proc mesh: reward faults cost one completion each, and no reward
worker outlives the mesh."""

from __future__ import annotations

import asyncio
import contextlib

import psutil
import pytest
from monarch.actor import this_host

from forge_rl.actors.scorer import ScorerActor
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.types import Completion, CompletionStatus, Episode
from tests.support.faulty_rewards import HANG_TIMEOUT_S
from tests.support.helpers import alive, wait_until

pytestmark = pytest.mark.integration

SCRIPTED = "tests.support.faulty_rewards:scripted"


def episode(episode_id: int, *texts: str) -> Episode:
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=text) for text in texts]
    return Episode(episode_id, "M12=", "2", [1, 2], completions)


def reward_workers() -> list[psutil.Process]:
    """This test's reward workers: among this process's descendants (the unit tests' scripted
    workers may run beside it, in another pytest worker)."""
    workers = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = process.cmdline()
            if "forge_rl.scoring.reward_workers" in cmdline and SCRIPTED in cmdline:
                workers.append(process)
    return workers


def test_reward_faults_error_single_completions_and_workers_die_with_the_mesh():
    async def main():
        procs = spawn_procs(this_host(), "scorer")
        scorer = procs.spawn(
            "scorer", ScorerActor, ScorerConfig(reward_timeout_s=HANG_TIMEOUT_S, num_workers=2), SCRIPTED
        )
        try:
            scored = await asyncio.gather(
                scorer.score.call_one([episode(0, "ok", "raise", "ok")]),
                scorer.score.call_one([episode(1, "hang", "ok"), episode(2, "nan", "exit", "ok")]),
            )
            stats = await scorer.stats.call_one()
            workers = reward_workers()
        finally:
            await procs.stop()
        return [e for batch in scored for e in batch], stats, workers

    episodes, stats, workers = asyncio.run(main())
    statuses = [[c.status for c in e.completions] for e in episodes]
    ok, errored = CompletionStatus.OK, CompletionStatus.ERRORED
    assert statuses == [[ok, errored, ok], [errored, ok], [errored, errored, ok]]
    errors = [c.error for e in episodes for c in e.completions if c.error]
    assert errors[0] == "ValueError: verifier bug on purpose"
    assert f"timed out after {HANG_TIMEOUT_S} s" in errors[1]
    assert "returned nan" in errors[2] and "exit code 3" in errors[3]
    assert stats == {
        "scorer/completions": 8,
        "scorer/errored": 4,
        "scorer/timed_out": 1,
        "scorer/worker_restarts": 2,
        "scorer/overlong_penalized": 0,  # no overlong penalty configured
    }
    assert len(workers) == 2
    # They die with the mesh's process (PR_SET_PDEATHSIG); the kernel delivers that asynchronously.
    wait_until(lambda: not alive(workers), "the reward workers to die with their proc mesh")
