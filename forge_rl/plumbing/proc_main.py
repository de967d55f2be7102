"""The entry point of every process forge_rl spawns on a Monarch host: torchmonarch's races mended
(`forge_rl.plumbing.monarch_mends`), then Monarch's own bootstrap (`monarch._src.actor.bootstrap_main`),
ended by `forge_rl.plumbing.process_exit.exit_now` instead of the interpreter's finalization, which spends
seconds collecting garbage at the end of every run (`forge_rl.plumbing.process_exit`). Spawn with
`spawn_procs`."""

from __future__ import annotations

import multiprocessing
import platform
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
    from monarch.actor import HostMesh, ProcMesh


def spawn_procs(host: HostMesh, name: str, num_procs: int = 1, env: Mapping[str, str | None] | None = None) -> ProcMesh:
    """`num_procs` processes on each host of `host`, as mesh `name`, each running this module with
    `env` on top of its host's environment (`bootstrap_command`): how forge_rl starts every process."""
    return host.spawn_procs(per_host={"procs": num_procs}, name=name, bootstrap_command=bootstrap_command(env))


async def set_torch_distributed_env(procs: ProcMesh) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and the rest of torchrun's variables
    in every process of `procs`, ready for init_process_group: Monarch's
    `setup_torch_elastic_env_async`, whose helper actors (`SPMDActor`) are then stopped instead
    of living as long as the processes. Monarch polls every live actor mesh from its owner's
    process (every 10 s, HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY), and each poll leaves a few
    KB there for the life of the process: a mesh that has done its work costs the controller
    memory for the rest of the run (docs/benchmarks/README.md, "soak")."""
    from monarch.spmd import SPMDActor

    helpers = procs.spawn("_SPMDActor", SPMDActor)
    try:
        first = dict.fromkeys(procs._labels, 0)  # as Monarch's own helper picks the master
        master_addr, master_port = await helpers.slice(**first).get_host_port.call_one(None)
        await helpers.setup_env.call(master_addr, master_port)
    finally:
        await helpers.stop()


def bootstrap_command(env: Mapping[str, str | None] | None = None) -> BootstrapCommand:
    """Monarch's default command for a process (this Python, the host's environment) running
    this module, with `env` on top; for `HostMesh.spawn_procs(bootstrap_command=...)`. On another
    host too, this process's Python path: workers run the same environment at the same path
    (docs/multi_host.md)."""
    from monarch.actor import default_bootstrap_cmd

    command = default_bootstrap_cmd()
    command.args = ["-m", "forge_rl.plumbing.proc_main"]
    return command.with_env(dict(env or {}))


def main() -> None:
    from monarch._src.actor.bootstrap_main import invoke_main

    from forge_rl.plumbing import monarch_mends
    from forge_rl.plumbing.process_exit import exit_now, shut_monarch_client_down

    monarch_mends.install()
    # As Monarch's bootstrap does when run as a script: its processes start multiprocessing's
    # children from a forkserver, never by forking a process that runs Monarch's threads.
    if platform.system() == "Linux":
        multiprocessing.set_start_method("forkserver", force=True)
    else:
        multiprocessing.set_start_method("spawn", force=True)
    code: str | int | None = 0
    try:
        invoke_main()  # returns by sys.exit(the proc's exit code) once Monarch stopped the proc
    except SystemExit as stop:
        code = stop.code
    shut_monarch_client_down(host_timeout_s=0.3, timeout_s=1.0)  # a process that spawned none returns at once
    exit_now(code)


if __name__ == "__main__":
    main()
