"""Where a run's processes go: the hosts (this one, a list of Monarch workers, or a SLURM
allocation) and which host runs the services, the trainer ranks, the reference ranks and each
generator. Monarch-free: the config, its checks and the per-host resource check live here, the
workers' addresses in `forge_rl.plumbing.workers`, the pinning of a process to its cores in
`forge_rl.plumbing.cpu_affinity`; `forge_rl.run.launch` turns a `LaunchConfig` into host and proc
meshes.

    hosts: local    every process on this machine (the default; no workers to start)
    hosts: list     `workers` are the addresses of Monarch workers already listening on each host
                    (`forge-rl worker --port PORT` there); host index i is workers[i]
    hosts: slurm    inside an allocation: one worker per node of SLURM_JOB_NODELIST, listening on
                    `worker_port` (the sbatch script starts them with srun, configs/slurm_grpo.sbatch)

Placement names hosts by index. Checks that need only the config run when it is built
(`LaunchConfig.__post_init__`, `check_placement`); the ones that need the hosts (reachable, GPUs,
cores, RDMA, the run directory visible everywhere) run in `launch.start_hosts` before any
expensive process starts (`check_host_facts`). Every failure names the problem and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict

from forge_rl.errors import ConfigError
from forge_rl.plumbing.workers import DEFAULT_WORKER_PORT, parse_worker_address

MAX_COMPUTE_THREADS_PER_CORE = 4
"""Past this oversubscription every process crawls and collective and engine timeouts fire; below
it a run is slow but sound (the CPU tests run 3 compute threads on 2 cores). Preflight applies it to
this machine, `check_host_facts` to each host."""


@dataclass(frozen=True)
class PlacementConfig:
    """Host indices (into the launch's host list) of each role."""

    services_host: int = 0
    """Host of the services process: dataset, scorer, replay buffer, weight-store index, generator pool."""
    scorer_host: int | None = None
    """Host of the scorer's processes (the scorer actor and its reward workers, a reward model's
    replicas, an LLM judge's engine), where its supervisor also restarts them; unset: services_host.
    Puts model-based scoring on a host of its own, apart from the generators and the trainer."""
    trainer_hosts: tuple[int, ...] = (0,)
    """Consecutive hosts of the trainer ranks; trainer.num_procs is split evenly among them."""
    reference_hosts: tuple[int, ...] | None = None
    """Consecutive hosts of the reference ranks (kl_beta > 0); unset: trainer_hosts."""
    generator_hosts: tuple[int, ...] = (0,)
    """Host of each generator (one entry per generator; a shorter list repeats cyclically)."""
    generator_cpus: tuple[int, ...] | None = None
    """CPU cores (ids as in /proc/cpuinfo) every generator process runs on, its engine's processes
    included (os.sched_setaffinity, inherited by the processes it starts); unset: any core. Pins
    the roles apart on a CPU machine, e.g. the engine on core 0 and the trainer on core 1."""
    trainer_cpus: tuple[int, ...] | None = None
    """CPU cores every trainer rank runs on (shared by the ranks of one host); unset: any core."""

    def __post_init__(self) -> None:
        for name in ("trainer_hosts", "reference_hosts", "generator_hosts", "generator_cpus", "trainer_cpus"):
            value = getattr(self, name)
            if value is not None:  # YAML lists arrive as lists; keep the frozen config hashable
                object.__setattr__(self, name, tuple(value))
        for name in ("trainer_hosts", "generator_hosts"):
            if not getattr(self, name):
                raise ConfigError(
                    f"launch.placement.{name} is empty. List at least one host index "
                    f"(--launch.placement.{name.replace('_', '-')} 0)."
                )
        for name in ("generator_cpus", "trainer_cpus"):
            cores = getattr(self, name)
            flag = f"--launch.placement.{name.replace('_', '-')}"
            if cores is not None and (not cores or any(core < 0 for core in cores) or len(set(cores)) < len(cores)):
                raise ConfigError(
                    f"launch.placement.{name} ({_show(cores)}) must list distinct core ids >= 0, "
                    f"e.g. {flag} 0; leave it unset to run on any core."
                )
        for name, hosts in self._indices().items():
            if any(index < 0 for index in hosts):
                raise ConfigError(
                    f"launch.placement.{name} ({_show(hosts)}) has a negative host index. "
                    f"Host indices count from 0 in launch.workers order."
                )
        for name in ("trainer_hosts", "reference_hosts"):
            hosts = getattr(self, name)
            if hosts is not None and list(hosts) != list(range(hosts[0], hosts[0] + len(hosts))):
                raise ConfigError(
                    f"launch.placement.{name} ({_show(hosts)}) must be consecutive, increasing host indices "
                    "(one torch.distributed world is one slice of the host mesh). Reorder launch.workers so "
                    f"those hosts are adjacent, e.g. --launch.placement.{name.replace('_', '-')} "
                    f"{' '.join(str(hosts[0] + i) for i in range(len(hosts)))}."
                )

    @property
    def scorer_host_index(self) -> int:
        """The host the scorer's processes run on (`scorer_host`, else `services_host`)."""
        return self.services_host if self.scorer_host is None else self.scorer_host

    def _indices(self) -> dict[str, tuple[int, ...]]:
        return {
            "services_host": (self.services_host,),
            "scorer_host": () if self.scorer_host is None else (self.scorer_host,),
            "trainer_hosts": self.trainer_hosts,
            "reference_hosts": self.reference_hosts or (),
            "generator_hosts": self.generator_hosts,
        }

    def generator_host(self, generator_index: int) -> int:
        return self.generator_hosts[generator_index % len(self.generator_hosts)]


@dataclass(frozen=True)
class LaunchConfig:
    """Which hosts the run uses and where each role runs (docs/multi_host.md)."""

    hosts: Literal["local", "list", "slurm"] = "local"
    """local: this machine only. list: the Monarch workers in `workers`. slurm: one worker per node
    of this SLURM allocation (SLURM_JOB_NODELIST), each on `worker_port`."""
    workers: tuple[str, ...] = ()
    """hosts=list: address of each host's worker, tcp://HOST:PORT (start it there with
    `forge-rl worker --port PORT`); host index i is workers[i]."""
    worker_port: int = DEFAULT_WORKER_PORT
    """hosts=slurm: the port every node's worker listens on (`forge-rl worker --port` in the sbatch script)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    allow_shared_hosts: bool = False
    """With several hosts, a host that runs trainer (or reference) ranks may also run generators
    only when this is true (they would compete for its GPUs, cores and memory bandwidth)."""
    share_gpus: bool = False
    """On a GPU host with trainer (or reference) ranks, generators use the ranks' GPUs (their
    device blocks start at device 0) instead of GPUs of their own after them: the whole loop on
    one GPU. vLLM then takes generator.gpu_memory_utilization of each such GPU and the rank the
    rest (`generator_devices`)."""
    connect_timeout_s: float = 5.0
    """Seconds to wait for each worker's TCP port before the run is refused, and for all
    workers to attach."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(self.workers))
        if self.hosts == "list":
            if not self.workers:
                raise ConfigError(
                    "launch.hosts is 'list' but launch.workers is empty. List each host's worker address "
                    "(--launch.workers tcp://HOST1:26600 tcp://HOST2:26600), started there with "
                    "`forge-rl worker --port 26600`."
                )
            for address in self.workers:
                parse_worker_address(address)
            duplicates = sorted({a for a in self.workers if self.workers.count(a) > 1})
            if duplicates:
                raise ConfigError(
                    f"launch.workers lists {', '.join(duplicates)} more than once; each worker is "
                    "one host. Remove the duplicate."
                )
        elif self.workers:
            raise ConfigError(
                f"launch.workers is set but launch.hosts is {self.hosts!r}; workers are only read with "
                "hosts=list. Set --launch.hosts list, or drop launch.workers."
            )
        if not 1 <= self.worker_port <= 65535:
            raise ConfigError(
                f"launch.worker_port ({self.worker_port}) must be a TCP port in 1..65535. Set --launch.worker-port."
            )
        if not self.connect_timeout_s > 0:
            raise ConfigError(
                f"launch.connect_timeout_s ({self.connect_timeout_s}) must be > 0. Set --launch.connect-timeout-s."
            )
        if self.hosts == "local":
            remote = {name: hosts for name, hosts in self.placement._indices().items() if any(hosts)}
            if remote:
                name, hosts = next(iter(remote.items()))
                raise ConfigError(
                    f"launch.placement.{name} ({_show(hosts)}) names a host other than 0, but launch.hosts is "
                    "'local' (one host, index 0). Set --launch.hosts list with --launch.workers, or place "
                    "every role on host 0."
                )
        if self.hosts == "list":
            check_host_indices(self.placement, len(self.workers), "launch.workers")

    @property
    def is_local(self) -> bool:
        return self.hosts == "local"


