"""How much memory a Monarch client's idle meshes leave behind, and how long a dead process takes to be
reported: both set by Monarch's supervision poll.

    python apps/diagnostics/monarch_idle_memory.py [--procs 4] [--extra-meshes 0] [--stop-extra] [--duration-s 300]
    python apps/diagnostics/monarch_idle_memory.py --kill-one
    HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=2s python apps/diagnostics/monarch_idle_memory.py ...

This process spawns `--procs` processes, one idle actor on each, and `--extra-meshes` more idle
actor meshes on them (stopped before measuring with `--stop-extra`), then makes no call at all
and prints its own unique memory (USS) every 30 s and its growth per second. With torchmonarch
0.7.0 it grows linearly: Monarch polls every live mesh from its owner's process every
HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY (10 s by default), and each poll leaves about 3 KB per
mesh behind, whatever the mesh does (docs/benchmarks/README.md,
"soak"). `--kill-one` instead SIGKILLs the first process and prints how long Monarch took to report
it to this owner's fault hook: the poll is how a dead process is found.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

import monarch.actor
import psutil
from monarch.actor import Actor, endpoint, this_host

from forge_rl.plumbing.proc_main import spawn_procs

_POLL = "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"


class Idle(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()


async def measure(args: argparse.Namespace) -> None:
    poll = os.environ.get(_POLL, "10s (default)")
    reported: list[float] = []
    monarch.actor.unhandled_fault_hook = lambda failure: reported.append(time.monotonic())
    procs = [spawn_procs(this_host(), f"idle{i}") for i in range(args.procs)]
    actors = [p.spawn("idle", Idle) for p in procs]
    extra = [procs[i % args.procs].spawn(f"extra{i}", Idle) for i in range(args.extra_meshes)]
    pids = [await a.pid.call_one() for a in actors + extra]
    if args.kill_one:
        killed = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        while not reported and time.monotonic() - killed < 300:
            await asyncio.sleep(0.05)
        said = f"{reported[0] - killed:.2f} s after the kill" if reported else "not within 300 s"
        print(f"poll {poll}: the dead process was reported {said}", flush=True)
        os._exit(0)  # the fault hook's mesh is broken: nothing left to stop cleanly
    if args.stop_extra:
        for mesh in extra:
            await mesh.stop()
    me = psutil.Process()
    await asyncio.sleep(20)  # spawning's own allocations settle
    started, first = time.monotonic(), me.memory_full_info().uss
    while (elapsed := time.monotonic() - started) < args.duration_s:
        print(f"{elapsed:6.0f} s: USS {me.memory_full_info().uss / 2**20:.2f} MiB", flush=True)
        await asyncio.sleep(min(30.0, args.duration_s - elapsed))
    growth_kb_s = (me.memory_full_info().uss - first) / 1e3 / (time.monotonic() - started)
    print(
        f"poll {poll}, {args.procs} processes with one actor each, {args.extra_meshes} more actor meshes"
        f"{' (stopped)' if args.stop_extra else ''}: USS growth {growth_kb_s:.2f} KB/s",
        flush=True,
    )
    for p in procs:
        await p.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--extra-meshes", type=int, default=0)
    parser.add_argument("--stop-extra", action="store_true")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--kill-one", action="store_true")
    asyncio.run(measure(parser.parse_args()))
