"""Host and proc meshes by role: the one place that turns a `LaunchConfig` into Monarch meshes.
The only module besides actors/ that imports Monarch.

    hosts = await start_hosts(config, model_dir)     # attach to the workers and check them
    services = hosts.spawn_services()                # scorer supervisor, store index, pool
    rollouts = hosts.spawn_rollouts().spawn(...)     # rollout loops, gate, buffer, prompts
    trainer = await hosts.spawn_ranks("trainer", config.trainer.num_procs)
    pool = services.spawn(..., hosts.generator_placements())   # hosts + GPU blocks
    ...
    await hosts.stop()                               # every proc mesh spawned here, then the hosts

With `launch.hosts: local` every mesh is spawned on this machine (`this_host()`). Otherwise this
process (the controller) attaches to one Monarch worker per host (`attach_to_workers`) after
checking that each worker's port answers, and probes every host (GPUs, cores, RDMA backend, the
run directory) before placing anything there: the checks are in `forge_rl.plumbing.placement`. The
controller itself runs no actor of the run; every role lives on a worker host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import monarch.actor
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import HostMesh, ProcMesh, attach_to_workers, enable_transport, this_host

from forge_rl.core.deadlines import within
from forge_rl.errors import ConfigError, raised_by_actor
from forge_rl.observability.metrics import progress
from forge_rl.plumbing import monarch_mends
from forge_rl.plumbing.placement import (
    HostFacts,
    LaunchConfig,
    RoleDemand,
    check_host_facts,
    check_host_indices,
    demand_of,
    generator_devices,
    reference_hosts,
)
from forge_rl.plumbing.preemption import arm_preemption_notice
from forge_rl.plumbing.proc_main import set_torch_distributed_env, spawn_procs
from forge_rl.plumbing.workers import (
    check_hostname_routable,
    check_reachable,
    hostnames_resolve_apart,
    is_loopback,
    parse_worker_address,
    worker_addresses,
)

if TYPE_CHECKING:
    from forge_rl.actors.generator_pool import GeneratorPlacement

# Within the 4 s the recipe's shutdown gives all meshes: procs first, the rest to release the hosts.
_STOP_TIMEOUT_S = 3.0

SPAWN_MAX_IDLE = "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE"
"""Monarch's bound on a process spawn that shows no progress (`spawn_timed_out`)."""

MONARCH_DEFAULTS = {
    # Monarch gives up on a process spawn that shows no progress for 30 s. 128 generator processes
    # starting at once on a small, busy CPU host can take longer (`forge-rl bench scale`, control
    # plane and faults at G = 128); a spawn that truly hangs still fails, after 3 minutes.
    SPAWN_MAX_IDLE: "180s"
}
"""Monarch settings of forge_rl's, set as environment defaults (`set_monarch_defaults`)."""


_SPAWN_TIMED_OUT = re.compile(r"error spawning proc mesh: statuses: Timeout\(([0-9.]+)s\)")
"""How torchmonarch 0.7 reports a process that showed no progress in starting (its ValueError)."""


def spawn_timed_out(error: BaseException) -> float | None:
    """The seconds Monarch waited if `error` (a spawn's, or an endpoint's whose actor spawned,
    wrapped in ActorError) says a process of a mesh showed no progress in starting for
    SPAWN_MAX_IDLE; else None."""
    for text in (str(error), str(raised_by_actor(error))):
        if match := _SPAWN_TIMED_OUT.search(text):
            return float(match[1])
    return None


def set_monarch_defaults() -> None:
    """MONARCH_DEFAULTS into this process's environment, where not set already (a user's setting
    wins): every process spawned from here on inherits them, so the services process, which
    spawns the generators, runs with them."""
    for name, value in MONARCH_DEFAULTS.items():
        os.environ.setdefault(name, value)


