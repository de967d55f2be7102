"""The controller of `forge-rl grpo` killed with SIGKILL mid-run (it runs no cleanup): within 10 s no
process of the run is left and nothing of it in host shared memory (the weight store's root, vLLM's
psm_* segments and sem.* semaphores); `forge-rl grpo --resume` then runs to the end with no prompt
lost or trained twice. Measured from outside, as a user would see it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forge_rl.checkpoint import newest_complete_checkpoint, read_controller_state

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
CHECKPOINT_TIMEOUT_S = 240
CLEANUP_BUDGET_S = 10
STEPS_AFTER_RESUME = 2


def _grpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "forge_rl.cli", "grpo", *args, "--log.progress-every-s", "0"]


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _describe(processes: list[psutil.Process]) -> list[str]:
    described = []
    for process in processes:
        try:
            described.append(f"{process.pid} (parent {process.ppid()}): {' '.join(process.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return described


def _kill_survivors(processes: list[psutil.Process]) -> None:
    """Whatever of the run a failed test left; resource trackers are spared, as they unlink the
    shared memory they track once the processes holding them are gone."""
    for process in _alive(processes):
        if not any("resource_tracker" in part for part in _describe([process])):
            process.kill()


def _poll(condition, deadline: float) -> None:
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.skipif(not SHM.is_dir(), reason="needs host shared memory at /dev/shm (Linux)")
def test_a_killed_controller_leaves_nothing_behind_and_the_run_resumes(tmp_path):
    run_path = tmp_path / "run"
    shm_before = set(os.listdir(SHM))
    stderr_path = tmp_path / "first.stderr"
    first = _grpo(
        "--config", "configs/grpo_tiny_cpu.yaml", "--steps", "1000", "--train-batch-size", "32", "--group-size", "4",
        "--prompts-in-flight-per-generator", "8", "--checkpoint.enabled", "--checkpoint.every-n-steps", "2",
        "--run-dir", str(tmp_path), "--run-name", "run",
    )
    with open(stderr_path, "w") as stderr:
        controller = subprocess.Popen(first, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    run_processes = []
    try:
        deadline = time.monotonic() + CHECKPOINT_TIMEOUT_S
        while newest_complete_checkpoint(run_path) is None:
            assert controller.poll() is None, stderr_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no checkpoint in {CHECKPOINT_TIMEOUT_S} s"
            time.sleep(0.2)
        # Every process of the run: the controller's descendants (actors, vLLM's engine processes,
        # reward workers, ...) and the pids the run recorded.
        run_processes = psutil.Process(controller.pid).children(recursive=True)
        recorded = json.loads((run_path / "processes.json").read_text())
        for pid in [*recorded["trainer"], *(pid for generator in recorded["generators"] for pid in generator)]:
            if pid not in {process.pid for process in run_processes}:
                run_processes.append(psutil.Process(pid))
        os.kill(controller.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        controller.wait()
        deadline = killed_at + CLEANUP_BUDGET_S
        _poll(lambda: not _alive(run_processes), deadline)
        survivors = _describe(_alive(run_processes))
        _poll(lambda: not set(os.listdir(SHM)) - shm_before, deadline)
        left_in_shm = sorted(set(os.listdir(SHM)) - shm_before)
        cleaned_up_s = time.monotonic() - killed_at
    finally:
        if controller.poll() is None:
            run_processes = psutil.Process(controller.pid).children(recursive=True)
            controller.kill()
        _kill_survivors(run_processes)
    assert not survivors, f"alive {CLEANUP_BUDGET_S} s after the controller was killed: {survivors}"
    assert not left_in_shm, f"left in /dev/shm {CLEANUP_BUDGET_S} s after the controller was killed: {left_in_shm}"
    assert cleaned_up_s < CLEANUP_BUDGET_S

    at_resume = read_controller_state(newest_complete_checkpoint(run_path))
    steps = at_resume.step + STEPS_AFTER_RESUME
    second = subprocess.run(
        _grpo("--resume", str(run_path), "--steps", str(steps)), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["steps"] == steps
    accounting = summary["accounting"]
    assert accounting["trained_more_than_once"] == 0
    assert accounting["reissued_after_resume"] == len(at_resume.reissue)
    assert accounting["unfinished_at_stop"] >= 0, accounting  # the counts add up to the prompts handed out
    # No prompt lost: every prompt handed out over both segments is trained, dropped, skipped,
    # filtered, or still pending in the final checkpoint (checkpoint.on_shutdown).
    at_end = read_controller_state(newest_complete_checkpoint(run_path))
    assert at_end.step == steps
    times_trained = bytearray.fromhex(at_end.accounting["times_trained"])
    settled_or_pending = {
        *(prompt for prompt, count in enumerate(times_trained) if count), *at_end.buffer["dropped"]["episode_ids"],
        *at_end.accounting["skipped_ids"], *at_end.accounting["filtered_ids"], *at_end.reissue,
    }
    assert set(range(at_end.dataset_cursor)) == settled_or_pending
    assert not set(os.listdir(SHM)) - shm_before, "the resumed run left shared memory behind"
