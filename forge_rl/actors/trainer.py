"""Trainer shell: one actor per trainer rank (FSDP2/TP on a DeviceMesh), publishing each version.

Every endpoint is called on all ranks at once (`.call()`): the step and the weight export are
collectives. Rank 0 writes the snapshot and reports global metrics.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from monarch.actor import Actor, endpoint

from forge_rl.batching import make_train_batch
from forge_rl.store.shm import SharedMemoryWeightStore
from forge_rl.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode


class TrainerActor(Actor):
    def __init__(self, config: TrainerConfig, model_dir: str, store_root: str, pad_id: int):
        self.config = config
        self.model_dir = Path(model_dir)
        self.store = SharedMemoryWeightStore(Path(store_root), self.model_dir)
        self.pad_id = pad_id
        self.rank = int(os.environ.get("RANK", "0"))
        self.trainer: PolicyTrainer | None = None

    @endpoint
    async def setup(self) -> dict:
        started = time.perf_counter()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(backend)
        self.trainer = PolicyTrainer(self.config, self.model_dir)
        return {"trainer_setup_s": time.perf_counter() - started}

    @endpoint
    async def train_step(self, episodes: list[Episode]) -> dict:
        """One optimizer step on `episodes`, then publish the new version to the weight store."""
        batch = make_train_batch(episodes, self.pad_id, self.config.loss.normalize_advantage_std)
        metrics = self.trainer.train_step(batch)
        metrics.update(self._publish())
        return metrics

    @endpoint
    async def compute_logprobs(self, episodes: list[Episode]) -> torch.Tensor:
        """Trainer logprobs [N, L] of the episodes' tokens under the current weights (for checks)."""
        return self.trainer.compute_logprobs(
            make_train_batch(episodes, self.pad_id, self.config.loss.normalize_advantage_std)
        )

    def _publish(self) -> dict:
        started = time.perf_counter()
        hf_state_dict = self.trainer.hf_state_dict(torch.float32)  # collective: every rank joins
        gather_s = time.perf_counter() - started
        if self.rank != 0:
            return {}
        stats = self.store.publish(self.trainer.policy_version, hf_state_dict)
        return {
            "weights/gather_s": gather_s,
            "weights/publish_s": stats.write_s,
            "weights/bytes": stats.num_bytes,
            "weights/dir": str(self.store.path(stats.policy_version)),
        }
