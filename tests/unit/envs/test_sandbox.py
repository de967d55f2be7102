"""The sandbox for model-written code: each escape is tried for real, in the real sandbox, and must be
stopped; the standard library must still run.

Other processes at stake stand in as a bystander (`sleep`, a process of the same user that the code
knows the pid of, as it would know the rollouts' or the trainer's) and the test process itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import platform
import signal
import socket
import subprocess
import sys

import pytest

from forge_rl.envs.environment import MalformedTurn, Message
from forge_rl.envs.python_tool import PythonToolEnv
from forge_rl.envs.sandbox import SandboxConfig, run_python
from forge_rl.errors import SandboxUnavailable

# ---------------------------------------------------------------------------------------------------
# The sandbox: each escape attempt is stopped and reported
# ---------------------------------------------------------------------------------------------------

SMALL = SandboxConfig(max_wall_time_s=5.0, max_cpu_time_s=1, max_memory_bytes=256 * 2**20, max_output_bytes=1000)


def run(code: str, config: SandboxConfig = SMALL):
    return asyncio.run(run_python(code, config))


@pytest.fixture(scope="module", autouse=False)
def sandbox():
    """Skips (naming what is missing) on machines that cannot confine code; runs everywhere else."""
    try:
        return run("pass")
    except SandboxUnavailable as e:
        pytest.skip(f"the sandbox needs Linux with seccomp and Landlock: {e}")


def test_the_sandbox_reports_the_mechanisms_that_confine_it(sandbox):
    assert sandbox.exit_code == 0
    assert {"rlimits", "seccomp"} <= set(sandbox.isolation) and any(i.startswith("landlock") for i in sandbox.isolation)


def test_sandboxed_code_runs_in_its_own_directory_with_a_scrubbed_environment(sandbox, monkeypatch):
    monkeypatch.setenv("FORGE_TEST_SECRET", "hunter2")
    result = run(
        "import os\n"
        "print(os.getcwd() == os.environ['HOME'], sorted(os.environ))\n"
        "try:\n"
        "    print(open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError as e:\n"
        "    print('parent environ:', type(e).__name__)\n"
    )
    assert result.exit_code == 0 and "hunter2" not in result.stdout
    assert result.stdout.splitlines() == ["True ['HOME', 'LANG', 'PATH', 'TMPDIR']", "parent environ: PermissionError"]


def test_a_fork_bomb_is_refused(sandbox):
    result = run("import os\nwhile True:\n    os.fork()\n")
    assert result.exit_code == 1 and "PermissionError" in result.stderr and not result.timed_out


def test_starting_a_subprocess_or_thread_is_refused(sandbox):
    result = run("import subprocess\nsubprocess.run(['true'])\n")
    assert result.exit_code == 1 and "PermissionError" in result.stderr
    result = run("import threading\nthreading.Thread(target=print).start()\n")
    assert result.exit_code == 1 and "can't start new thread" in result.stderr


def test_a_memory_bomb_fails_at_the_address_space_limit(sandbox):
    result = run("blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 2**20))\n")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_an_infinite_loop_is_killed_at_the_cpu_time_limit(sandbox):
    result = run("while True:\n    pass\n")
    assert result.ended_by == "killed: CPU time limit" and not result.timed_out


def test_code_that_waits_forever_is_killed_at_the_wall_clock_limit(sandbox):
    result = run("import signal\nsignal.pause()\n", SandboxConfig(max_wall_time_s=0.3))
    assert result.timed_out and result.ended_by == "killed: wall-clock time limit"


def test_sandboxed_code_cannot_write_or_read_outside_its_directory(sandbox, tmp_path):
    run_dir = tmp_path / "run"  # stands for the run directory: checkpoints, weights, logs
    run_dir.mkdir()
    (run_dir / "checkpoint.txt").write_text("weights")
    result = run(
        "import os\n"
        f"for path in ['{run_dir}/escaped.txt', '{tmp_path}/escaped.txt', os.path.expanduser('~/../escaped.txt')]:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError as e:\n"
        "        print('write', type(e).__name__)\n"
        "try:\n"
        f"    print(open('{run_dir}/checkpoint.txt').read())\n"
        "except OSError as e:\n"
        "    print('read', type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
    )
    assert result.stdout.splitlines() == ["write PermissionError"] * 3 + ["read PermissionError"]
    assert result.exit_code == 0 and sorted(os.listdir(run_dir)) == ["checkpoint.txt"]
    assert not (tmp_path / "escaped.txt").exists()


def test_sandboxed_code_cannot_open_a_socket_to_a_local_listener(sandbox):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result = run(
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print(type(e).__name__)\n"
        )
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            listener.accept()
    assert result.stdout == "PermissionError\n"


def test_sandboxed_code_cannot_signal_its_parent(sandbox):
    result = run("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\n")
    assert result.exit_code == 1 and "PermissionError" in result.stderr
    # Nor have the kernel signal it when a file is ready (F_SETOWN); other fcntl commands work.
    result = run("import fcntl, os\nfcntl.fcntl(1, fcntl.F_GETFL)\nfcntl.fcntl(1, fcntl.F_SETOWN, os.getppid())\n")
    assert result.exit_code == 1 and "PermissionError" in result.stderr and "F_SETOWN" in result.stderr


def test_long_output_is_truncated(sandbox):
    result = run("print('x' * 5000)\n")
    assert result.output_truncated and result.stdout == "x" * 1000


def test_the_python_tool_runs_code_in_the_sandbox_and_scores_the_answer(sandbox):
    env = PythonToolEnv(question="What is 6 times 7?", answer="42", sandbox=SMALL)

    async def episode():
        prompt = await env.reset()
        ran = await env.step("Let me compute.\n```python\nprint(6 * 7)\n```")
        done = await env.step("Answer: 42")
        return prompt, ran, done

    prompt, ran, done = asyncio.run(episode())
    assert prompt[-1] == Message("user", "What is 6 times 7?")
    assert ran.observation == [Message("user", "Output:\n42\n\n(exit code 0)")]
    assert (done.done, done.final_reward) == (True, 1.0)
    with pytest.raises(MalformedTurn):
        asyncio.run(env.step("I think it is 42."))


# ---------------------------------------------------------------------------------------------------
# Other processes of the same user: limits, scheduling, namespaces, kernel objects
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def bystander():
    """A process of the caller's user that sandboxed code could aim at by pid."""
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def limits_of(pid: int) -> str:
    with open(f"/proc/{pid}/limits") as f:
        return f.read()


