"""Service trainer shell: one actor per trainer rank, holding every tenant's LoRA adapters over one
frozen base (`forge_rl.training.tenants`) for `forge-rl serve`.

Every endpoint is called on all ranks at once (`.call()`): forward, backward and the adapters'
export are collectives. They are plain endpoints, so one rank carries out one call at a time in
the order they came: calls of two tenants are serialized, and the hand-over of the live adapters
between them happens between two calls, never inside one. Rank 0 publishes a tenant's adapters to
the weight store as a version of its own, which the generators serve beside the others.

torch, TorchTitan and the trainer are imported where they run (in the trainer's processes): the
controller imports this module to spawn the actor and starts without torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from monarch.actor import Actor, endpoint

from forge_rl.plumbing.cpu_affinity import pin_this_process
from forge_rl.store.actors import StoreIndexActor
from forge_rl.store.index import version_key
from forge_rl.store.publisher import PublishConfig, WeightPublisher
from forge_rl.training.trainer_config import TrainerConfig

if TYPE_CHECKING:
    from forge_rl.training.tenants import TenantTrainer


class ServiceTrainerActor(Actor):
    def __init__(
        self,
        config: TrainerConfig,
        model_dir: str,
        store_index: StoreIndexActor,
        store_root: str,
        publish: PublishConfig = PublishConfig(),
        cpus: tuple[int, ...] | None = None,
    ):
        self.cpus = pin_this_process(cpus)
        self.config = config
        self.model_dir = Path(model_dir)
        self.store_index = store_index
        self.store_root = Path(store_root)
        self.publish_config = publish
        self.rank = int(os.environ.get("RANK", "0"))
        self.tenants: TenantTrainer | None = None
        self.publisher: WeightPublisher | None = None

    @endpoint
    async def setup(self) -> dict:
        from forge_rl.store.client import WeightStore
        from forge_rl.training.tenants import TenantTrainer
        from forge_rl.training.trainer import PolicyTrainer

        started = time.perf_counter()
        self.tenants = TenantTrainer(PolicyTrainer(self.config, self.model_dir))
        if self.rank == 0:
            store = WeightStore(
                self.store_index, self.store_root, extra_files_dir=self.model_dir, checksum=self.publish_config.checksum
            )
            self.publisher = WeightPublisher(store, self.publish_config)
        return {"trainer_setup_s": time.perf_counter() - started, "pid": os.getpid(), "lora_rank": self.tenants.rank}

    @endpoint
    async def add_tenant(self, tenant: str, seed: int, frozen_targets: tuple[str, ...] = ()) -> None:
        assert self.tenants is not None  # built by setup, which every rank runs first
        self.tenants.add_tenant(tenant, seed, frozen_targets)

    @endpoint
    async def remove_tenant(self, tenant: str) -> None:
        assert self.tenants is not None  # built by setup, which every rank runs first
        self.tenants.remove_tenant(tenant)

    @endpoint
    async def forward_backward(
        self, tenant: str, data: list, loss_fn: str, loss_fn_config: dict | None, backward: bool
    ) -> tuple[list[dict], dict[str, float]]:
        """`TenantTrainer.forward_backward`: each datum's outputs and the call's metrics."""
        assert self.tenants is not None  # built by setup, which every rank runs first
        return self.tenants.forward_backward(tenant, data, loss_fn, loss_fn_config, backward)

    @endpoint
    async def optim_step(self, tenant: str, adam: dict) -> dict[str, float]:
        """`TenantTrainer.optim_step` with Tinker's AdamParams (`adam`: its fields by name)."""
        assert self.tenants is not None  # built by setup, which every rank runs first
        return self.tenants.optim_step(tenant, **adam)

    @endpoint
    async def publish(self, tenant: str, policy_version: int) -> dict:
        """Publish the tenant's adapters as `policy_version` of the weight store (a PEFT adapter
        directory); returns, on rank 0, where it will be (`weights/dir`, complete once the store
        says so) and the publish's figures."""
        assert self.tenants is not None  # built by setup, which every rank runs first
        started = time.perf_counter()
        dtype = self.publish_config.torch_dtype()
        adapters = self.tenants.adapter_state_dict(tenant, dtype, keep=self.rank == 0)
        if self.rank != 0:
            return {}
        from forge_rl.models.peft_format import peft_adapter

        snapshot, adapter_config = peft_adapter(adapters, self.config.lora, self.model_dir, dtype)
        assert self.publisher is not None  # rank 0's, built by setup
        metrics = await self.publisher.publish(
            policy_version, snapshot, time.perf_counter() - started, (adapter_config, str(self.model_dir))
        )
        return {**metrics, "weights/dir": str(self.store_root / version_key(policy_version))}

    @endpoint
    async def save_state(self, tenant: str, path: str) -> dict:
        """The tenant's adapters and AdamW moments as a DCP checkpoint at `path` (every rank
        writes its shards; PolicyTrainer.save_checkpoint)."""
        assert self.tenants is not None  # built by setup, which every rank runs first
        self.tenants.activate(tenant)
        started = time.perf_counter()
        self.tenants.trainer.save_checkpoint(path)
        return {"save_s": time.perf_counter() - started, "num_steps": self.tenants.num_steps(tenant)}

    @endpoint
    async def load_state(self, tenant: str, path: str, with_optimizer: bool) -> None:
        """Load a `save_state` checkpoint into the tenant; without `with_optimizer`, its moments
        start afresh. A checkpoint of other adapters (rank, layers, base) is refused naming them."""
        assert self.tenants is not None  # built by setup, which every rank runs first
        self.tenants.activate(tenant)
        self.tenants.trainer.load_checkpoint(path)
        if not with_optimizer:
            self.tenants.reset_optimizer(tenant)

    @endpoint
    async def wait_for_publish(self) -> None:
        """The newest publish has been written (raises what its write raised)."""
        if self.publisher is not None:
            await self.publisher.flush()
