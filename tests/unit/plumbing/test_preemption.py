"""A worker's SIGTERM as a preemption notice (forge_rl/plumbing/preemption.py), over real
processes: a "worker" that arms the notice and spawns a child, as `forge-rl worker` spawns a
run's processes; the child waits for the notice as a generator does."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from forge_rl.plumbing.preemption import PREEMPTION_NOTICE_ENV, wait_for_preemption_notice
from forge_rl.plumbing.workers import WorkerArgs

WORKER = """
import subprocess, sys, time
from forge_rl.plumbing.preemption import arm_preemption_notice
path = arm_preemption_notice(grace_s=float(sys.argv[1]), port=1)
child = subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdout=sys.stdout)
print("armed", path, flush=True)
child.wait()
while True:  # serving, as Monarch's loop would
    time.sleep(1)
"""
CHILD = """
import asyncio, json
from forge_rl.plumbing.preemption import wait_for_preemption_notice
print("notice", json.dumps(asyncio.run(wait_for_preemption_notice())), flush=True)
"""


def _worker(grace_s: float) -> tuple[subprocess.Popen, str]:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(grace_s), CHILD],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != PREEMPTION_NOTICE_ENV},
    )
    line = worker.stdout.readline()
    assert line.startswith("armed "), line
    return worker, line.split()[1]


def test_a_workers_sigterm_reaches_its_processes_as_a_notice_and_ends_it_after_the_grace():
    worker, path = _worker(grace_s=2.0)
    try:
        signaled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        line = worker.stdout.readline()  # the child saw the notice, and the worker still serves
        assert line.startswith("notice ") and worker.poll() is None, line
        notice = json.loads(line.split(" ", 1)[1])
        assert 0 < notice["grace_left_s"] <= 2.0 and notice["host"]
        assert worker.wait(timeout=30) == -signal.SIGTERM  # ends as the SIGTERM would have ended it
        assert time.monotonic() - signaled >= 2.0
    finally:
        worker.kill()
        os.unlink(path)


def test_a_second_sigterm_ends_the_worker_at_once():
    worker, path = _worker(grace_s=600.0)
    try:
        worker.send_signal(signal.SIGTERM)
        assert worker.stdout.readline().startswith("notice ")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == -signal.SIGTERM
    finally:
        worker.kill()
        os.unlink(path)


def test_a_process_no_worker_spawned_has_no_notice_to_wait_for(monkeypatch):
    monkeypatch.delenv(PREEMPTION_NOTICE_ENV, raising=False)
    assert asyncio.run(wait_for_preemption_notice()) is None


def test_a_negative_grace_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--preemption-grace-s \(-1.0\) must be >= 0"):
        WorkerArgs(preemption_grace_s=-1.0)
