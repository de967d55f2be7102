"""Ctrl-C or SIGTERM on a running `forge-rl grpo` stops every process of the run within 10 s, having
written a checkpoint first (the demo config enables checkpoint.on_shutdown)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forge_rl.checkpoint import newest_complete_checkpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180
SHUTDOWN_BUDGET_S = 10


def wait_for_training(process: subprocess.Popen, stderr_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while "step 2/" not in stderr_path.read_text():
        assert process.poll() is None, stderr_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the run did not start training in time"
        time.sleep(0.5)


@pytest.mark.parametrize("sig,exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_a_signal_stops_every_descendant_within_ten_seconds(tmp_path, sig, exit_code):
    stderr_path = tmp_path / "stderr.txt"
    command = [
        sys.executable, "-m", "forge_rl.cli", "grpo", "--config", "configs/grpo_tiny_cpu.yaml",
        "--steps", "100000", "--run-dir", str(tmp_path), "--run-name", "interrupted", "--log.progress-every-s", "0",
    ]
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for_training(process, stderr_path)
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert descendants, "expected actor and engine processes"
        signalled = time.monotonic()
        process.send_signal(sig)
        process.wait(timeout=SHUTDOWN_BUDGET_S)
        remaining = SHUTDOWN_BUDGET_S - (time.monotonic() - signalled)
        _, alive = psutil.wait_procs(descendants, timeout=max(0.0, remaining))
        assert not alive, f"still alive after {SHUTDOWN_BUDGET_S} s: {[p.pid for p in alive]}"
        assert process.returncode == exit_code
        assert "all processes of the run stopped" in stderr_path.read_text()
        log = stderr_path.read_text()
        assert newest_complete_checkpoint(tmp_path / "interrupted") is not None, log[-3000:]
        assert f"forge-rl grpo --resume {tmp_path / 'interrupted'}" in log
    finally:
        for child in psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []:
            child.kill()
        process.kill()
