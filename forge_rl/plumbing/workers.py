"""The Monarch workers a run's hosts are (`launch.hosts` list or slurm): their addresses (given, or
one per node of a SLURM allocation), whether they are reachable, and whether the hostnames they
report name machines apart. Monarch-free: `forge_rl.run.launch` attaches to them.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forge_rl.errors import ConfigError

if TYPE_CHECKING:
    from forge_rl.plumbing.placement import HostFacts, LaunchConfig

DEFAULT_WORKER_PORT = 26600

_RETRY_S = 0.2


_ADDRESS = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]+)$")


@dataclass(frozen=True)
class WorkerArgs:
    """`forge-rl worker`: one per host; runs until killed (or until its allocation ends)."""

    port: int = DEFAULT_WORKER_PORT
    """TCP port to serve on; the controller lists tcp://HOST:PORT in launch.workers."""
    host: str | None = None
    """Name or address the worker serves and is reached at; unset: this machine's hostname."""
    preemption_grace_s: float = 30.0
    """Seconds from this worker's SIGTERM (a preemption notice) to its end: the run takes this
    host's generators out meanwhile, their groups finishing or continuing on other hosts
    (`forge_rl.plumbing.preemption`). Set it a few seconds under the scheduler's grace."""

    def __post_init__(self) -> None:
        if not self.preemption_grace_s >= 0:
            raise ValueError(
                f"--preemption-grace-s ({self.preemption_grace_s}) must be >= 0 (seconds from SIGTERM to the "
                "worker's end). Set it a few seconds under the scheduler's grace, or 0 to end at SIGTERM."
            )


def parse_worker_address(address: str) -> tuple[str, int]:
    """(host, port) of "tcp://HOST:PORT"; a ConfigError naming the address otherwise."""
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    port = int(match["port"]) if match else 0
    if match is None or not 1 <= port <= 65535:
        raise ConfigError(
            f"launch.workers entry {address!r} is not a worker address tcp://HOST:PORT (port 1..65535). "
            "Write it as the worker prints it, e.g. tcp://node1:26600 or tcp://10.0.0.5:26600."
        )
    host = match["host"].strip("[]")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"launch.workers entry {address!r} has an invalid IPv6 address {host!r}.") from None
    return host, port


def worker_addresses(launch: LaunchConfig) -> tuple[list[str], str]:
    """The workers' addresses (hosts=list or slurm) and where they came from, for messages."""
    if launch.hosts == "list":
        return list(launch.workers), "launch.workers"
    return slurm_worker_addresses(launch.worker_port), "the SLURM allocation (SLURM_JOB_NODELIST)"


def slurm_worker_addresses(port: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """tcp://NODE:PORT for each node of this SLURM allocation, in SLURM's node order."""
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(
            "launch.hosts is 'slurm' but SLURM_JOB_NODELIST is not set: this is not a SLURM allocation. Run "
            "forge-rl inside one (sbatch configs/slurm_grpo.sbatch, or salloc), or use --launch.hosts list."
        )
    return [f"tcp://{node}:{port}" for node in expand_nodelist(nodelist)]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed hostlist, e.g. "gpu[01-03,07],cpu-a1" -> gpu01 gpu02 gpu03 gpu07 cpu-a1
    (what `scontrol show hostnames` prints). Zero padding is kept; several bracket groups in one
    name expand as a product."""
    nodes: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if not item:
            raise ConfigError(f"SLURM nodelist {nodelist!r} has an empty entry; expected e.g. node[01-04],gpu7")
        nodes.extend(_expand_one(item, nodelist))
    return nodes


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return items


def _expand_one(item: str, nodelist: str) -> list[str]:
    match = re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ConfigError(f"SLURM nodelist {nodelist!r}: unbalanced brackets in {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    names = []
    for part in ranges.split(","):
        bounds = part.split("-")
        if len(bounds) > 2 or not all(b.isdigit() for b in bounds):
            raise ConfigError(f"SLURM nodelist {nodelist!r}: cannot read the range {part!r} in {item!r}")
        low, high = bounds[0], bounds[-1]
        if int(high) < int(low):
            raise ConfigError(f"SLURM nodelist {nodelist!r}: range {part!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        names += [f"{prefix}{number:0{width}d}" for number in range(int(low), int(high) + 1)]
    return [name + tail for name in names for tail in _expand_one(rest, nodelist)] if rest else names


def check_reachable(addresses: list[str], timeout_s: float) -> None:
    """Every worker's TCP port accepts a connection within `timeout_s` (checked in parallel,
    retried until then: workers started alongside the controller, as under srun, may be late)."""
    import concurrent.futures
    import time

    def probe(address: str) -> str | None:
        host, port = parse_worker_address(address)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                    return None
            except OSError as e:
                if time.monotonic() + _RETRY_S >= deadline:
                    return f"{address} ({e.strerror or type(e).__name__})"
            time.sleep(_RETRY_S)

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        failures = [f for f in pool.map(probe, addresses) if f]
    if failures:
        raise ConfigError(
            f"cannot reach the Monarch worker(s) at {', '.join(failures)} within {timeout_s:g} s. Start one on "
            "each host (`forge-rl worker --port PORT`, same Python environment and forge_rl version as here), "
            "check the address and that the port is open between the hosts, or raise --launch.connect-timeout-s."
        )


def hostnames_resolve_apart(facts: list[HostFacts]) -> None:
    """Hosts at different addresses that report one hostname make the weight store treat them as
    one host (its locations are hostname:path): refuse that instead of failing at the first swap."""
    seen: dict[str, str] = {}
    for fact in facts:
        host = parse_worker_address(fact.address)[0] if fact.address.startswith("tcp://") else fact.address
        if fact.hostname in seen and not _same_machine(seen[fact.hostname], host):
            raise ConfigError(
                f"workers {seen[fact.hostname]} and {host} both report hostname {fact.hostname!r}; the weight "
                "store tells hosts apart by hostname. Give each host a unique hostname."
            )
        seen.setdefault(fact.hostname, host)


def _same_machine(a: str, b: str) -> bool:
    def resolve(name: str) -> str:
        try:
            return socket.gethostbyname(name)
        except OSError:
            return name

    return resolve(a) == resolve(b) or {resolve(a), resolve(b)} <= {"127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def check_hostname_routable() -> None:
    """Workers on other hosts connect back to this machine by its hostname (Monarch's TCP
    transport), so it must resolve to an address they can reach, not only to loopback."""
    hostname = socket.gethostname()
    if is_loopback(hostname):
        raise ConfigError(
            f"this machine's hostname {hostname!r} resolves only to a loopback address, so workers on other "
            "hosts cannot connect back to it. Map it to a routable address (/etc/hosts or DNS), or run "
            "forge-rl on a host whose hostname resolves (e.g. a node of the allocation)."
        )
