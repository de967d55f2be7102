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


WORKER_HOSTS = (1, 2, 3)
"""The hosts of a `TwoGeneratorHosts` run that run a `forge-rl worker` (host 0 runs the controller)."""
WORKER_PORT = 26400
"""Each host has a network stack of its own: the same port is free on every one."""
RUN_HANG_S = 600
"""Bounds a hang of a run; the pass condition is its summary."""


class TwoGeneratorHosts:
    """Four hosts for one run of the recipe with two vLLM generators, its reward held from the
    start (tests/support/held_reward.py) so that the test decides when training goes on:

        host 0: the controller (`forge-rl grpo` over a host list)
        host 1: `forge-rl worker`: the services (the generator pool among them) and the trainer
        host 2: `forge-rl worker`: vLLM generator 0
        host 3: `forge-rl worker`: vLLM generator 1

    with TwoGeneratorHosts(tmp, worker_args={3: [...]}) as run:
        controller = run.launch(run.config("name", steps=6))
        run.wait_for_held_scoring(controller)   # a generator has generated
        ...                                      # the fault under test
        run.release()
        summary, log = run.finish(controller)
    """

    def __init__(self, tmp: Path, worker_args: dict[int, list[str]] | None = None):
        from tests.support.held_reward import HOLD_DIR_ENV
        from tests.support.workers import REPO

        self.tmp, self.repo = tmp, REPO
        self.worker_args = worker_args or {}
        self.hold_dir = tmp / "hold"
        self.hold_dir.mkdir()
        (self.hold_dir / "hold").touch()  # scoring waits from the first call
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            HOLD_DIR_ENV: str(self.hold_dir),  # the reward runs under host 1's worker
        }
        self.hosts = NetnsHosts(4)
        self.workers: list[subprocess.Popen] = []
        self.controllers: list[subprocess.Popen] = []

    def __enter__(self) -> TwoGeneratorHosts:
        import sys

        from tests.support.helpers import wait_until

        self.hosts.__enter__()
        try:
            for i in WORKER_HOSTS:
                argv = [
                    sys.executable,
                    "-m",
                    "forge_rl.cli",
                    "worker",
                    "--port",
                    str(WORKER_PORT),
                    "--host",
                    self.hosts.address(i),
                ]
                self.workers.append(
                    subprocess.Popen(
                        self.hosts.command(i, argv + self.worker_args.get(i, [])),
                        cwd=self.repo,
                        env=self.env,
                        stdout=open(self.worker_log(i), "w"),
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            for i, worker in zip(WORKER_HOSTS, self.workers):
                wait_until(
                    lambda i=i, worker=worker: _listening(self.hosts.address(i), worker), f"host {i}'s worker to listen"
                )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from tests.support.workers import stop_worker

        (self.hold_dir / "hold").unlink(missing_ok=True)
        for controller in self.controllers:  # one a failed check left running
            if controller.poll() is None:
                controller.kill()
                controller.wait(timeout=30)
        for worker in self.workers:
            stop_worker(worker)
        self.hosts.__exit__()

    @property
    def names(self) -> list[str]:
        return self.hosts.names

    def worker(self, host: int) -> subprocess.Popen:
        return self.workers[WORKER_HOSTS.index(host)]

    def worker_log(self, host: int) -> Path:
        return self.tmp / f"worker{host}.log"

    def config(self, run_name: str, steps: int, **changes):
        """The run: 16 completions a step in groups of 4 of 2 tokens (with `changes`), the services
        and the trainer on host 1, generator i on host 2 + i, the held reward."""
        from forge_rl.config import GRPOConfig
        from forge_rl.core.buffer import BufferConfig
        from forge_rl.engines.config import GeneratorConfig
        from forge_rl.plumbing.placement import LaunchConfig, PlacementConfig
        from forge_rl.tasks import TaskConfig

        fields = {
            "run_dir": self.tmp / "runs",
            "run_name": run_name,
            "steps": steps,
            "train_batch_size": 16,
            "group_size": 4,
            "num_generators": 2,
            "prompts_in_flight_per_generator": 2,
            "generator": GeneratorConfig(max_new_tokens=2),
            "buffer": BufferConfig(max_policy_age=1),
            "task": TaskConfig(reward="tests.support.held_reward:held_leading_number"),
            "launch": LaunchConfig(
                hosts="list",
                workers=tuple(f"tcp://{self.hosts.address(i)}:{WORKER_PORT}" for i in WORKER_HOSTS),
                # Indices into `workers`: the services and the trainer on host 1, generator i on host 2 + i.
                placement=PlacementConfig(services_host=0, trainer_hosts=(0,), generator_hosts=(1, 2)),
            ),
        }
        return GRPOConfig(**{**fields, **changes})

    def launch(self, config) -> subprocess.Popen:
        """`forge-rl grpo` of `config` on host 0; its stdout piped, its stderr in controller.log."""
        import sys

        import yaml

        from forge_rl.run.run_dir import config_to_dict

        path = self.tmp / f"{config.run_name}.yaml"
        path.write_text(yaml.safe_dump(config_to_dict(config)))
        controller = subprocess.Popen(
            self.hosts.command(
                0, [sys.executable, "-m", "forge_rl.cli", "grpo", "--config", str(path), "--log.progress-every-s", "0"]
            ),
            cwd=self.repo,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=open(self.tmp / "controller.log", "w"),
            text=True,
        )
        self.controllers.append(controller)
        return controller

    def wait_for_held_scoring(self, controller: subprocess.Popen) -> None:
        """Returns once a scoring call is held (a generator has generated)."""
        from tests.support.helpers import wait_until

        wait_until(
            lambda: list(self.hold_dir.glob("held-*")) or controller.poll() is not None, "a scoring call to be held"
        )
        assert controller.poll() is None, self.controller_log()[-3000:]

    def wait_for_log(self, host: int, line: str, controller: subprocess.Popen, what: str) -> None:
        """Returns once host `host`'s worker log holds `line` (or the controller has ended)."""
        from tests.support.helpers import wait_until

        wait_until(
            lambda: line in self.worker_log(host).read_text() or controller.poll() is not None,
            what,
            timeout_s=RUN_HANG_S,
        )

    def release(self) -> None:
        (self.hold_dir / "hold").unlink(missing_ok=True)

    def finish(self, controller: subprocess.Popen) -> tuple[dict, str]:
        """The run's summary and the controller's log, once it has ended with 0."""
        import json

        try:
            stdout, _ = controller.communicate(timeout=RUN_HANG_S)
        finally:
            self.release()
            if controller.poll() is None:
                controller.kill()
        log = self.controller_log()
        assert controller.returncode == 0, log[-3000:]
        return json.loads(stdout.strip().splitlines()[-1]), log

    def controller_log(self) -> str:
        return (self.tmp / "controller.log").read_text()

    def metrics(self, config) -> list[dict]:
        import json

        return [
            json.loads(line) for line in (config.run_dir / config.run_name / "metrics.jsonl").read_text().splitlines()
        ]


def _listening(address: str, worker: subprocess.Popen) -> bool:
    import socket

    assert worker.poll() is None, f"the worker for {address} exited with {worker.returncode}"
    try:
        with socket.create_connection((address, WORKER_PORT), timeout=1.0):
            return True
    except OSError:
        return False
