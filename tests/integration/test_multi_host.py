"""Multi-host launching on one machine: two real Monarch workers (`forge-rl worker`, listening on
tcp://127.0.0.1:PORT) stand in for two hosts, and a controller attaches to them through
forge_rl/run/launch.py with a host-list config. It checks that every role lands on the host the
placement names (a process is on worker w's "host" when w is its ancestor), that trainer ranks get
their torch.distributed environment, that a mesh passed to an actor spawns there (the generator
pool's path, and the scorer supervisor's on `scorer_host`), and that the weight store's volume
registers on the trainer's host.

The controller runs as a subprocess (`python -m tests.integration.test_multi_host`): a host list
makes it switch Monarch to TCP, which must happen before any other Monarch call of the process.
The whole recipe over a host list runs in tests/integration/test_grpo_loop.py (its tp variant).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from monarch.actor import Actor, endpoint

from forge_rl.plumbing.proc_main import spawn_procs
from tests.support.workers import start_workers, stop_worker

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ATTACH_HANG_S = 300
"""Bounds a hang of the placement controller; the pass condition is where each role landed."""


class WhereAmI(Actor):
    @endpoint
    async def where(self) -> dict:
        return {
            "ancestors": [p.pid for p in psutil.Process().parents()],  # the run stops it before the test looks
            "rank": os.environ.get("RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
        }

    @endpoint
    async def spawn_on(self, host_mesh) -> dict:
        """Spawn a process on `host_mesh` from inside an actor, as the GeneratorPool does."""
        procs = spawn_procs(host_mesh, "child")
        try:
            return await procs.spawn("child", WhereAmI).where.call_one()
        finally:
            await procs.stop()


def _worker_of(ancestors: list[int], worker_pids: list[int]) -> int | None:
    """Index of the worker a process descends from (the "host" it runs on)."""
    for ancestor in ancestors:
        if ancestor in worker_pids:
            return worker_pids.index(ancestor)
    return None


def test_a_host_list_places_each_role_on_its_worker(tmp_path):
    ports, workers = start_workers(2)
    try:
        client = subprocess.run(
            [sys.executable, "-m", "tests.integration.test_multi_host", str(tmp_path), *map(str, ports)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=ATTACH_HANG_S,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        report = json.loads(client.stdout.strip().splitlines()[-1])
        worker_pids = [w.pid for w in workers]
        hosts = {role: _worker_of(ancestors, worker_pids) for role, ancestors in report["ancestors"].items()}
        assert hosts == {
            "services": 0,
            "trainer0": 1,
            "trainer1": 1,
            "store_volume": 1,
            "spawned_by_actor": 1,
            "scorer": 1,
        }
        assert report["ranks"] == [["0", "2"], ["1", "2"]]
        assert [f["cpus"] for f in report["facts"]] == [sorted(os.sched_getaffinity(0))] * 2
        assert report["volume_location"].startswith(socket.gethostname() + ":")
    finally:
        for worker in workers:
            stop_worker(worker)
    assert all(w.poll() is not None for w in workers)


async def _controller(model_dir: str, ports: list[str]) -> dict:
    from forge_rl.config import GRPOConfig
    from forge_rl.models.titan import ParallelConfig
    from forge_rl.plumbing.placement import LaunchConfig, PlacementConfig
    from forge_rl.run import launch
    from forge_rl.store.actors import StorageVolumeActor
    from forge_rl.training.trainer import TrainerConfig

    config = GRPOConfig(
        trainer=TrainerConfig(num_procs=2, parallel=ParallelConfig(dp_shard=2)),
        launch=LaunchConfig(
            hosts="list",
            workers=tuple(f"tcp://127.0.0.1:{port}" for port in ports),
            placement=PlacementConfig(services_host=0, trainer_hosts=(1,), generator_hosts=(1,), scorer_host=1),
        ),
    )
    hosts = await launch.start_hosts(config, model_dir)
    try:
        services = hosts.spawn_services()
        trainer = await hosts.spawn_ranks("trainer", config.trainer.num_procs)
        volume_procs = hosts.store_volume_procs(services)
        volume = volume_procs.spawn("store_volume", StorageVolumeActor, str(Path(model_dir) / "store"))
        service_actor = services.spawn("where", WhereAmI)
        trainer_ranks = [r for _, r in (await trainer.spawn("where", WhereAmI).where.call()).items()]
        generator_host = hosts.generator_placements()[0].host
        # Where the scoring stage's supervisor spawns the scorer's processes (forge_rl/actors/scoring_stage.py).
        scorer_host = hosts.owned_host(config.launch.placement.scorer_host_index)
        return {
            "facts": [vars(f) for f in hosts.facts],
            "ancestors": {
                "services": (await service_actor.where.call_one())["ancestors"],
                "trainer0": trainer_ranks[0]["ancestors"],
                "trainer1": trainer_ranks[1]["ancestors"],
                "store_volume": (await volume_procs.spawn("where", WhereAmI).where.call_one())["ancestors"],
                "spawned_by_actor": (await service_actor.spawn_on.call_one(generator_host))["ancestors"],
                "scorer": (await service_actor.spawn_on.call_one(scorer_host))["ancestors"],
            },
            "ranks": [[r["rank"], r["world_size"]] for r in trainer_ranks],
            "volume_location": await volume.location.call_one(),
        }
    finally:
        await hosts.stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_controller(sys.argv[1], sys.argv[2:]))), flush=True)
