"""Real Monarch workers (`forge-rl worker`, listening on tcp://127.0.0.1:PORT) standing in for hosts:
the tests of the multi-host path (tests/integration/test_multi_host.py, the tp variant of
tests/integration/test_grpo_loop.py) attach controllers to them through a host list."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from tests.support.helpers import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


def start_workers(count: int) -> tuple[list[int], list[subprocess.Popen]]:
    """`count` workers, returned once each listens: the controller's own reachability check gives
    up after launch.connect_timeout_s (5 s), and a worker importing Monarch on a loaded host can
    take longer than that."""
    ports = [free_port() for _ in range(count)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "forge_rl.cli", "worker", "--port", str(port), "--host", "127.0.0.1"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for port in ports
    ]
    try:
        for port, worker in zip(ports, workers):
            wait_until(lambda port=port, worker=worker: listening(port, worker), f"the worker on port {port} to listen")
    except BaseException:
        for worker in workers:
            stop_worker(worker)
        raise
    return ports, workers


def listening(port: int, worker: subprocess.Popen) -> bool:
    assert worker.poll() is None, f"the worker for port {port} exited with {worker.returncode}"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def run_processes_left(workers: list[subprocess.Popen]) -> list[int]:
    """Processes still under the workers (each reaps its share of the run after it ends)."""
    return [p.pid for w in workers for p in psutil.Process(w.pid).children(recursive=True)]


def stop_worker(worker: subprocess.Popen) -> None:
    """The worker and every process it spawned (its session)."""
    try:
        family = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    worker.wait(timeout=10)