def check_host_indices(placement: PlacementConfig, num_hosts: int, source: str) -> None:
    """Every placement index names one of `num_hosts` hosts."""
    for name, hosts in placement._indices().items():
        outside = [index for index in hosts if index >= num_hosts]
        if outside:
            raise ConfigError(
                f"launch.placement.{name} ({_show(hosts)}) names host {outside[0]}, but {source} has "
                f"{num_hosts} host(s) (indices 0..{num_hosts - 1}). Fix --launch.placement."
                f"{name.replace('_', '-')}, or add hosts."
            )


@dataclass(frozen=True)
class RoleDemand:
    """What the config asks of the hosts: processes per role (from GRPOConfig)."""

    trainer_procs: int
    reference_procs: int
    """0 when there is no reference model."""
    num_generators: int
    trainer_threads: int = 1
    reference_threads: int = 1
    generator_threads: int = 1
    generator_gpus: int = 1
    """CUDA devices per generator on a GPU host: generator.tensor_parallel_size."""
    scorer_model_threads: int = 0
    """Compute threads of the scorer's models (reward-model replicas, the judge's engine) on the
    scorer's host (`PlacementConfig.scorer_host_index`): `ScorerConfig.model_threads`."""


def check_placement(launch: LaunchConfig, demand: RoleDemand) -> None:
    """Rules between the placement and the roles' sizes that need no host: ranks divide evenly
    among their hosts, and trainer and generators do not share a host unless allowed."""
    placement = launch.placement
    roles = [("trainer", "trainer_hosts", demand.trainer_procs, placement.trainer_hosts)]
    if demand.reference_procs:
        roles.append(("reference", "reference_hosts", demand.reference_procs, reference_hosts(placement)))
    for role, name, num_procs, hosts in roles:
        if num_procs % len(hosts):
            raise ConfigError(
                f"{role}.num_procs ({num_procs}) is not divisible by the {len(hosts)} host(s) of "
                f"launch.placement.{name} ({_show(hosts)}); each host runs the same number of ranks. Set "
                f"--{role}.num-procs to a multiple of {len(hosts)}, or change --launch.placement.{name.replace('_', '-')}."
            )
    ranked = set(placement.trainer_hosts) | (set(reference_hosts(placement)) if demand.reference_procs else set())
    generator_hosts = {placement.generator_host(i) for i in range(demand.num_generators)}
    shared = sorted(ranked & generator_hosts)
    one_host = len(ranked | generator_hosts) == 1  # sharing is the only option (preflight's checks apply)
    if shared and not (launch.is_local or launch.allow_shared_hosts or one_host):
        raise ConfigError(
            f"host {shared[0]} runs trainer/reference ranks and generators (launch.placement.trainer_hosts "
            f"{_show(placement.trainer_hosts)}, generator_hosts {_show(placement.generator_hosts)}); they would "
            "compete for its GPUs and cores. Place the generators on other hosts, or set "
            "--launch.allow-shared-hosts true."
        )


