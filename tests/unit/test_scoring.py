"""Reward worker pool: a reward function that raises, hangs, crashes or returns NaN costs one completion."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from forge_rl.scoring import RewardWorkerPool, ScorerConfig
from forge_rl.tasks.rewards import resolve_reward_fn
from forge_rl.errors import ConfigError

SCRIPTED = "tests.unit.faulty_rewards:scripted"


def score(items, reward=SCRIPTED, timeout_s=1.0, num_workers=1):
    async def main():
        pool = RewardWorkerPool(reward, ScorerConfig(reward_timeout_s=timeout_s, num_workers=num_workers))
        try:
            return await pool.score(items), pool.num_worker_restarts
        finally:
            pool.close()

    return asyncio.run(main())


def test_a_raising_reward_errors_that_completion_only():
    results, restarts = score([("ok", "1"), ("raise", "1"), ("ok", "1")])
    assert [r.reward for r in results] == [1.0, None, 1.0]
    assert results[1].error == "ValueError: verifier bug on purpose"
    assert restarts == 0


def test_a_hung_reward_times_out_and_a_fresh_worker_scores_the_rest():
    started = time.monotonic()
    results, restarts = score([("ok", "1"), ("hang", "1"), ("ok", "1"), ("ok", "1")], timeout_s=0.5)
    assert [r.reward for r in results] == [1.0, None, 1.0, 1.0]
    assert results[1].timed_out and "timed out after 0.5 s" in results[1].error
    assert "--scorer.reward-timeout-s" in results[1].error
    assert restarts == 1
    assert time.monotonic() - started < 30  # worker start on a busy host included


def test_a_reward_that_kills_its_process_errors_with_the_exit_code():
    results, restarts = score([("exit", "1"), ("ok", "1")])
    assert results[0].error == "reward worker process died (exit code 3)"
    assert results[1].reward == 1.0
    assert restarts == 1


def test_a_non_finite_reward_is_an_error():
    results, _ = score([("nan", "1")])
    assert results[0].reward is None and "returned nan" in results[0].error


def test_workers_score_episodes_in_parallel():
    async def main():
        pool = RewardWorkerPool(SCRIPTED, ScorerConfig(num_workers=2))
        try:
            await asyncio.gather(pool.score([("ok", "1")]), pool.score([("ok", "1")]))  # both workers ready
            started = time.monotonic()
            await asyncio.gather(pool.score([("slow", "1")] * 3), pool.score([("slow", "1")] * 3))
            return time.monotonic() - started
        finally:
            pool.close()

    assert asyncio.run(main()) < 1.1  # 2 x 0.6 s of sleeping, overlapped


def test_scoring_an_episode_costs_well_under_a_millisecond_per_completion():
    """The overhead of the worker process: one round trip per episode of 8 completions."""

    async def main():
        pool = RewardWorkerPool("leading_number", ScorerConfig())
        try:
            episode = [("7", "7")] * 8
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


def test_a_hung_worker_dies_with_its_parent():
    """No reward worker outlives the process that owns the pool, even one stuck in `while True`."""
    code = (
        "import asyncio, sys\n"
        "from forge_rl.scoring import RewardWorkerPool, ScorerConfig\n"
        "async def main():\n"
        f"    pool = RewardWorkerPool({SCRIPTED!r}, ScorerConfig(reward_timeout_s=600))\n"
        "    print(pool.workers[0].process.pid, flush=True)\n"
        "    await pool.score([('hang', '1')])\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    worker_pid = int(parent.stdout.readline())
    time.sleep(1.0)  # the worker is now spinning
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)


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
        ("tests.unit.faulty_rewards:missing", "has no function 'missing'"),
        ("tests.unit.faulty_rewards:one_argument", "must accept (completion_text, answer)"),
    ],
)
def test_an_unusable_reward_name_fails_naming_the_fix(spec, message):
    with pytest.raises(ConfigError) as error:
        resolve_reward_fn(spec)
    assert message in str(error.value)
    assert "--task.reward" in str(error.value) or "importable" in str(error.value) or "Wrap it" in str(error.value)


def test_a_worker_killed_while_idle_is_replaced_without_losing_a_completion():
    async def main():
        pool = RewardWorkerPool(SCRIPTED, ScorerConfig())
        try:
            await pool.score([("ok", "1")])
            pool.workers[0].process.kill()
            pool.workers[0].process.wait()
            return await pool.score([("ok", "1"), ("ok", "1")]), pool.num_worker_restarts
        finally:
            pool.close()

    results, restarts = asyncio.run(main())
    assert [r.reward for r in results] == [1.0, 1.0]
    assert restarts == 1
