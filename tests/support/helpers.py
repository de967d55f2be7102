"""Helpers the tests share: waiting for a state instead of a time, and launching torch.distributed ranks.

Waiting. A test checks a state ("the batch reached the engine", "the worker reaped its children"),
never that a fixed time has passed: `wait_until` polls the condition and returns as soon as it
holds. Its deadline only turns a hang into a failure that names what never happened, so it is
generous (a slow, loaded machine must not reach it) and it is never what the test checks.

Ranks. `run_on_ranks` runs a function on two (or more) processes that see the environment a
launcher such as torchrun gives each rank (`rank_env`), rendezvousing on a free local port. The
processes live for the whole session and keep their process group (`RankPool`): a fresh pair
imports torch and TorchTitan again, 10-15 s of each multi-process test on this machine, and there
were a dozen such tests. A test whose point is that nothing survives but a file asks for `fresh`.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_any
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


def sigint_handled() -> None:
    """A `preexec_fn` for a command a test stops with Ctrl-C: SIGINT handled, as a terminal starts a
    job. A shell without job control starts its background commands (pytest among them, and so
    every process pytest starts) with SIGINT ignored, and the command would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


def run_on_ranks(fn: Callable[..., None], *args, nprocs: int = 2, fresh: bool = False) -> None:
    """Run `fn(rank, *args)` on `nprocs` rank processes with their launcher environment and, once
    `fn` (through the trainer) has made it, their process group; returns when every rank returned,
    raises if one failed. `fn` must be importable by name and `args` picklable. It must leave the
    process group alone: the session's ranks keep it (`fresh`: new processes, gone afterwards)."""
    if fresh:
        import torch.multiprocessing as mp

        mp.spawn(_as_fresh_rank, args=(nprocs, free_port(), fn, args), nprocs=nprocs, join=True)
        return
    if nprocs not in _POOLS:
        _POOLS[nprocs] = RankPool(nprocs)
    try:
        _POOLS[nprocs].run(fn, args)
    except BaseException:
        _POOLS.pop(nprocs).stop()  # a failed rank may leave the others in a collective: start over
        raise


class RankPool:
    """`nprocs` processes, one per rank, that run functions sent to them one at a time."""

    def __init__(self, nprocs: int) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        port = free_port()
        self.connections, self.processes = [], []
        for rank in range(nprocs):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve_rank, args=(rank, nprocs, port, theirs), name=f"rank{rank}")
            process.start()
            self.connections.append(ours)
            self.processes.append(process)

    def run(self, fn: Callable[..., None], args: tuple) -> None:
        for connection in self.connections:
            connection.send((fn, args))
        waiting = dict(enumerate(self.connections))
        while waiting:
            sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes) if rank in waiting}
            for ready in wait_for_any([*waiting.values(), *sentinels]):
                if ready in sentinels:
                    raise RuntimeError(
                        f"rank {sentinels[ready]} exited (code {self.processes[sentinels[ready]].exitcode}) while running {fn.__name__}"
                    )
                rank = next(r for r, c in waiting.items() if c is ready)
                failure = waiting.pop(rank).recv()
                if failure is not None:
                    raise RuntimeError(f"rank {rank} failed in {fn.__name__}:\n{failure}")

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()


_POOLS: dict[int, RankPool] = {}
atexit.register(lambda: [_POOLS.pop(n).stop() for n in list(_POOLS)])


def _serve_rank(rank: int, world_size: int, port: int, connection) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    while True:
        fn, args = connection.recv()
        try:
            fn(rank, *args)
            connection.send(None)
        except BaseException:
            connection.send(traceback.format_exc())


def _as_fresh_rank(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    fn(rank, *args)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


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


def alive(processes) -> list:
    """Those of `psutil` `processes` still running and not zombies (`forge_rl.plumbing.reaper.is_running`)."""
    from forge_rl.plumbing.reaper import is_running

    return [process for process in processes if is_running(process)]


def episode_limits(**fields):
    """`EpisodeLimits` with both token limits set, for a test that plays episodes without a run (a
    run resolves unset limits against its model and generator): 4096 tokens in all and 1024 per
    turn unless `fields` say otherwise."""
    from forge_rl.envs.runner import EpisodeLimits

    return EpisodeLimits(**{"max_total_tokens": 4096, "max_tokens_per_turn": 1024, **fields})


def assert_every_prompt_accounted_for(accounting: dict, trained: int | None = None) -> None:
    """A run summary's prompt accounting is exact: none trained twice, every prompt handed out
    trained, dropped, filtered, skipped or unfinished at the stop; `trained`: that many trained."""
    assert accounting["trained_more_than_once"] == 0
    settled = ("trained", "dropped", "filtered_zero_advantage", "skipped_nonfinite", "unfinished_at_stop")
    assert accounting["prompts_handed_out"] == sum(accounting[outcome] for outcome in settled), accounting
    if trained is not None:
        assert accounting["trained"] == trained, accounting


def run_config_file(path, run_dir, run_name: str, **changes):
    """The recipe run of the YAML config at `path` with `changes` (dataclasses.replace fields), in
    this process, as RUN_DIR/RUN_NAME: (its summary, its per-step metrics, the config it ran)."""
    import dataclasses
    import json

    from apps.grpo.main import run
    from forge_rl.config import GRPOConfig
    from forge_rl.yaml_config import load_yaml_config

    config = dataclasses.replace(load_yaml_config(GRPOConfig, path), run_dir=run_dir, run_name=run_name, **changes)
    summary = asyncio.run(asyncio.wait_for(run(config), HANG_S * 5))
    metrics = [json.loads(line) for line in (config.run_dir / run_name / "metrics.jsonl").read_text().splitlines()]
    assert_metric_keys_documented(metrics)
    return summary, metrics, config


def assert_metric_keys_documented(records: list[dict]) -> None:
    """Every key a run wrote to metrics.jsonl has its meaning in the docs."""
    missing = undocumented_metric_keys(records)
    assert not missing, (
        f"metrics.jsonl keys {missing} are in neither docs/reference/metrics.md nor docs/observability.md's table: "
        "name them in forge_rl/observability/metric_names.py (then `make reference`) or in that table"
    )


def undocumented_metric_keys(records: list[dict]) -> list[str]:
    """The keys of metrics.jsonl records that neither docs/reference/metrics.md nor the table of
    docs/observability.md names. A documented key may stand for several: `a/*` and `a/<name>`
    cover every key under `a/`, `weights/*_s` the `weights/` keys ending in `_s`."""
    import fnmatch
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    patterns = set()
    for page in (docs / "reference" / "metrics.md", docs / "observability.md"):
        for line in page.read_text().splitlines():
            if line.startswith("| "):
                first_cell = line.split("|")[1]
                for key in re.findall(r"`([^`]+)`", first_cell):
                    patterns.add(re.sub(r"<[^>]+>", "*", key))
    patterns |= {p + "*" for p in patterns if p.endswith("/")}  # a prefix in the metrics reference
    keys = sorted({key for record in records for key in record})
    return [key for key in keys if not any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)]
