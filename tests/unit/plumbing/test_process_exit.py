"""forge_rl.plumbing.process_exit.exit_now: the process ends with the code `sys.exit` would give, after what
finalization does that anyone relies on (non-daemon threads joined, then the atexit handlers, then
stdout flushed), and without the final garbage collection (no `__del__` of what is still alive)."""

import subprocess
import sys
import textwrap

import pytest

from forge_rl.plumbing.process_exit import exit_code_of

SCRIPT = textwrap.dedent(
    """
    import atexit, threading, time
    from forge_rl.plumbing.process_exit import exit_now

    class Collected:
        def __del__(self):
            print("collected at exit", flush=True)

    cycle = Collected()
    cycle.self = cycle  # freed only by a collection, which the interpreter's exit would run
    release = threading.Event()

    def worker():
        release.wait()
        time.sleep(0.2)  # not a race: the exit must wait for the thread however long it takes
        print("thread finished")

    threading.Thread(target=worker).start()  # not a daemon
    atexit.register(lambda: print("atexit ran"))
    print("buffered line")  # stdout is a pipe, so block-buffered: only the exit's flush writes it
    release.set()
    exit_now(CODE)
    print("after exit_now")
    """
)


def run_script(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("CODE", code)], capture_output=True, text=True, timeout=120
    )


def test_exit_now_joins_threads_runs_atexit_flushes_and_skips_the_final_collection():
    result = run_script("3")
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["buffered line", "thread finished", "atexit ran"], result.stdout
    assert result.stderr == ""


def test_exit_now_with_a_message_prints_it_and_exits_1():
    result = run_script("'no such model'")
    assert result.returncode == 1
    assert result.stderr == "no such model\n"


@pytest.mark.parametrize("code,status", [(None, 0), (0, 0), (7, 7), ("a message", 1)])
def test_exit_code_of_follows_sys_exit(code, status, capsys):
    assert exit_code_of(code) == status
    assert capsys.readouterr().err == ("a message\n" if isinstance(code, str) else "")


def test_forge_rl_spawns_its_processes_with_its_own_entry_point():
    from forge_rl.plumbing.proc_main import bootstrap_command

    command = bootstrap_command({"MALLOC_ARENA_MAX": "2"})
    assert (command.program, command.args) == (sys.executable, ["-m", "forge_rl.plumbing.proc_main"])
    assert command.env == {"MALLOC_ARENA_MAX": "2"}


SHUTDOWN_SCRIPT = textwrap.dedent(
    """
    import os, signal, monarch.actor
    from forge_rl.plumbing.process_exit import shut_monarch_client_down

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a controller started from a terminal

    class FakeShutdown:  # stands in for Monarch's: OUTCOME during the wait
        def get(self, timeout):
            if OUTCOME == "sigint":
                os.kill(os.getpid(), signal.SIGINT)  # its KeyboardInterrupt is raised here, inside the wait
            elif OUTCOME == "timeout":
                raise TimeoutError()

    monarch.actor.shutdown_context = lambda host_timeout: FakeShutdown()
    print(shut_monarch_client_down(host_timeout_s=0.3, timeout_s=1.0))
    print("still running")
    """
)


@pytest.mark.parametrize(
    "outcome, said",
    [
        ("done", "None"),
        ("timeout", "did not finish shutting down within 1 s"),
        ("sigint", "was interrupted (SIGINT) while shutting down"),
    ],
)
def test_monarchs_client_shutdown_says_why_it_stopped_waiting_and_a_sigint_ends_only_the_wait(outcome, said):
    script = SHUTDOWN_SCRIPT.replace("OUTCOME", repr(outcome))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.splitlines() == [said, "still running"]