def reference_hosts(placement: PlacementConfig) -> tuple[int, ...]:
    return placement.reference_hosts or placement.trainer_hosts


def ranked_devices(placement: PlacementConfig, demand: RoleDemand, host: int) -> int:
    """CUDA devices the trainer and reference ranks on `host` use: each rank takes device
    LOCAL_RANK (`forge_rl.training.trainer._select_device`), and both worlds number their local ranks
    from 0, so reference ranks on a trainer host run on the trainer ranks' devices."""
    per_world = [0]
    for num_procs, hosts in (
        (demand.trainer_procs, placement.trainer_hosts),
        (demand.reference_procs, reference_hosts(placement)),
    ):
        if num_procs and host in hosts:
            per_world.append(num_procs // len(hosts))
    return max(per_world)


def generator_devices(launch: LaunchConfig, demand: RoleDemand) -> list[tuple[int, ...]]:
    """The CUDA device indices each generator uses on its host (as the host numbers its visible
    devices): a contiguous block of `demand.generator_gpus`, the k-th block for the host's k-th
    generator (in generator index order), after the devices of the host's ranks
    (`ranked_devices`), or from device 0 with `launch.share_gpus`. Pure: whether the host has
    that many GPUs is `check_gpus`'s question; on a CPU host the indices are unused.

        trainer_procs 2 on host 0, generators 0..2 all on host 0, generator_gpus 2:
            [(2, 3), (4, 5), (6, 7)]
        generator_hosts (1, 2), 4 generators, generator_gpus 1 (no ranks there):
            [(0,), (0,), (1,), (1,)]        # generator 2 is host 1's second generator
    """
    placement, blocks = launch.placement, []
    num_placed: dict[int, int] = {}
    for index in range(demand.num_generators):
        host = placement.generator_host(index)
        slot = num_placed.get(host, 0)
        num_placed[host] = slot + 1
        first = (0 if launch.share_gpus else ranked_devices(placement, demand, host)) + slot * demand.generator_gpus
        blocks.append(tuple(range(first, first + demand.generator_gpus)))
    return blocks


def check_gpus(launch: LaunchConfig, demand: RoleDemand, host: int, num_gpus: int, where: str) -> None:
    """The devices the placement gives host `host`'s roles exist there (`num_gpus` visible), and
    a host without GPUs is asked for no tensor-parallel generator. `where` names the host."""
    placement = launch.placement
    generators = [i for i in range(demand.num_generators) if placement.generator_host(i) == host]
    if not num_gpus:
        if generators and demand.generator_gpus > 1:
            raise ConfigError(
                f"{where} has no GPU, but generator.tensor_parallel_size ({demand.generator_gpus}) > 1. On CPU "
                "forge_rl runs vLLM's CPU backend with one worker (one unpinned OpenMP thread group, "
                "VLLM_CPU_OMP_THREADS_BIND=nobind); its tensor parallelism would need a pinned thread group per "
                "rank, which forge_rl does not set up. Set --generator.tensor-parallel-size 1."
            )
        return
    ranked = ranked_devices(placement, demand, host)
    blocks = generator_devices(launch, demand)
    needed = max([ranked] + [blocks[i][-1] + 1 for i in generators])
    if needed <= num_gpus:
        return
    roles = []
    for role, num_procs, hosts in (
        ("trainer rank(s) on devices 0..", demand.trainer_procs, placement.trainer_hosts),
        ("reference rank(s) on devices 0..", demand.reference_procs, reference_hosts(placement)),
    ):
        if num_procs and host in hosts:
            roles.append(f"{num_procs // len(hosts)} {role}{num_procs // len(hosts) - 1}")
    if generators:
        roles.append(
            f"{len(generators)} generator(s) x {demand.generator_gpus} GPU(s) "
            f"(generator.tensor_parallel_size) from device {blocks[generators[0]][0]}"
        )
    share = (
        ""
        if launch.share_gpus or not (ranked and generators)
        else (
            ", or let generators use the ranks' GPUs (--launch.share-gpus true, with --generator.gpu-memory-utilization "
            "leaving the trainer room)"
        )
    )
    raise ConfigError(
        f"{where} has {num_gpus} GPU(s) but the placement needs {needed} there: {' + '.join(roles)}. Each rank "
        "and each generator's tensor-parallel block needs GPUs of its own, or the engine fails at start. Move roles "
        "to other hosts (--launch.placement.*), lower --trainer.num-procs, --num-generators or "
        f"--generator.tensor-parallel-size{share}."
    )


@dataclass(frozen=True)
class HostFacts:
    """What one host reports (launch.py's probe runs on every host before the run starts)."""

    address: str
    hostname: str
    num_gpus: int
    cpus: tuple[int, ...]
    """The cores a process there may run on (os.sched_getaffinity of the probe)."""
    rdma_backend: str
    """Monarch's get_rdma_backend(): "ibverbs", "tcp" (its TCP fallback) or "none"."""
    run_dir_visible: bool
    """Whether the run's model directory exists at the same path there (a shared file system)."""

    @property
    def num_cpus(self) -> int:
        return len(self.cpus)


def check_pinned_cores(placement: PlacementConfig, cpus: tuple[int, ...] | set[int], where: str) -> None:
    """The cores `launch.placement.generator_cpus` / `trainer_cpus` name exist among `cpus`, the
    cores a process may run on at `where` (a host of the roles pinned)."""
    offered = sorted(cpus)
    for name in ("generator_cpus", "trainer_cpus"):
        missing = sorted(set(getattr(placement, name) or ()) - set(offered))
        if missing:
            raise ConfigError(
                f"launch.placement.{name} ({_show(getattr(placement, name))}) names core {missing[0]}, but "
                f"{where} lets processes run on cores {_show(offered)} only. Set --launch.placement."
                f"{name.replace('_', '-')} to cores among those, or leave it unset."
            )


class _HostLoad(TypedDict):
    threads: int
    """Compute threads placed on the host."""
    roles: dict[str, int]
    """Processes placed on the host, by role."""


def check_host_facts(launch: LaunchConfig, demand: RoleDemand, facts: list[HostFacts], model_dir: str) -> list[str]:
    """Per-host resources and transports against the placement. Raises ConfigError on what cannot
    run; returns notes worth printing (slow but working choices)."""
    placement, notes = launch.placement, []
    per_host: list[_HostLoad] = [dict(threads=0, roles={}) for _ in facts]

    def add(host: int, role: str, num: int, threads: int) -> None:
        per_host[host]["threads"] += num * threads
        per_host[host]["roles"][role] = per_host[host]["roles"].get(role, 0) + num

    for role, num_procs, hosts, threads in (
        ("trainer rank(s)", demand.trainer_procs, placement.trainer_hosts, demand.trainer_threads),
        ("reference rank(s)", demand.reference_procs, reference_hosts(placement), demand.reference_threads),
    ):
        if num_procs:
            for host in hosts:
                add(host, role, num_procs // len(hosts), threads)
    for index in range(demand.num_generators):
        add(placement.generator_host(index), "generator(s)", 1, demand.generator_threads)
    if demand.scorer_model_threads:
        add(placement.scorer_host_index, "scorer model(s)", 1, demand.scorer_model_threads)

    for host, (fact, load) in enumerate(zip(facts, per_host)):
        where = f"host {host} ({fact.hostname}, {fact.address})"
        if not load["roles"]:
            continue
        roles = " + ".join(f"{num} {role}" for role, num in load["roles"].items())
        check_gpus(launch, demand, host, fact.num_gpus, where)
        check_pinned_cores(placement, fact.cpus, where)
        if not fact.num_gpus and load["threads"] > MAX_COMPUTE_THREADS_PER_CORE * fact.num_cpus:
            raise ConfigError(
                f"{where} has no GPU and {fact.num_cpus} core(s), but the placement puts {roles} = "
                f"{load['threads']} compute threads on it, more than {MAX_COMPUTE_THREADS_PER_CORE} per core. "
                "Move roles to other hosts (--launch.placement.*) or lower their process or thread counts."
            )
        if not fact.run_dir_visible:
            raise ConfigError(
                f"{where} cannot see the run's model directory {model_dir}: every host reads the model and "
                "the run directory at the same path. Put --run-dir on a file system shared by all hosts "
                "(and --model.path, if set)."
            )

    writer = facts[placement.trainer_hosts[0]]
    readers = {placement.generator_host(i) for i in range(demand.num_generators)}
    remote = sorted(h for h in readers if facts[h].hostname != writer.hostname)
    for host in remote:
        for end, fact in (("trainer", writer), ("generator", facts[host])):
            if fact.rdma_backend == "none":
                raise ConfigError(
                    f"generator host {host} ({facts[host].hostname}) reads weights from the trainer's host "
                    f"{placement.trainer_hosts[0]} ({writer.hostname}) over RDMA, but Monarch reports no RDMA "
                    f"backend on the {end}'s host {fact.hostname} (neither ibverbs nor its TCP fallback). Install "
                    "ibverbs (rdma-core) or enable Monarch's TCP fallback there, or place the generators on the "
                    "trainer's host."
                )
        if "tcp" in (writer.rdma_backend, facts[host].rdma_backend):
            notes.append(
                f"weights move from {writer.hostname} to {facts[host].hostname} over Monarch's RDMA TCP fallback "
                "(no ibverbs on one end): about 0.5 GB/s, so large models swap slowly"
            )
    return notes


def demand_of(config) -> RoleDemand:
    """The `RoleDemand` of a GRPOConfig."""
    return RoleDemand(
        trainer_procs=config.trainer.num_procs,
        # The frozen models (reference, distillation teacher) run on the reference hosts.
        reference_procs=(config.reference.num_procs if config.uses_reference_model else 0)
        + (config.scorer.teacher.num_procs if config.uses_teacher else 0),
        num_generators=config.num_generators,
        # A simulated engine or trainer step is a timed wait: no compute threads to place.
        trainer_threads=0 if config.trainer.engine == "sim" else config.trainer.num_threads,
        reference_threads=max(
            config.reference.num_threads, config.scorer.teacher.num_threads if config.uses_teacher else 0
        ),
        generator_threads=0 if config.generator.engine == "sim" else config.generator.cpu_threads,
        generator_gpus=config.generator.tensor_parallel_size,
        scorer_model_threads=sum(config.scorer.model_threads().values()),
    )


def local_gpu_count() -> int:
    """The CUDA devices this process sees. Asks torch only where a GPU driver is loaded: torch's
    import costs seconds of CPU that every run's controller would otherwise pay before spawning anything,
    and without the driver's /proc entry (NVIDIA) or /dev/kfd (ROCm) torch finds no device."""
    if not (Path("/proc/driver/nvidia").exists() or Path("/dev/kfd").exists()):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _show(hosts) -> str:
    return "[" + ", ".join(str(h) for h in hosts) + "]"
