"""End a process without the interpreter's final garbage collection.

A process that imported torch, TorchTitan or vLLM holds millions of objects, and CPython's
finalization collects them all before it exits: 2.2-3.0 s of CPU on the demo's machine for the
trainer's, the services' and the controller's processes (py-spy: `gc_collect_main`), paid at the
end of every run, after everything of the run was already saved and stopped. The trainer's even
outlasted the controller's stop timeout (forge_rl/launch.py), so its stop was cut rather than
finished. Freezing the objects at exit (`gc.freeze`) skips the collection too, but leaves native
objects alive through module teardown, where nanobind reports triton's as leaked
(forge_rl/gc_freeze.py).

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
    threading._shutdown()  # what finalization does first: join the non-daemon threads
    atexit._run_exitfuncs()  # then the atexit handlers, last registered first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(status)
