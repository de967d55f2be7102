"""One process per host that reports what the host offers, before the run spawns anything costly."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from monarch.actor import Actor, endpoint

from forge_rl.plumbing.placement import local_gpu_count


class HostProbe(Actor):
    @endpoint
    async def facts(self, model_dir: str) -> dict:
        """Hostname, GPUs, usable cores, Monarch's RDMA backend, and whether `model_dir` is there.
        Without torch where the host has no GPU driver (`local_gpu_count`): its import costs seconds
        of CPU on the way to every multi-host run's first spawn."""
        from monarch.rdma import get_rdma_backend

        return {
            "hostname": socket.gethostname(),
            "num_gpus": local_gpu_count(),
            "cpus": tuple(sorted(os.sched_getaffinity(0))),
            "rdma_backend": get_rdma_backend(),
            "run_dir_visible": Path(model_dir).is_dir(),
        }
