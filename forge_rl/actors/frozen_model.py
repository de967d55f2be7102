"""Frozen-model shell: one actor per rank of a model that scores tokens and never trains.

It serves both "frozen models that score tokens": the reference model of the KL penalty
(`forge_rl.training.reference`, spawned when trainer.loss.kl_beta > 0, its logprobs stored on the
completions) and the teacher of on-policy distillation (`forge_rl.scoring.teacher`, spawned when
scorer.teacher.path is set, its logprobs turned into per-token rewards by the teacher scorer).
The model is a `PolicyTrainer` that never takes a step: the same TorchTitan build, parallelism and
logprob code as the policy (the generator's temperature and kept sets), so a frozen model and the
policy can only differ by their weights. `token_logprobs` is a collective over the model's ranks,
called on all of them at once (`.call()`); rank 0's answer is the result. The ranks are spawned
and owned by a FrozenModelSupervisor (`forge_rl.actors.frozen_model_supervisor`), which restarts
them on fresh processes if one dies; callers call the supervisor.

A self-distillation teacher (scorer.teacher.pin lagged, ema or best) starts as the run's initial
policy and is refreshed from the weight store: `stage` copies a published version into this
process (while the store still holds it), `swap` serves it. Endpoints run one at a time, so no
`token_logprobs` call sees half a swap, and the generators take no part in it: they never pause.
A checkpoint writes its served and staged weights to a file (`save_weights`), which a resumed
run's teacher, or its replacement, loads (`load_weights`).

Over several ranks (FSDP2 and/or TP) each rank reads the whole version (from this host's copy of
it) and keeps its own shards, cut locally (`_shards`): `stage` runs beside `token_logprobs`
(a concurrent endpoint), so it must start no collective that could interleave with the forward's.
`save_weights` gathers the shards (a collective of every rank, run in turn like `token_logprobs`)
and rank 0 writes the file.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint
from torch.distributed.tensor import DTensor, distribute_tensor

from forge_rl.core.batching import make_train_batch
from forge_rl.models.titan import titan_state_dict_from_hf
from forge_rl.scoring.teacher import load_teacher_weights, save_teacher_weights, teacher_store_reader
from forge_rl.training.reference import ReferenceConfig, completion_logprobs
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode

if TYPE_CHECKING:
    from forge_rl.store.client import WeightStore


class FrozenModelActor(Actor):
    def __init__(
        self,
        config: ReferenceConfig,
        model_dir: str,
        pad_id: int,
        store_index=None,
        store_root: str | None = None,
        store_reader: str = "teacher",
    ):
        """`config`: a ReferenceConfig or a TeacherConfig (its processes, parallelism, threads).
        `store_index`, `store_root`: the weight store a self-distillation teacher reads versions from,
        as reader `teacher_store_reader(store_reader, rank)` (`store_reader`: one per incarnation)."""
        self.config = config
        self.model_dir = Path(model_dir)
        self.pad_id = pad_id
        self.model: PolicyTrainer | None = None
        self.store_index, self.store_root, self.store_reader = store_index, store_root, store_reader
        self.store: WeightStore | None = None
        self.staged: dict[str, torch.Tensor] | None = None
        self.staged_version: int | None = None
        self.serving_version = 0

    @endpoint
    async def setup(self) -> dict:
        """Build the model; returns the time it took and where this rank runs (its supervisor polls the pid)."""
        started = time.perf_counter()
        trainer_config = TrainerConfig(
            num_procs=self.config.num_procs, parallel=self.config.parallel, num_threads=self.config.num_threads
        )
        self.model = PolicyTrainer(trainer_config, self.model_dir)
        self.model.model.requires_grad_(False)
        return {
            f"{self.config.section}_setup_s": time.perf_counter() - started,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    @endpoint
    async def token_logprobs(self, episodes: list[Episode]) -> list[list[list[float]]]:
        """The frozen model's logprob of every completion token, [episode][completion][token],
        under the distribution each was sampled from."""
        assert self.model is not None  # built by setup, which its supervisor awaits first
        logprobs_NL = self.model.compute_logprobs(make_train_batch(episodes, self.pad_id))
        return completion_logprobs(episodes, logprobs_NL)

    # Concurrent: a plain endpoint runs to its end before the next message, so the scorer's
    # `token_logprobs` calls would wait behind the store read (and the wait for the publish).
    @concurrent_endpoint
    async def stage(self, policy_version: int, blend: float | None = None) -> dict:
        """Copy `policy_version` from the weight store into this process as the staged weights (with
        `blend`: blend * the served weights + (1 - blend) * the version, an exponential average)."""
        from forge_rl.store.client import WeightStore
        from forge_rl.store.index import version_key

        assert self.model is not None  # built by setup, which its supervisor awaits first
        started = time.perf_counter()
        if self.store is None:
            if self.store_root is None:
                raise RuntimeError(
                    f"this {self.config.section} model reads no weight store: only a self-distillation teacher stages versions"
                )
            reader = teacher_store_reader(self.store_reader, self.model.rank)
            self.store = WeightStore(self.store_index, Path(self.store_root), reader, extra_files_dir=self.model_dir)
        await self.store.wait_for_version(policy_version)  # its publish may still be writing it
        async with self.store.lease(version_key(policy_version)) as snapshot:
            with snapshot.open() as hf_tensors:  # zero-copy: only this rank's shards are copied out
                staged = self._shards(titan_state_dict_from_hf(self.model_dir, hf_tensors))
        if blend is not None:
            served = self.model.model.state_dict()
            staged = {
                name: blend * served[name].float() + (1 - blend) * tensor.float() for name, tensor in staged.items()
            }
        self.staged, self.staged_version = staged, policy_version
        return {"teacher/stage_s": time.perf_counter() - started}

    @endpoint
    async def swap(self) -> dict:
        """Serve the staged weights from now on."""
        assert self.model is not None  # built by setup, which its supervisor awaits first
        if self.staged is None or self.staged_version is None:
            raise RuntimeError("swap with no staged weights: stage a version first")
        self.model.model.load_state_dict(self.staged, strict=True)
        self.serving_version, self.staged = self.staged_version, None
        return {"teacher/policy_version": self.serving_version}

    @endpoint
    async def save_weights(self, path: str) -> dict:
        """Write the served weights and the staged ones (a pinned teacher's checkpoint,
        `forge_rl.scoring.teacher.save_teacher_weights`); returns their versions."""
        assert self.model is not None  # built by setup, which its supervisor awaits first
        served = _full(self.model.model.state_dict())  # collectives: every rank, in this order
        staged = None if self.staged is None else _full(self.staged)
        if self.model.rank == 0:
            save_teacher_weights(
                Path(path), served, self.serving_version, staged, self.staged_version if staged is not None else None
            )
        return {"served": self.serving_version, "staged": self.staged_version if self.staged is not None else None}

    @endpoint
    async def load_weights(self, path: str, served: bool = True, staged: bool = True) -> dict:
        """Serve the weights `save_weights` wrote to `path` (`served`) and stage its staged ones
        (`staged`); returns their versions."""
        assert self.model is not None  # built by setup, which its supervisor awaits first
        saved = load_teacher_weights(Path(path))
        if served:
            self.model.model.load_state_dict(self._shards(saved["served"]), strict=True)
            self.serving_version = saved["served_version"]
        if staged and saved["staged"] is not None:
            self.staged, self.staged_version = self._shards(saved["staged"]), saved["staged_version"]
        return {"served": saved["served_version"], "staged": saved["staged_version"]}

    def _shards(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of this rank's shards of whole tensors (the served model's placements; on one
        process, whole copies), cut with no collective: every rank holds the whole tensor. Copies,
        not views: a shard must not keep the whole tensor alive, nor a mapping of the store."""
        assert self.model is not None  # built by setup, which its supervisor awaits first
        served = self.model.model.state_dict()
        shards = {}
        for name, tensor in full.items():
            target = served[name]
            tensor = tensor.to(device=target.device)
            if isinstance(target, DTensor):
                shard = distribute_tensor(tensor, target.device_mesh, target.placements, src_data_rank=None)
                shards[name] = DTensor.from_local(
                    shard.to_local().clone(),
                    target.device_mesh,
                    target.placements,
                    run_check=False,
                    shape=shard.shape,
                    stride=shard.stride(),
                )
            else:
                shards[name] = tensor.clone()
        return shards

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.store is not None:  # leases of a stage cut short
            await self.store.close()


def _full(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors (a DTensor's shards gathered), so the file loads into any layout."""
    return {
        name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor for name, tensor in state_dict.items()
    }
