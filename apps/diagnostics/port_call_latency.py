"""What a call answered on a port (forge_rl/plumbing/port_calls.py) costs in latency against `call_one`,
with calls in flight as a run has them.

    python apps/diagnostics/port_call_latency.py [--in-flight 16] [--calls 100] [--work-ms 5]

`--in-flight` callers each make `--calls` calls, one after another, to an actor whose endpoint
waits `--work-ms`; the two ways take turns, twice. Prints calls/s and the median and p90 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from monarch.actor import Actor, concurrent_endpoint, this_host

from forge_rl.plumbing.port_calls import PortCalls, PortServed
from forge_rl.plumbing.proc_main import spawn_procs


class Worker(PortServed, Actor):
    @concurrent_endpoint
    async def work(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds


async def measure(in_flight: int, calls: int, work_s: float) -> None:
    procs = spawn_procs(this_host(), "callee")
    worker = procs.spawn("worker", Worker)
    port_calls = PortCalls()
    await worker.work.call_one(0.0)
    await port_calls.call(worker, "work", 0.0)
    for mode in ("call_one", "port_calls") * 2:

        async def caller(mode: str = mode) -> list[float]:
            latencies = []
            for _ in range(calls):
                started = time.perf_counter()
                if mode == "call_one":
                    await worker.work.call_one(work_s)
                else:
                    await port_calls.call(worker, "work", work_s)
                latencies.append(time.perf_counter() - started)
            return latencies

        started = time.perf_counter()
        latencies = sorted(sum(await asyncio.gather(*(caller() for _ in range(in_flight))), []))
        rate = len(latencies) / (time.perf_counter() - started)
        median, p90 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.9)]
        print(f"{mode}: {rate:,.0f} calls/s, median {median * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms", flush=True)
    await procs.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--work-ms", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(measure(args.in_flight, args.calls, args.work_ms / 1000))
