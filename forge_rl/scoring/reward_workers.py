"""Runs reward functions in worker processes, so a verifier that raises, hangs or crashes costs one
completion (ERRORED, with the reason) and never the run.

A thread cannot be stopped, and a pure-Python `while True:` never returns, so each worker is its own
process: past `scorer.reward_timeout_s` on one completion the worker is killed and a fresh one takes
over the rest of the episode. A worker scores a whole episode per round trip and streams back one
result per completion, so the per-completion deadline needs no extra messages.

Workers are plain subprocesses (`python -m forge_rl.scoring.reward_workers`) talking over two pipes, not
multiprocessing's spawn, which would re-import the parent's __main__ (a Monarch bootstrap in an
actor). They ignore SIGINT (the controller decides when to stop) and die with their parent
(PR_SET_PDEATHSIG on Linux), so no worker outlives the run.

No Monarch here; `forge_rl.scoring.scorers` wraps the pool as a scorer (`RewardFunctionScorer`) and
holds its config, `forge_rl.actors.scorer` is the actor shell.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from forge_rl.core.deadlines import within


class PoolSettings(Protocol):
    """What the pool reads of its config (`forge_rl.scoring.scorers.ScorerConfig` is the run's): a
    worker process runs this module, so it imports nothing it does not need."""

    @property
    def num_workers(self) -> int: ...

    @property
    def reward_timeout_s(self) -> float: ...


_WORKER_START_TIMEOUT_S = 120.0
"""How long a new worker may take to import and report ready (a busy CPU host can be slow)."""


@dataclass(frozen=True)
class RewardResult:
    """The reward of one completion, or why there is none."""

    reward: float | None
    error: str | None = None
    """Set when the reward function raised, returned a non-finite value, timed out or crashed."""
    error_kind: str | None = None
    """The exception's type name, or "non-finite", "timeout", "worker died"; for log deduplication."""

    @property
    def timed_out(self) -> bool:
        return self.error_kind == "timeout"


class RewardWorker:
    """One worker process running the reward function named by `reward`."""

    def __init__(self, reward: str):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "forge_rl.scoring.reward_workers",
                str(to_child_r),
                str(from_child_w),
                reward,
                str(os.getpid()),
            ],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            # What multiprocessing's spawn passes too: the parent's import path, so a reward
            # function importable here (task.reward = "module:function") is importable there.
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.requests = Connection(to_child_w, readable=False)
        self.results = Connection(from_child_r, writable=False)
        self.ready = False

    async def receive(self, timeout_s: float):
        """The next message from the worker; TimeoutError past `timeout_s`, EOFError if it died."""
        if not self.results.poll():
            loop = asyncio.get_running_loop()
            readable = loop.create_future()
            loop.add_reader(self.results.fileno(), lambda: None if readable.done() else readable.set_result(None))
            try:
                await within(timeout_s, readable)
            finally:
                loop.remove_reader(self.results.fileno())
        return self.results.recv()

    async def wait_ready(self) -> None:
        if not self.ready:
            status, detail = await self.receive(_WORKER_START_TIMEOUT_S)
            if status != "ready":
                raise RuntimeError(f"reward worker failed to start: {detail}")
            self.ready = True

    def describe_exit(self) -> str:
        code = self.process.wait(timeout=5)
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.requests.close()
        self.results.close()


class RewardWorkerPool:
    """`num_workers` reward worker processes; `score` takes an idle one, replacing it on a fault."""

    def __init__(self, reward: str, config: PoolSettings):
        self.reward = reward
        self.config = config
        self.num_worker_restarts = 0
        self.workers = [RewardWorker(reward) for _ in range(config.num_workers)]
        self._idle: asyncio.Queue[RewardWorker] = asyncio.Queue()
        for worker in self.workers:
            self._idle.put_nowait(worker)

    async def score(self, items: list[tuple[str, str, dict]]) -> list[RewardResult]:
        """Rewards of (completion_text, answer, columns) items, in order, where `columns` are the
        row's columns the function reads, passed to it by name; never raises for a reward fault."""
        worker = await self._idle.get()
        results: list[RewardResult] = []
        try:
            while len(results) < len(items):
                await worker.wait_ready()
                pending = items[len(results) :]
                try:
                    worker.requests.send(pending)
                except BrokenPipeError:  # died while idle (killed from outside): nothing was scored
                    worker = self._replace(worker)
                    continue
                for _ in pending:
                    try:
                        status, value = await worker.receive(self.config.reward_timeout_s)
                    except (asyncio.TimeoutError, EOFError) as fault:
                        results.append(self._fault_result(worker, fault))
                        worker = self._replace(worker)
                        break
                    results.append(RewardResult(value) if status == "ok" else RewardResult(None, *value))
            return results
        finally:
            self._idle.put_nowait(worker)

    def _replace(self, worker: RewardWorker) -> RewardWorker:
        worker.kill()
        fresh = RewardWorker(self.reward)
        self.workers[self.workers.index(worker)] = fresh
        self.num_worker_restarts += 1
        return fresh

    def _fault_result(self, worker: RewardWorker, fault: Exception) -> RewardResult:
        if isinstance(fault, asyncio.TimeoutError):
            return RewardResult(
                None,
                f"reward function timed out after {self.config.reward_timeout_s} s "
                "(raise --scorer.reward-timeout-s if it is just slow)",
                "timeout",
            )
        return RewardResult(None, f"reward worker process died ({worker.describe_exit()})", "worker died")

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux), so a hung worker never outlives the run."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _reward(reward_fn, completion_text: str, answer: str, columns: dict) -> tuple[str, object]:
    """("ok", reward) or ("error", (message, kind)): one message back to the pool."""
    try:
        reward = float(reward_fn(completion_text, answer, **columns))
    except Exception as e:  # any verifier bug costs this completion only
        return "error", ("".join(traceback.format_exception_only(e)).strip(), type(e).__name__)
    if not math.isfinite(reward):
        return "error", (f"reward function returned {reward} (a reward must be finite)", "non-finite")
    return "ok", reward


def _serve(requests_fd: int, results_fd: int, reward: str, parent_pid: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    requests, results = Connection(requests_fd, writable=False), Connection(results_fd, readable=False)
    try:
        from forge_rl.tasks.rewards import resolve_reward_fn

        reward_fn = resolve_reward_fn(reward)
    except Exception as e:
        results.send(("failed", f"{type(e).__name__}: {e}"))
        return
    results.send(("ready", None))
    while True:
        try:
            items = requests.recv()
        except EOFError:  # the pool closed the pipe: shut down
            return
        for completion_text, answer, columns in items:
            results.send(_reward(reward_fn, completion_text, answer, columns))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