def test_sandboxed_code_cannot_change_the_resource_limits_of_another_process(sandbox, bystander):
    before = limits_of(bystander.pid), limits_of(os.getpid())
    result = run(
        "import os, resource\n"
        f"for pid, limit, value in [({bystander.pid}, resource.RLIMIT_NOFILE, (3, 3)),\n"
        f"                          ({bystander.pid}, resource.RLIMIT_CPU, (1, 1)),\n"
        "                          (os.getppid(), resource.RLIMIT_CPU, (1, 1))]:\n"
        "    try:\n"
        "        resource.prlimit(pid, limit, value)\n"
        "        print('changed', pid)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
        "try:\n"
        "    resource.prlimit(os.getppid(), resource.RLIMIT_CORE)\n"
        "    print('read the parent')\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (16, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "resource.prlimit(os.getpid(), resource.RLIMIT_CORE, (0, 0))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    assert result.stdout.splitlines() == ["PermissionError"] * 4 + ["16"], result.stderr
    assert (limits_of(bystander.pid), limits_of(os.getpid())) == before


def test_sandboxed_code_cannot_reprioritize_or_move_another_process(sandbox, bystander):
    nice, affinity = os.getpriority(os.PRIO_PROCESS, bystander.pid), os.sched_getaffinity(bystander.pid)
    result = run(
        "import os\n"
        "for call in [lambda: os.setpriority(os.PRIO_PROCESS, PID, 19),\n"
        "             lambda: os.sched_setaffinity(PID, {0}),\n"
        "             lambda: os.sched_setscheduler(PID, os.SCHED_IDLE, os.sched_param(0))]:\n"
        "    try:\n"
        "        call()\n"
        "        print('changed')\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n".replace("PID", str(bystander.pid))
    )
    assert result.stdout.splitlines() == ["PermissionError"] * 3, result.stderr
    assert (os.getpriority(os.PRIO_PROCESS, bystander.pid), os.sched_getaffinity(bystander.pid)) == (nice, affinity)
    assert os.sched_getscheduler(bystander.pid) == os.SCHED_OTHER


def syscall_numbers(names: list[str]) -> dict[str, int]:
    """This machine's numbers for `names`, from libseccomp (the sandbox's own table)."""
    seccomp = ctypes.CDLL("libseccomp.so.2")
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    numbers = {name: seccomp.seccomp_syscall_resolve_name(name.encode()) for name in names}
    return {name: number for name, number in numbers.items() if number >= 0}


# Each call with arguments that would take effect (or fail only on its arguments) were it reachable.
RESTRICTED_CALLS = {
    "unshare": "(0x10000000,)",  # a nested user namespace: capabilities over new namespaces
    "setns": "(0, 0)",
    "pidfd_open": "(os.getppid(), 0)",
    "kcmp": "(os.getpid(), os.getppid(), 0, 0, 0)",
    "process_madvise": "(0, 0, 0, 0, 0)",
    "ioprio_set": "(1, BYSTANDER, (3 << 13))",  # IOPRIO_WHO_PROCESS, idle class
    "migrate_pages": "(BYSTANDER, 64, None, None)",
    "move_pages": "(BYSTANDER, 0, None, None, None, 0)",
    "bpf": "(0, None, 0)",
    "userfaultfd": "(0,)",
    "perf_event_open": "(None, 0, -1, -1, 0)",
    "fsopen": "(b'tmpfs', 0)",
    "fspick": "(-100, b'/', 0)",
    "open_tree": "(-100, b'/', 1)",
    "move_mount": "(-100, b'/', -100, b'/tmp', 0)",
    "mount_setattr": "(-100, b'/', 0, None, 0)",
    "mount": "(b'none', b'/', None, 0x40000, None)",
    "memfd_create": "(b'x', 0)",  # memory no limit of the sandbox bounds
    "shmget": "(0, 4096, 0o1600)",
    "seccomp": "(0, 0, None)",
    "prctl": "(15, b'renamed', 0, 0, 0)",  # PR_SET_NAME, as any prctl
    "pidfd_send_signal": "(0, 0, None, 0)",
    "clone3": "(None, 0)",
    "socketpair": "(1, 1, 0, None)",
    "execveat": "(-100, b'/bin/true', None, None, 0)",
}


def test_calls_outside_the_allow_list_fail_with_eperm(sandbox, bystander):
    numbers = syscall_numbers(list(RESTRICTED_CALLS))
    calls = "\n".join(
        f"    ({name!r}, {number}, {arguments.replace('BYSTANDER', str(bystander.pid))}),"
        for name, arguments in RESTRICTED_CALLS.items()
        if (number := numbers.get(name)) is not None
    )
    result = run(
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"for name, number, args in [\n{calls}\n]:\n"
        "    ctypes.set_errno(0)\n"
        "    answer = libc.syscall(number, *args)\n"
        "    print(name, answer, ctypes.get_errno(), flush=True)\n"
    )
    assert result.exit_code == 0, result.stderr
    outcomes = dict(
        (name, (int(answer), int(code))) for name, answer, code in map(str.split, result.stdout.splitlines())
    )
    assert outcomes == {name: (-1, errno.EPERM) for name in numbers}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 calling convention exists on x86_64 only")
def test_a_call_through_another_calling_convention_kills_the_process(sandbox):
    result = run("import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 39)\nprint('x32 getpid ran')\n")  # x32 getpid
    assert result.exit_code == -signal.SIGSYS and "ran" not in result.stdout


# ---------------------------------------------------------------------------------------------------
# Disk: the directory holds max_disk_bytes in all
# ---------------------------------------------------------------------------------------------------


def test_many_files_stop_at_the_directory_size_cap(sandbox, tmp_path):
    capped = SandboxConfig(max_wall_time_s=10.0, max_file_bytes=4 * 2**20, max_disk_bytes=8 * 2**20)
    result = run(
        "import errno, os\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'file{i}', 'wb') as f:\n"
        "            f.write(b'x' * 3 * 2**20)\n"
        "        written += 3 * 2**20\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno], written)\n",
        capped,
    )
    name, written = result.stdout.split()
    assert name == "ENOSPC" and int(written) <= capped.max_disk_bytes, result.stderr


def test_a_python_installation_that_would_expose_homes_or_the_run_directory_is_refused(sandbox, monkeypatch, tmp_path):
    for prefix in ["/", os.path.expanduser("~"), str(tmp_path)]:
        monkeypatch.chdir(tmp_path / "runs" if prefix == str(tmp_path) else tmp_path)
        (tmp_path / "runs").mkdir(exist_ok=True)
        monkeypatch.setattr(sys, "prefix", prefix)
        with pytest.raises(
            SandboxUnavailable, match=r"Python installation .* holds .*virtual environment created elsewhere"
        ):
            run("print('ran')")
    monkeypatch.undo()
    assert run("print('ran')").stdout == "ran\n"


# ---------------------------------------------------------------------------------------------------
# What it must still run
# ---------------------------------------------------------------------------------------------------


def test_the_standard_library_runs_in_the_sandbox(sandbox):
    result = run(
        "import collections, datetime, decimal, fractions, hashlib, itertools, json, math, pathlib, random\n"
        "import re, resource, select, shutil, sqlite3, statistics, tempfile, time, zlib, gzip, lzma, mmap\n"
        "print(json.dumps({'a': [1]}), re.sub(r'\\d', 'x', 'a1'), math.factorial(10), decimal.Decimal(1) / 4)\n"
        "print(statistics.mean([1, 2, 3]), fractions.Fraction(1, 3) * 3, hashlib.sha256(b'x').hexdigest()[:4])\n"
        "time.sleep(0.01); pathlib.Path('a.txt').write_text('hi'); shutil.copy('a.txt', 'b.txt')\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    pathlib.Path(d, 'f').write_bytes(gzip.compress(b'x' * 100))\n"
        "db = sqlite3.connect(':memory:'); db.execute('create table t(x)'); db.execute('insert into t values (7)')\n"
        "print(db.execute('select x from t').fetchall(), sorted(os.listdir('.')) if (os := __import__('os')) else 0)\n"
        "r, w = os.pipe(); os.write(w, b'x'); os.set_blocking(r, False); os.set_inheritable(r, True)\n"
        "print(select.select([r], [], [], 0)[0] == [r], len(mmap.mmap(-1, 4096)), os.cpu_count() > 0)\n"
        "import signal; signal.signal(signal.SIGUSR1, lambda *_: print('own signal')); os.kill(os.getpid(), signal.SIGUSR1)\n"
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        '{"a": [1]} ax 3628800 0.25',
        "2 1 2d71",
        "[(7,)] ['a.txt', 'b.txt', 'main.py']",
        "True 4096 True",
        "own signal",
    ]
