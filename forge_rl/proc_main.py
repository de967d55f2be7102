"""The entry point of every process forge_rl spawns on a Monarch host: Monarch's own bootstrap
(`monarch._src.actor.bootstrap_main`), ended by `forge_rl.process_exit.exit_now` instead of the
interpreter's finalization, which spent 2-3 s collecting garbage at the end of every run
(forge_rl/process_exit.py). Spawn with `spawn_procs`."""

from __future__ import annotations

import multiprocessing
import platform
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
    from monarch.actor import HostMesh, ProcMesh


def spawn_procs(host: "HostMesh", name: str, num_procs: int = 1, env: Mapping[str, str | None] | None = None) -> "ProcMesh":
    """`num_procs` processes on each host of `host`, as mesh `name`, each running this module with
    `env` on top of its host's environment (`bootstrap_command`): how forge_rl starts every process."""
    return host.spawn_procs(per_host={"procs": num_procs}, name=name, bootstrap_command=bootstrap_command(env))


def bootstrap_command(env: Mapping[str, str | None] | None = None) -> "BootstrapCommand":
    """Monarch's default command for a process (this Python, the host's environment) running
    this module, with `env` on top; for `HostMesh.spawn_procs(bootstrap_command=...)`. On another
    host too, this process's Python path: workers run the same environment at the same path
    (docs/multi_host.md)."""
    from monarch.actor import default_bootstrap_cmd

    command = default_bootstrap_cmd()
    command.args = ["-m", "forge_rl.proc_main"]
    return command.with_env(dict(env or {}))


def main() -> None:
    from monarch._src.actor.bootstrap_main import invoke_main

    from forge_rl import monarch_mends
    from forge_rl.process_exit import exit_now

    monarch_mends.install()
    # As Monarch's bootstrap does when run as a script: its processes start multiprocessing's
    # children from a forkserver, never by forking a process that runs Monarch's threads.
    if platform.system() == "Linux":
        multiprocessing.set_start_method("forkserver", force=True)
    else:
        multiprocessing.set_start_method("spawn", force=True)
    code = 0
    try:
        invoke_main()  # returns by sys.exit(the proc's exit code) once Monarch stopped the proc
    except SystemExit as stop:
        code = stop.code
    _shut_monarch_client_down()
    exit_now(code)


def _shut_monarch_client_down() -> None:
    """Shut down the Monarch client this process may have started (one that spawns procs of its
    own), as Monarch's atexit handler would, with the same bounds, but without its traceback: on a
    loaded machine the handler's 1 s ran out during a run's stop and printed a TimeoutError
    (test_shutdown, two pytest workers beside a busy loop), though the process was ending anyway.
    Monarch's later calls, the handler's included, return at once once a shutdown has begun. A
    process without a client returns at once here too."""
    from monarch.actor import shutdown_context

    try:
        shutdown_context(host_timeout=0.3).get(timeout=1.0)
    except TimeoutError:
        pass  # the shutdown goes on natively until the process exits, as it would have


if __name__ == "__main__":
    main()