class Hosts:
    """The run's hosts: spawns each role's processes where the placement puts them."""

    def __init__(
        self,
        launch: LaunchConfig,
        demand: RoleDemand,
        host_mesh: HostMesh | None = None,
        facts: Sequence[HostFacts] = (),
    ):
        self.launch = launch
        self.demand = demand
        """Processes per role, which fix each generator's GPUs (`generator_placements`)."""
        self.host_mesh = host_mesh
        """Every worker host, in launch order; None with hosts=local."""
        self.facts = list(facts)
        self.proc_meshes: list[ProcMesh] = []

    def host(self, index: int) -> HostMesh:
        """Host `index` as a one-host mesh (this machine with hosts=local)."""
        return this_host() if self.host_mesh is None else self.host_mesh.slice(hosts=index)

    def owned_host(self, index: int) -> HostMesh | None:
        """Host `index` for an actor that spawns (and respawns) meshes itself (the generator pool,
        the scorer's supervisor); None with hosts=local, where it spawns on its own host."""
        return None if self.host_mesh is None else self.host(index)

    def owned_ranks(self, num_procs: int) -> tuple[HostMesh | None, int]:
        """Where a frozen model's supervisor (`forge_rl.actors.frozen_model_supervisor`) spawns (and
        respawns) its `num_procs` ranks: the reference hosts, split evenly as `spawn_ranks` does,
        and the ranks per host. The host is None with hosts=local (it spawns on its own host)."""
        hosts = reference_hosts(self.launch.placement)
        if self.host_mesh is None:
            return None, num_procs
        if len(hosts) == 1:
            return self.host(hosts[0]), num_procs
        return self.host_mesh.slice(hosts=slice(hosts[0], hosts[-1] + 1)), num_procs // len(hosts)

    def spawn_procs(self, name: str, num_procs: int, host: int) -> ProcMesh:
        procs = spawn_procs(self.host(host), name, num_procs)
        self.proc_meshes.append(procs)
        return procs

    def spawn_services(self) -> ProcMesh:
        return self.spawn_procs("services", 1, self.launch.placement.services_host)

    def spawn_rollouts(self) -> ProcMesh:
        """The rollouts' process (`forge_rl.pipeline.rollouts`), on the services' host: its own, so that its
        calls (per prompt, per generator) share an event loop with nothing else."""
        return self.spawn_procs("rollouts", 1, self.launch.placement.services_host)

    async def spawn_ranks(self, role: str, num_procs: int, name: str | None = None) -> ProcMesh:
        """Ranks of one torch.distributed world (role "trainer" or "reference") on the role's hosts,
        split evenly, with RANK/WORLD_SIZE/MASTER_* set, ready for init_process_group; `name`: the
        mesh's (default: the role; another policy's trainer has its own)."""
        placement = self.launch.placement
        hosts = placement.trainer_hosts if role == "trainer" else reference_hosts(placement)
        name = name or role
        if self.host_mesh is None or len(hosts) == 1:
            procs = self.spawn_procs(name, num_procs, hosts[0])
        else:
            host_slice = self.host_mesh.slice(hosts=slice(hosts[0], hosts[-1] + 1))
            procs = spawn_procs(host_slice, name, num_procs // len(hosts))
            self.proc_meshes.append(procs)
        await set_torch_distributed_env(procs)
        return procs

    def store_volume_procs(self, services: ProcMesh) -> ProcMesh:
        """Where the weight store's volume runs: on the trainer's (first) host, because it serves
        the snapshot files rank 0 writes there to readers on other hosts. The services process
        when it shares that host (always with hosts=local), else a process of its own."""
        placement = self.launch.placement
        if self.host_mesh is None or placement.services_host == placement.trainer_hosts[0]:
            return services
        return self.spawn_procs("store_volume", 1, placement.trainer_hosts[0])

    def generator_placements(self) -> list[GeneratorPlacement]:
        """The host, GPU block and cores of each of the run's generators, for the GeneratorPool (which
        spawns and respawns them there). The host is None with hosts=local, where the pool spawns
        on its own."""
        from forge_rl.actors.generator_pool import GeneratorPlacement

        placement = self.launch.placement
        return [
            GeneratorPlacement(
                self.owned_host(placement.generator_host(i)),
                devices,
                placement.generator_cpus,
                worker=None if self.host_mesh is None else self.facts[placement.generator_host(i)].address,
            )
            for i, devices in enumerate(generator_devices(self.launch, self.demand))
        ]

    def eval_generator_placements(self, num_generators: int) -> list[GeneratorPlacement]:
        """Where the evaluation's own generators run (eval.num_generators): the services host, on
        the GPU block of the run's first generator (which they share there), on any of its cores."""
        from forge_rl.actors.generator_pool import GeneratorPlacement

        devices = generator_devices(self.launch, self.demand)[0]
        host = self.owned_host(self.launch.placement.services_host)
        return [GeneratorPlacement(host, devices) for _ in range(num_generators)]

    def policy_generator_placements(self, num_generators: int) -> list[GeneratorPlacement]:
        """Where the generators of one of the run's other policies run (`policies`, on this
        machine only): the services host, on the GPU block and cores of the run's first generator."""
        from forge_rl.actors.generator_pool import GeneratorPlacement

        first = self.generator_placements()[0]
        return [GeneratorPlacement(first.host, first.cuda_devices, first.cpus) for _ in range(num_generators)]

    async def stop(self) -> None:
        """Every proc mesh spawned here (bounded), then release the workers (they keep running,
        ready for the next run)."""
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await within(
                _STOP_TIMEOUT_S, asyncio.gather(*(procs.stop() for procs in self.proc_meshes), return_exceptions=True)
            )
        if self.host_mesh is not None:
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                await within(_STOP_TIMEOUT_S, self.host_mesh.stop())


async def start_hosts(config, model_dir) -> Hosts:
    """Attach to the run's hosts and check them against the placement; nothing of the run is
    spawned yet. Raises ConfigError (naming the host and the fix) if the placement cannot run."""
    launch: LaunchConfig = config.launch
    set_monarch_defaults()
    monarch_mends.install()
    if launch.is_local:
        return Hosts(launch, demand_of(config))
    addresses, source = worker_addresses(launch)  # preflight checked them; they may have gone since
    check_host_indices(launch.placement, len(addresses), source)
    check_reachable(addresses, launch.connect_timeout_s)
    # The workers dial back to this process and to each other: TCP, not Monarch's default Unix
    # sockets. Must precede any other Monarch call of this process.
    enable_transport(_transport_for(addresses))
    host_mesh = attach_to_workers(ca="trust_all_connections", workers=addresses, name="forge_rl_hosts")
    try:
        await within(launch.connect_timeout_s * 4, _initialized(host_mesh))
    except asyncio.TimeoutError:
        raise ConfigError(
            f"the workers at {', '.join(addresses)} accept connections but did not attach as Monarch hosts "
            f"within {launch.connect_timeout_s * 4:g} s. Check that each runs `forge-rl worker` with the same "
            "torchmonarch version as here, and that this machine's hostname resolves from the workers "
            "(they connect back to it)."
        ) from None
    hosts = Hosts(launch, demand_of(config), host_mesh)
    try:
        hosts.facts = await _probe(host_mesh, addresses, str(model_dir))
        hostnames_resolve_apart(hosts.facts)
        for note in check_host_facts(launch, demand_of(config), hosts.facts, str(model_dir)):
            progress(note)
    except BaseException:
        await hosts.stop()
        raise
    progress(
        "hosts: "
        + ", ".join(
            f"{i}={fact.hostname} ({fact.num_gpus} GPU, {fact.num_cpus} CPU)" for i, fact in enumerate(hosts.facts)
        )
    )
    return hosts


def _transport_for(addresses: list[str]):
    """TCP on this machine's hostname, or on localhost when every worker is on this machine
    (Monarch's hostname transport refuses a hostname that resolves only to loopback)."""
    from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport

    if all(is_loopback(parse_worker_address(address)[0]) for address in addresses):
        return ChannelTransport.TcpWithLocalhost
    check_hostname_routable()
    return ChannelTransport.TcpWithHostname


async def _initialized(host_mesh: HostMesh) -> None:
    await host_mesh.initialized


async def _probe(host_mesh: HostMesh, addresses: list[str], model_dir: str) -> list[HostFacts]:
    from forge_rl.actors.host_probe import HostProbe

    procs = spawn_procs(host_mesh, "host_probe")
    try:
        reports = await procs.spawn("host_probe", HostProbe).facts.call(model_dir)
        by_host = [report for _, report in reports.items()]  # rank order = host order (one proc per host)
    finally:
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await within(_STOP_TIMEOUT_S, procs.stop())
    return [HostFacts(address=addresses[i], **by_host[i]) for i in range(len(addresses))]


def run_worker(port: int, host: str | None = None, preemption_grace_s: float = 30.0) -> None:
    """This host's Monarch worker (`forge-rl worker`): serves tcp://HOST:PORT until killed; a run's
    controller attaches to it, spawns processes here, and releases it when the run ends. Its
    SIGTERM is a preemption notice: it ends `preemption_grace_s` later (`forge_rl.plumbing.preemption`)."""
    import socket

    from monarch.actor import run_worker_loop_forever

    address = f"tcp://{host or socket.gethostname()}:{port}"
    set_monarch_defaults()  # its processes are spawned from here
    arm_preemption_notice(preemption_grace_s, port)
    print(f"[forge-rl worker] serving {address}", file=sys.stderr, flush=True)
    run_worker_loop_forever(address=address, ca="trust_all_connections")


@contextlib.contextmanager
def on_process_failure(callback: Callable[[str], None]) -> Iterator[None]:
    """While inside, a failed process of a mesh this process owns (the services or the trainer;
    generator meshes are supervised by their pool) calls `callback(description)` instead of
    Monarch's default fault hook, which exits this process as if Ctrl-C had been pressed. The
    callback may run on another thread."""

    def hook(failure) -> None:
        callback(str(failure).strip().splitlines()[0][:500])

    previous = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = hook
    try:
        yield
    finally:
        monarch.actor.unhandled_fault_hook = previous


def is_process_failure(error: BaseException) -> bool:
    """Whether `error`, raised by an endpoint call, says the actor's process died."""
    return isinstance(error, SupervisionError)
