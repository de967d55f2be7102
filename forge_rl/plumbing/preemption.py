"""A host's preemption notice: `forge-rl worker` turns its SIGTERM into a notice its processes read.

Cloud schedulers warn a preemptible machine before they take it: a SIGTERM, then a grace period
(30 s on GCP's spot VMs, 2 min on AWS's, configurable on Slurm and Kubernetes), then SIGKILL.
A worker that simply died at the SIGTERM would take its generators' work in flight with it. Instead:

    SIGTERM ──▶ the worker writes the notice file (whole or not at all) and keeps serving
              ──▶ every process it spawned (they inherit PREEMPTION_NOTICE_ENV) sees the file
                  (`wait_for_preemption_notice`): a generator's pool takes it out of the run within
                  the grace (`forge_rl.run.scaling.Scaling`), its groups finish or continue elsewhere
              ──▶ the grace is over (or a second SIGTERM): the worker dies of SIGTERM, as it would have

The notice travels as a file, not a message, because the worker runs no code of forge_rl's once
Monarch's loop serves (its processes are Monarch's), and a file on the host reaches every process
there without the controller (which may be on another host, and is what decides what to do).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

PREEMPTION_NOTICE_ENV = "FORGE_RL_PREEMPTION_NOTICE"
"""The notice file of the worker a process was spawned by (unset: not spawned by `forge-rl worker`)."""
POLL_INTERVAL_S = 0.5
"""How often a process looks for its worker's notice: a small part of any scheduler's grace."""
_HANDLER_WAIT_S = 5.0
"""How long the end of the grace waits for the main thread to run the SIGTERM handler."""


def arm_preemption_notice(grace_s: float, port: int) -> Path:
    """In `forge-rl worker`, before Monarch's loop starts: its first SIGTERM writes the notice file
    (returned, and named to its future processes by PREEMPTION_NOTICE_ENV) and ends the worker
    `grace_s` later; a second SIGTERM ends it at once."""
    path = Path(tempfile.gettempdir()) / f"forge-rl-worker-{port}-{os.getpid()}.preemption"
    path.unlink(missing_ok=True)
    os.environ[PREEMPTION_NOTICE_ENV] = str(path)

    def grace_over() -> None:
        # A handler can be reset on the main thread only: this SIGTERM is the "second" one.
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_HANDLER_WAIT_S)
        os._exit(128 + signal.SIGTERM)  # the main thread never ran the handler

    def on_sigterm(signum, frame) -> None:
        if path.exists():  # a second notice (the scheduler or the user means it), or the grace is over
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        notice = {"grace_s": grace_s, "unix_time": time.time(), "host": socket.gethostname()}
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(notice))
        partial.rename(path)
        print(
            f"[forge-rl worker] SIGTERM: preemption notice written to {path}; the run takes this host's generators "
            f"out within {grace_s:g} s, then this worker ends (a second SIGTERM ends it now)",
            file=sys.stderr,
            flush=True,
        )
        timer = threading.Timer(grace_s, grace_over)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)
    return path


async def wait_for_preemption_notice() -> dict | None:
    """In a process a worker spawned: returns once its worker got a preemption notice, with the
    seconds of its grace left (`grace_left_s`) and the host's name; None at once when this process
    has no worker to hear from (a local run)."""
    name = os.environ.get(PREEMPTION_NOTICE_ENV)
    if not name:
        return None
    path = Path(name)
    while not path.exists():
        await asyncio.sleep(POLL_INTERVAL_S)
    notice = json.loads(path.read_text())
    return {"host": notice["host"], "grace_left_s": max(0.0, notice["grace_s"] - (time.time() - notice["unix_time"]))}
