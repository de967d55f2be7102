"""Cleans up after a process that may die without cleaning up after itself (SIGKILL, the OOM killer).

    reaper = Reaper.start(kill=engine_processes)        # guards this process
    reaper = Reaper.start(remove=[str(store_root)])     # glob patterns
    ...
    reaper.dismiss()                                    # this process cleaned up itself

`Reaper.start` runs `python -m forge_rl.plumbing.reaper` beside the calling process (its parent). When the
parent exits, however it exits, the reaper kills the process trees it was given, removes the paths
matching its patterns, and exits. It also exits, doing nothing, once every process it was given
has exited on its own (and it has no paths to remove), or when dismissed.

Why a separate process: a killed process runs no cleanup, and what it leaves is not always something
that dies with it. Processes that we start ourselves die with their parent through PR_SET_PDEATHSIG
(Monarch's bootstrap sets it for every proc it spawns; `forge_rl.scoring.reward_workers` for reward workers), but
vLLM starts its engine core itself, with no hook to run code in that process, and a directory in
/dev/shm has no death signal. A start-time sweep (`store.shm.sweep_stale_roots`) removes what a dead
launch left only when the next run starts on that host, which may be never.

Why polling the parent pid, not a pipe whose end the parent holds: vLLM forks its engine core from
the parent (its default multiprocessing start method), and a forked child inherits every descriptor, so
the pipe would not close while the engine core lives, which is exactly the case to catch. The
reaper's parent changes (to init or a subreaper) the moment the parent exits; polling every
`_POLL_S` costs nothing measurable.

The reaper only touches what it was given: processes identified by pid and start time (a reused pid
is never signalled), and paths named per launch, so another run on the same host is never touched.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

import psutil

_POLL_S = 0.1


class Reaper:
    """A running reaper; see the module docstring."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls, kill: Iterable[psutil.Process] = (), remove: Iterable[str] = ()) -> Reaper:
        """Guard this process: when it exits, kill `kill` (with their descendants) and remove
        the paths matching the glob patterns `remove`."""
        spec = {
            "parent": os.getpid(),
            "kill": [[process.pid, process.create_time()] for process in kill],
            "remove": list(remove),
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "forge_rl.plumbing.reaper", json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # Its own session: a signal to the caller's process group (a terminal's Ctrl-C, a job
            # runner killing the group) must not take the reaper along with what it cleans up after.
            start_new_session=True,
        )
        return cls(process)

    def dismiss(self) -> None:
        """Stop the reaper without it doing anything (its parent cleaned up itself)."""
        self.process.kill()
        self.process.wait()


def _guard(parent: int, kill: list[psutil.Process], remove: list[str]) -> None:
    """Wait for `parent` to exit, then clean up; return early if there is nothing left to do."""
    while os.getppid() == parent:
        if not remove and not any(is_running(process) for process in kill):
            return  # they exited on their own (a normal engine shutdown): nothing left to guard
        time.sleep(_POLL_S)
    kill_trees(kill)
    for pattern in remove:
        for path in glob.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
    if kill or remove:
        _note(f"process {parent} exited; stopped {len(kill)} process tree(s) it left, removed {remove}")


def kill_trees(processes: list[psutil.Process]) -> None:
    """SIGKILL to `processes` and every descendant they have. No SIGTERM first: a graceful stop
    mostly talks to the process that just died. vLLM's engine core given SIGTERM after its front end
    was killed stops its worker but does not exit for seconds (its output socket to the front end
    lingers up to 4 s on close, vllm/v1/engine/core.py); SIGKILL takes it, its worker and their
    shared memory (unlinked by the resource tracker, see VLLMEngine.start) at once."""
    for process in processes:
        try:
            tree = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()  # psutil checks the start time first: a reused pid is left alone


def is_running(process: psutil.Process) -> bool:
    """Alive and not a zombie; psutil's `is_running` also tells a reused pid apart."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _process(pid: int, create_time: float) -> psutil.Process | None:
    """Process `pid` if it is still the one started at `create_time`."""
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
    return process if abs(process.create_time() - create_time) < 0.01 else None


def _note(message: str) -> None:
    try:
        print(f"[forge-rl reaper] {message}", file=sys.stderr, flush=True)
    except OSError:  # stderr was a pipe to the dead parent
        pass


def main(spec_json: str) -> None:
    # The process it guards decides how to stop on Ctrl-C; the reaper acts only once that has exited.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(spec_json)
    kill = [process for pid, started in spec["kill"] if (process := _process(pid, started)) is not None]
    _guard(spec["parent"], kill, spec["remove"])


if __name__ == "__main__":
    main(sys.argv[1])
