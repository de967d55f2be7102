"""Reward worker pool: a reward function that raises, hangs, crashes or returns NaN costs one completion."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from forge_rl.errors import ConfigError
from forge_rl.scoring.reward_workers import RewardWorkerPool
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.tasks.rewards import resolve_reward_fn
from tests.support.faulty_rewards import HANG_TIMEOUT_S
from tests.support.helpers import wait_until

SCRIPTED = "tests.support.faulty_rewards:scripted"


def score(items, reward=SCRIPTED, timeout_s=HANG_TIMEOUT_S, num_workers=1):
    async def main():
        pool = RewardWorkerPool(reward, ScorerConfig(reward_timeout_s=timeout_s, num_workers=num_workers))
        try:
            return await pool.score([(text, answer, {}) for text, answer in items]), pool.num_worker_restarts
        finally:
            pool.close()

    return asyncio.run(main())


def test_a_raising_reward_errors_that_completion_only():
    results, restarts = score([("ok", "1"), ("raise", "1"), ("ok", "1")])
    assert [r.reward for r in results] == [1.0, None, 1.0]
    assert results[1].error == "ValueError: verifier bug on purpose"
    assert restarts == 0


def test_a_hung_reward_times_out_and_a_fresh_worker_scores_the_rest():
    results, restarts = score([("ok", "1"), ("hang", "1"), ("ok", "1"), ("ok", "1")])
    assert [r.reward for r in results] == [1.0, None, 1.0, 1.0]
    assert results[1].timed_out and f"timed out after {HANG_TIMEOUT_S} s" in results[1].error
    assert "--scorer.reward-timeout-s" in results[1].error
    assert restarts == 1


def test_a_reward_that_kills_its_process_errors_with_the_exit_code():
    results, restarts = score([("exit", "1"), ("ok", "1")])
    assert results[0].error == "reward worker process died (exit code 3)"
    assert results[1].reward == 1.0
    assert restarts == 1


def test_a_non_finite_reward_is_an_error():
    results, _ = score([("nan", "1")])
    assert results[0].reward is None and "returned nan" in results[0].error


def test_workers_score_episodes_in_parallel(tmp_path):
    """Each "meet" reward returns only once the other worker is inside one too: both episodes
    score only if they run at the same time (one at a time, the first would time out)."""

    async def main():
        pool = RewardWorkerPool(SCRIPTED, ScorerConfig(num_workers=2, reward_timeout_s=120))
        try:
            return await asyncio.gather(
                pool.score([("meet", str(tmp_path), {})]), pool.score([("meet", str(tmp_path), {})])
            )
        finally:
            pool.close()

    first, second = asyncio.run(main())
    assert [r.reward for r in first + second] == [1.0, 1.0], [r.error for r in first + second]
    assert len(list(tmp_path.glob("arrived-*"))) == 2  # two processes


def test_scoring_an_episode_costs_well_under_a_millisecond_per_completion():
    """The overhead of the worker process: one round trip per episode of 8 completions."""

    async def main():
        pool = RewardWorkerPool("leading_number", ScorerConfig())
        try:
            episode = [("7", "7", {})] * 8
            await pool.score(episode)
            started = time.perf_counter()
            for _ in range(200):
                await pool.score(episode)
            return (time.perf_counter() - started) / 200
        finally:
            pool.close()

    per_episode_s = asyncio.run(main())
    print(f"reward worker overhead: {per_episode_s * 1e3:.3f} ms per episode of 8 completions")
    assert per_episode_s < 8 * 1e-3


def test_a_hung_worker_dies_with_its_parent(tmp_path):
    """No reward worker outlives the process that owns the pool, even one stuck in `while True`."""
    code = (
        "import asyncio, sys\n"
        "from forge_rl.scoring.scorers import ScorerConfig\nfrom forge_rl.scoring.reward_workers import RewardWorkerPool\n"
        "async def main():\n"
        f"    pool = RewardWorkerPool({SCRIPTED!r}, ScorerConfig(reward_timeout_s=600))\n"
        "    print(pool.workers[0].process.pid, flush=True)\n"
        f"    await pool.score([('spin', {str(tmp_path)!r}, {{}})])\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    worker_pid = int(parent.stdout.readline())
    wait_until((tmp_path / "spinning").exists, "the reward worker to start spinning")
    parent.kill()
    parent.wait()
    wait_until(lambda: not _alive(worker_pid), f"reward worker {worker_pid} to die with its parent")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "spec,message",
    [
        ("leading_numbr", "task.reward ('leading_numbr') is not a registered reward function"),
        ("no_such_module:f", "module 'no_such_module' cannot be imported"),
        ("tests.support.faulty_rewards:missing", "has no function 'missing'"),
        ("tests.support.faulty_rewards:one_argument", "must accept (completion_text, answer)"),
    ],
)
def test_an_unusable_reward_name_fails_naming_the_fix(spec, message):
    with pytest.raises(ConfigError) as error:
        resolve_reward_fn(spec)
    assert message in str(error.value)
    assert "--task.reward" in str(error.value) or "importable" in str(error.value)


def test_a_worker_killed_while_idle_is_replaced_without_losing_a_completion():
    async def main():
        pool = RewardWorkerPool(SCRIPTED, ScorerConfig())
        try:
            await pool.score([("ok", "1", {})])
            pool.workers[0].process.kill()
            pool.workers[0].process.wait()
            return await pool.score([("ok", "1", {}), ("ok", "1", {})]), pool.num_worker_restarts
        finally:
            pool.close()

    results, restarts = asyncio.run(main())
    assert [r.reward for r in results] == [1.0, 1.0]
    assert restarts == 1
