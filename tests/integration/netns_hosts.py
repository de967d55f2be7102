"""Hosts made of Linux network namespaces on this machine, for the multi-host tests.

Each "host" is a network namespace with its own address on a bridge in the root namespace, its
own hostname (a UTS namespace, so `socket.gethostname()` differs from this machine's and every
host-local shortcut of forge_rl takes its remote path) and its own /etc/hosts naming every host
(`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts). Processes, files and /dev/shm stay
shared: what is isolated is the network stack and the hostname, which is what the multi-host path
keys on (Monarch's TCP transport, the store's host of a version, the pools' own-host checks).

    with NetnsHosts(3) as hosts:            # skips the test where namespaces cannot be made
        hosts.popen(1, [python, "-m", "forge_rl.cli", "worker", "--host", hosts.address(1), ...])

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2's `ip` and util-linux's `unshare`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


class NetnsHosts:
    """`count` hosts named `<prefix>h<i>`, addresses 10.<a>.<b>.<i + 2>/24 on one bridge; a
    prefix and subnet of this process's own (from its pid), so two test runs on one machine
    never share them."""

    def __init__(self, count: int):
        tag = os.getpid() % 50000
        self.prefix = f"fr{tag}"
        self.subnet = f"10.{100 + tag // 250}.{tag % 250}"
        self.names = [f"{self.prefix}h{i}" for i in range(count)]
        self.bridge = f"{self.prefix}br"
        self._made: list[str] = []

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 2}"

    def __enter__(self) -> NetnsHosts:
        reason = _why_not_available()
        if reason:
            pytest.skip(f"network-namespace hosts cannot be made here: {reason}")
        try:
            self._make()
        except subprocess.CalledProcessError as e:
            self.__exit__()
            pytest.skip(f"network-namespace hosts cannot be made here: {' '.join(e.cmd)} failed: {e.stderr.strip()}")
        return self

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(f"link:{self.bridge}")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.address(i)} {n}\n" for i, n in enumerate(self.names))
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            self._made.append(f"netns:{name}")
            outside, inside = f"{name}o", f"{name}i"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", name)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("addr", "add", f"{self.address(i)}/24", "dev", inside, netns=name)
            _ip("link", "set", inside, "up", netns=name)
            _ip("link", "set", "lo", "up", netns=name)
            (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / name / "hosts").write_text(hosts_file)

    def command(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run on host `index`: in its network namespace, under its own hostname."""
        name = self.names[index]
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", name, "unshare", "--uts", "--", "sh", "-c", script, name, *argv]

    def __exit__(self, *exc) -> None:
        for made in reversed(self._made):
            kind, name = made.split(":", 1)
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its veth pair goes with it
                shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        self._made.clear()


def _why_not_available() -> str | None:
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    probe = f"frprobe{os.getpid() % 50000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None
