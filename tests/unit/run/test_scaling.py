"""`forge-rl scale`'s checks before it asks a run anything, and the request it writes (no run)."""

import json
import os
import subprocess
import sys

import pytest

from forge_rl.run.scaling import CONTROL_DIR, REQUEST_FILE, request_scale, wait_for_answer


def run_dir(tmp_path, controller_pid: int | None):
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.yaml").write_text("steps: 1\n")
    if controller_pid is not None:
        (path / "processes.json").write_text(json.dumps({"controller": controller_pid, "generators": [[1]]}))
    return path


def test_a_request_to_a_running_run_is_written_whole(tmp_path):
    path = run_dir(tmp_path, os.getpid())
    request_id = request_scale(path, 3, grace_s=5.0)
    request = json.loads((path / CONTROL_DIR / REQUEST_FILE).read_text())
    assert request == {"id": request_id, "generators": 3, "grace_s": 5.0}
    assert [p.name for p in (path / CONTROL_DIR).iterdir()] == [REQUEST_FILE]


@pytest.mark.parametrize(
    "generators, grace_s, message",
    [
        (0, 5.0, "--generators (0) must be an integer >= 1: a run needs a generator"),
        (-2, 5.0, "--generators (-2) must be an integer >= 1"),
        (2, -1.0, "--grace-s (-1.0) must be >= 0"),
    ],
)
def test_bad_counts_and_graces_are_refused_naming_the_flag(generators, grace_s, message, tmp_path):
    with pytest.raises(ValueError) as raised:
        request_scale(run_dir(tmp_path, os.getpid()), generators, grace_s)
    assert message in str(raised.value)


def test_a_directory_that_is_no_run_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="is not a run directory .* Name the run's directory"):
        request_scale(tmp_path / "nowhere", 2, 5.0)


def test_a_run_that_is_not_running_is_refused_naming_the_resume_command(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = run_dir(tmp_path, dead.pid)
    with pytest.raises(ValueError, match=f"is not running .* forge-rl grpo --resume {path}"):
        request_scale(path, 2, 5.0)
    (tmp_path / "never_started").mkdir()
    with pytest.raises(ValueError, match="is not running"):  # no processes.json: its processes never started
        request_scale(run_dir(tmp_path / "never_started", None), 2, 5.0)


def test_an_unanswered_request_times_out_naming_the_flag(tmp_path):
    path = run_dir(tmp_path, os.getpid())
    request_id = request_scale(path, 2, 5.0)
    with pytest.raises(TimeoutError, match="raise --wait-s"):
        wait_for_answer(path, request_id, timeout_s=0.3)


def test_the_command_refuses_a_bad_request_with_exit_status_2_naming_the_fix(tmp_path):
    path = run_dir(tmp_path, os.getpid())
    done = subprocess.run(
        [sys.executable, "-m", "forge_rl.cli", "scale", str(path), "--generators", "0"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "cannot scale: --generators (0) must be an integer >= 1" in done.stderr
