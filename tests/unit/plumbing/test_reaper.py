"""The reaper cleans up after a process killed with SIGKILL, and only after that one."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux process semantics")

DEADLINE_S = 10

# A guarded process: starts a child that ignores SIGTERM (like multiprocessing's resource tracker)
# with a child of its own, and a reaper guarding both; prints the three pids.
GUARDED = textwrap.dedent("""
    import subprocess, sys, time
    import psutil
    from forge_rl.plumbing.reaper import Reaper

    stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", stubborn])
    while not psutil.Process(child.pid).children():
        time.sleep(0.05)
    reaper = Reaper.start(kill=[psutil.Process(child.pid)], remove=[sys.argv[1] + "*"])
    if sys.argv[2] == "dismiss":
        reaper.dismiss()
    print(child.pid, psutil.Process(child.pid).children()[0].pid, reaper.process.pid, flush=True)
    time.sleep(600)
""")


def start_guarded(tmp_path, mode: str):
    process = subprocess.Popen(
        [sys.executable, "-c", GUARDED, str(tmp_path / "shm-"), mode], stdout=subprocess.PIPE, text=True
    )
    child, grandchild, reaper = (int(pid) for pid in process.stdout.readline().split())
    return process, psutil.Process(child), psutil.Process(grandchild), reaper


def test_a_killed_process_leaves_no_process_tree_and_no_path_behind(tmp_path):
    (tmp_path / "shm-root").mkdir()
    (tmp_path / "shm-root-fetched-1").mkdir()
    (tmp_path / "other-run").mkdir()
    process, child, grandchild, reaper = start_guarded(tmp_path, "guard")
    reaper = psutil.Process(reaper)
    process.kill()
    process.wait()
    _, alive = psutil.wait_procs([child, grandchild, reaper], timeout=DEADLINE_S)
    assert not alive
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-run"]


def test_a_dismissed_reaper_touches_nothing(tmp_path):
    (tmp_path / "shm-root").mkdir()
    process, child, grandchild, reaper = start_guarded(tmp_path, "dismiss")
    try:
        assert not psutil.pid_exists(reaper)
        process.kill()
        process.wait()
        time.sleep(0.5)  # what the reaper would have needed to act: it must not have
        assert child.is_running() and grandchild.is_running()
        assert (tmp_path / "shm-root").is_dir()
    finally:
        for leftover in (grandchild, child):
            leftover.kill()
        process.kill()


def test_a_reaper_exits_once_what_it_guards_has_exited():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    from forge_rl.plumbing.reaper import Reaper

    reaper = Reaper.start(kill=[psutil.Process(sleeper.pid)])
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    assert reaper.process.wait(timeout=DEADLINE_S) == 0
