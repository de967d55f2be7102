"""Process meshes for a run on this host. The only module besides actors/ that imports Monarch."""

from __future__ import annotations

from monarch.actor import ProcMesh, this_host
from monarch.spmd import setup_torch_elastic_env_async


def spawn_procs(name: str, num_procs: int) -> ProcMesh:
    return this_host().spawn_procs(per_host={"procs": num_procs}, name=name)


async def spawn_trainer_procs(num_procs: int, name: str = "trainer") -> ProcMesh:
    """Ranks of one torch.distributed world (the trainer's, or the reference model's) with
    RANK/WORLD_SIZE/MASTER_* set, ready for init_process_group."""
    procs = spawn_procs(name, num_procs)
    await setup_torch_elastic_env_async(procs)
    return procs
