"""End a process without the interpreter's final garbage collection.

A process that imported torch, TorchTitan or vLLM holds millions of objects, and CPython's
finalization collects them all before it exits: seconds of CPU for the trainer's, the services'
and the controller's processes (py-spy: `gc_collect_main`), paid at the end of every run, after
everything of the run is already saved and stopped. The trainer's can even outlast the
controller's stop timeout (`forge_rl.run.launch`), which cuts its stop rather than finishing it.
Freezing the objects at exit (`gc.freeze`) skips the collection too, but leaves native objects
alive through module teardown, where nanobind reports triton's as leaked
(`forge_rl.plumbing.gc_freeze`).

`exit_now` does what finalization does that anyone relies on, in the order the interpreter does
it, and then leaves with `os._exit`: wait for the non-daemon threads, run the atexit handlers
(Monarch's client shutdown, multiprocessing's joining of its children, logging's flush,
`weakref.finalize` callbacks), flush stdout and stderr. What it skips is `__del__` of objects
still alive and the teardown of modules; nothing of forge_rl's depends on those (files it writes
are closed where they are written, processes it starts are stopped explicitly).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_code_of(code: object) -> int:
    """The status the interpreter would exit with for `sys.exit(code)`: None is 0, an int is
    itself, anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(code: object = 0) -> None:
    """Leave the process with `code` (as `sys.exit` takes it) as finalization would, without its
    garbage collection (module docstring). Call it from the main thread, after the process's work."""
    status = exit_code_of(code)
    # What finalization does first: join the non-daemon threads (private, so not in typeshed).
    threading._shutdown()  # type: ignore[attr-defined]  # private, so not in typeshed
    atexit._run_exitfuncs()  # then the atexit handlers, last registered first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(status)


def shut_monarch_client_down(host_timeout_s: float, timeout_s: float) -> str | None:
    """Shut down the Monarch client this process may have started (one that spawns procs), now and
    within `timeout_s`, as Monarch's atexit handler would, which allows 1 s: on a loaded machine
    that runs out during a run's stop and prints a TimeoutError traceback though the run stopped
    cleanly. Returns None once it finished, else why it stopped waiting: the shutdown goes on
    natively until the process exits, as it would have. Monarch's later calls, the handler's
    included, return at once once a shutdown has begun; a process without a client returns at
    once here too.

    A SIGINT during the wait ends the wait, not the exit: one can arrive after a clean stop on a
    SIGTERM sent to the controller alone (test_shutdown on a loaded machine; Monarch's teardown
    signals process groups with killpg, and a run started in a session of its own is its
    processes' group), and its KeyboardInterrupt would print a traceback. Ignoring SIGINT instead
    would keep the wait going to its bound, and the run past its 10 s to stop."""
    from monarch.actor import shutdown_context

    try:
        shutdown_context(host_timeout=host_timeout_s).get(timeout=timeout_s)
        return None
    except TimeoutError:
        return f"did not finish shutting down within {timeout_s:g} s"
    except KeyboardInterrupt:
        return "was interrupted (SIGINT) while shutting down"
