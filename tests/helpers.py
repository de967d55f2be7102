"""Helpers the tests share: waiting for a state instead of a time, and launching torch.distributed ranks.

Waiting. A test checks a state ("the batch reached the engine", "the worker reaped its children"),
never that a fixed time has passed: `wait_until` polls the condition and returns as soon as it
holds. Its deadline only turns a hang into a failure that names what never happened, so it is
generous (a slow, loaded machine must not reach it) and it is never what the test checks.

Ranks. `spawn_ranks` runs a function on two (or more) fresh processes that see the environment a
launcher such as torchrun gives each rank (`rank_env`), rendezvousing on a free local port.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

HANG_S = 120.0
"""Default deadline of a wait: long past any state a healthy run reaches, short of pytest's patience."""

POLL_S = 0.01


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = HANG_S) -> Any:
    """Poll `condition` until it returns something truthy, and return that; fail naming `what`
    if it has not after `timeout_s` (a hang, not a slow run)."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)
    return result


async def wait_until_async(condition: Callable[[], Any], what: str, timeout_s: float = HANG_S) -> Any:
    """`wait_until` on an event loop: polls between the loop's other tasks."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)
    return result


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """What a launcher sets for one torch.distributed rank on this host."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


def spawn_ranks(fn: Callable[..., None], *args, nprocs: int = 2) -> None:
    """Run `fn(rank, *args)` on `nprocs` fresh processes (torch.multiprocessing spawn), each with
    its rank's launcher environment; returns when all exited, raises if one failed.

    `fn` must be importable by name (a module-level function) and `args` picklable.
    """
    import torch.multiprocessing as mp

    mp.spawn(_as_rank, args=(nprocs, free_port(), fn, args), nprocs=nprocs, join=True)


def _as_rank(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    fn(rank, *args)


def described(processes) -> list[str]:
    """`pid (parent ppid): command line` of each of `psutil` `processes` still there: what a test
    names when processes outlive what should have stopped them."""
    import psutil

    names = []
    for process in processes:
        try:
            names.append(f"{process.pid} (parent {process.ppid()}): {' '.join(process.cmdline())[:200]}")
        except psutil.Error:
            pass
    return names
