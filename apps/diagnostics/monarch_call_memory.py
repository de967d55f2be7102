"""How much memory one Monarch endpoint call leaves behind, in the caller and in the callee.

    python apps/diagnostics/monarch_call_memory.py [--calls-per-round 5000] [--rounds 4]

A controller process calls a trivial echo actor `call_one` over and over and prints both processes'
unique memory (USS) after each round. The Python heap does not grow (checked with tracemalloc);
with torchmonarch 0.7.0 the native memory of both processes does, linearly in the number of calls.
This is what the soak benchmark's growth comes from (docs/benchmarks.md, "Soak"): the GRPO
controller makes about 70 calls per trainer step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import psutil
from monarch.actor import Actor, endpoint, this_host


class Echo(Actor):
    @endpoint
    async def echo(self, value):
        return value

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


def uss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_full_info().uss / 2**20


async def measure(calls_per_round: int, rounds: int) -> None:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    echo = procs.spawn("echo", Echo)
    callee = await echo.pid.call_one()
    payload = {"ids": list(range(200)), "text": "x" * 2000}  # about an episode's size
    caller = os.getpid()
    first = None
    for round_index in range(rounds):
        started = time.perf_counter()
        for _ in range(calls_per_round):
            await echo.echo.call_one(payload)
        rate = calls_per_round / (time.perf_counter() - started)
        now = (uss_mb(caller), uss_mb(callee))
        first = first or now
        print(f"round {round_index}: {rate:,.0f} calls/s, caller {now[0]:.1f} MB, callee {now[1]:.1f} MB", flush=True)
    calls = calls_per_round * (rounds - 1)
    if calls:
        print(
            f"per call after the first round: caller {(now[0] - first[0]) * 2**20 / calls:.0f} B, "
            f"callee {(now[1] - first[1]) * 2**20 / calls:.0f} B"
        )
    await procs.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls-per-round", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(measure(args.calls_per_round, args.rounds))
