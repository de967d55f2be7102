"""How much memory one Monarch endpoint call leaves behind, in the caller and in the callee.

    python apps/diagnostics/monarch_call_memory.py [--mode call_one|port_calls|blocking_get|mesh_call] [--calls-per-round 5000] [--rounds 4]

A controller process calls a trivial echo actor over and over and prints both processes' unique
memory (USS) after each round. With `call_one` the Python heap does not grow (checked with
tracemalloc) but, with torchmonarch 0.7.0, the native memory of both processes does, linearly in
the number of calls: this is what the soak benchmark's growth came from (docs/benchmarks/README.md,
"soak"). `port_calls` makes the same calls answered on one long-lived port
(forge_rl/plumbing/port_calls.py), which the per-prompt calls of a run use. `blocking_get` makes
them with `call_one(...).get()` from a worker thread, as the weight store's writer thread does
(forge_rl/store/client.py); `mesh_call` with `.call()` on a plain endpoint, as the train loop
called the trainer ranks' `train_next_step` until it called them on its port
(`PortCalls.call_each`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import time

import psutil
from monarch.actor import Actor, concurrent_endpoint, endpoint, this_host

from forge_rl.plumbing.port_calls import PortCalls, PortServed
from forge_rl.plumbing.proc_main import spawn_procs


class Echo(PortServed, Actor):
    @concurrent_endpoint
    async def echo(self, value):
        return value

    @concurrent_endpoint
    async def reply_of(self, num_bytes: int) -> bytes:
        return b"x" * num_bytes

    @endpoint
    async def plain_echo(self, value):
        return value

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


def uss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_full_info().uss / 2**20


async def measure(mode: str, calls_per_round: int, rounds: int, reply_kb: int) -> None:
    procs = spawn_procs(this_host(), "callee")
    echo = procs.spawn("echo", Echo)
    callee = await echo.pid.call_one()
    payload = {"ids": list(range(200)), "text": "x" * 2000}  # about an episode's size
    caller = os.getpid()
    calls = PortCalls()
    request = ("reply_of", reply_kb * 1024) if reply_kb else ("echo", payload)  # reply_kb: a trainer rank's batch

    async def call_round() -> None:
        for _ in range(calls_per_round):
            if mode == "call_one":
                await getattr(echo, request[0]).call_one(request[1])
            elif mode == "port_calls":
                await calls.call(echo, *request)
            else:  # mesh_call
                await echo.plain_echo.call(request[1])

    def blocking_round() -> None:
        for _ in range(calls_per_round):
            getattr(echo, request[0]).call_one(request[1]).get()

    thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    first = None
    for round_index in range(rounds):
        started = time.perf_counter()
        if mode == "blocking_get":
            await asyncio.get_running_loop().run_in_executor(thread, blocking_round)
        else:
            await call_round()
        rate = calls_per_round / (time.perf_counter() - started)
        now = (uss_mb(caller), uss_mb(callee))
        first = first or now
        print(f"round {round_index}: {rate:,.0f} calls/s, caller {now[0]:.1f} MB, callee {now[1]:.1f} MB", flush=True)
    num_calls = calls_per_round * (rounds - 1)
    if num_calls:
        print(
            f"{mode}, per call after the first round: caller {(now[0] - first[0]) * 2**20 / num_calls:.0f} B, "
            f"callee {(now[1] - first[1]) * 2**20 / num_calls:.0f} B"
        )
    await procs.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("call_one", "port_calls", "blocking_get", "mesh_call"), default="call_one")
    parser.add_argument("--calls-per-round", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--reply-kb", type=int, default=0, help="answer each call with this many KB (0: echo the episode-sized request)"
    )
    args = parser.parse_args()
    asyncio.run(measure(args.mode, args.calls_per_round, args.rounds, args.reply_kb))
