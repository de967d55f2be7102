"""Trainer shell: one actor per trainer rank (FSDP2/TP on a DeviceMesh), publishing each version.

Every endpoint is called on all ranks at once (`.call()`): the step and the weight export are
collectives. Rank 0 publishes the snapshot (in the background, `forge_rl.store.publisher`) and
reports global metrics.

This module imports torch, TorchTitan and the trainer where they run (in the trainer's processes),
not at its top: the controller imports it to spawn the actor, and starts without torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from monarch.actor import Actor, endpoint

from forge_rl.core.columns import BatchColumns, batch_columns
from forge_rl.observability.metric_names import TRAINED_TOKENS, TRAINER_BATCHING_S, TRAINER_PUBLISH_S
from forge_rl.plumbing.cpu_affinity import pin_this_process
from forge_rl.plumbing.gc_freeze import freeze_startup_objects
from forge_rl.plumbing.native_heap import trim_native_heap_if_due
from forge_rl.plumbing.port_calls import PortCalled, PortCalls, PortServed
from forge_rl.store.actors import StoreIndexActor
from forge_rl.store.index import version_key
from forge_rl.store.publisher import PublishConfig, WeightPublisher
from forge_rl.training.trainer_config import TrainerConfig
from forge_rl.training.trainer_steps import (
    BatchPrefetch,
    PulledStep,
    StepTurns,
    TrainStepResult,
    train_pulled_batch_in_turn,
)
from forge_rl.types import Episode

if TYPE_CHECKING:
    import torch

    from forge_rl.training.trainer import PolicyTrainer


class TrainerActor(PortServed, Actor):
    def __init__(
        self,
        config: TrainerConfig,
        model_dir: str,
        store_index: StoreIndexActor,
        store_root: str,
        pad_id: int,
        publish: PublishConfig = PublishConfig(),
        cpus: tuple[int, ...] | None = None,
        policy: str | None = None,
    ):
        # `cpus`: the cores of this rank (launch.placement.trainer_cpus), pinned before torch
        # starts its thread pools, which inherit them. `policy`: the one of the run's `policies`
        # this trainer trains (its part of each batch: `forge_rl.core.policies`); None: the run's own.
        self.cpus = pin_this_process(cpus)
        self.config = config
        self.store_index = store_index
        self.model_dir = Path(model_dir)
        self.store_root = Path(store_root)
        self.publish_config = publish
        self.publisher: WeightPublisher | None = None
        self.pad_id = pad_id
        self.rank = int(os.environ.get("RANK", "0"))
        self.trainer: PolicyTrainer | None = None
        self._turns = StepTurns()
        """The order steps of `train_next_step` train in."""
        self._prefetch = BatchPrefetch(policy)
        """The next step's batch, asked for while this one trains."""
        self._calls = PortCalls()
        """Each step's `batch_for_trainer`, answered on one port (`forge_rl.plumbing.port_calls`)."""
        self._publishing: asyncio.Future | None = None
        """The publish of the newest version, started after its step answered (`_train_step`)."""
        self._telling_written: asyncio.Future | None = None
        """Rank 0: waits for the newest checkpoint's background write, then tells its port."""

    @endpoint
    async def setup(self) -> dict:
        from forge_rl.store.client import WeightStore
        from forge_rl.training.trainer import PolicyTrainer

        started = time.perf_counter()
        # PolicyTrainer joins the process group itself (init_process_group_from_env), after
        # picking its device.
        self.trainer = PolicyTrainer(self.config, self.model_dir)
        if self.rank == 0:
            store = WeightStore(
                self.store_index, self.store_root, extra_files_dir=self.model_dir, checksum=self.publish_config.checksum
            )
            self.publisher = WeightPublisher(store, self.publish_config)
        freeze_startup_objects()  # the model, torch and TorchTitan: no full GC scans them mid-step
        return {"trainer_setup_s": time.perf_counter() - started, "pid": os.getpid(), "cpus": self.cpus}

    # A plain endpoint, not a concurrent one: called on the whole mesh with `.call()`, a concurrent
    # endpoint's reply from a rank can go missing (the train loop then waits for ever with both
    # ranks idle; a plain endpoint's replies always arrive). So step k + 1's call starts once step k has
    # answered, and its batch is asked for while step k trains (`prefetch_next`, BatchPrefetch);
    # `StepTurns` keeps the order should the endpoint become concurrent again. The train loop
    # calls it on a port (PortCalls.call_each: served in turn, by `call_on_port_in_turn`), since a
    # mesh `.call()` leaves memory behind in the controller every step.
    @endpoint
    async def train_next_step(self, step: int, rollouts, num_ranks: int, prefetch_next: bool) -> PulledStep | None:
        """`train_step` on step `step`'s batch, which this rank takes from `rollouts` (the
        RolloutsActor) itself once the admission gate lets it go
        (`forge_rl.training.trainer_steps.train_on_pulled_batch`): the train loop sends this ahead, while the step
        before trains.
        `prefetch_next`: the train loop sends step + 1 next, so its batch is asked for as soon as
        this one's is in hand. `rollouts` comes with the loop's first step only, None after
        (BatchPrefetch keeps it). None if a stop withheld the batch."""
        return await train_pulled_batch_in_turn(
            self._turns,
            step,
            None if rollouts is None else PortCalled(rollouts, self._calls),
            num_ranks,
            self._train_pulled,
            self._prefetch,
            prefetch_next,
        )

    async def _train_pulled(self, columns: BatchColumns | None) -> TrainStepResult:
        """A step of `train_next_step`: its version is published after the reply (`_published`).
        No columns (its policy has nothing in the batch): nothing trains, nothing is published."""
        if columns is None:
            assert self.trainer is not None  # built by setup, which every rank runs first
            version = self.trainer.policy_version
            return TrainStepResult(
                version, True, None, {"step_skipped": 1.0, "policy_version": version, TRAINED_TOKENS: 0}
            )
        return await self._train_step(columns, publish_after_reply=True)

    @endpoint
    async def train_step(self, episodes: list[Episode]) -> TrainStepResult:
        """One optimizer step on `episodes`, then publish the new version to the weight store."""
        return await self._train_step(self._columns(episodes))

    def _columns(self, episodes: list[Episode]) -> BatchColumns:
        loss = self.config.loss
        return batch_columns(episodes, loss.normalize_advantage_std, loss.step_discount, loss.local_advantage_weight)

    @endpoint
    async def wait_for_publish(self) -> None:
        """The newest version's publish has taken its snapshot and handed it to the writer
        (raises what it raised): the train loop's last call, so an error there is the run's."""
        await self._published()

    async def _train_step(self, columns: BatchColumns, publish_after_reply: bool = False) -> TrainStepResult:
        """One optimizer step on the batch `columns`, then publish the new version to the weight store.

        `publish_after_reply`: the publish (the snapshot, a collective, then the hand-off to the
        writer) runs as soon as this step has answered, while the trainer waits for its next batch,
        instead of on the step's critical path; whatever next touches the weights waits for it
        first (`_published`). Its figures then come with the next step (TRAINER_PUBLISH_S: how long
        that step waited for it).

        A step whose loss or gradient was not finite is skipped: nothing is published and the
        version does not advance. Too many skips in a row raise FloatingPointError (see PolicyTrainer).
        """
        from forge_rl.core.batching import pad_columns

        assert self.trainer is not None  # built by setup, which every rank runs first
        publish_start = time.perf_counter()
        published_before = await self._published()
        waited_s = time.perf_counter() - publish_start
        started = time.perf_counter()
        batch = pad_columns(columns, self.pad_id)
        batching_s = time.perf_counter() - started
        metrics = self.trainer.train_step(batch)
        metrics["policy_version"] = self.trainer.policy_version
        metrics[TRAINER_BATCHING_S] = batching_s
        skipped = bool(metrics["step_skipped"])
        if publish_after_reply:
            weights_dir = None
            if not skipped:
                self._publishing = asyncio.ensure_future(self._publish())
                weights_dir = (
                    str(self.store_root / version_key(self.trainer.policy_version)) if self.rank == 0 else None
                )
            metrics[TRAINER_PUBLISH_S] = waited_s
            published_before.pop("weights/dir", None)
            return TrainStepResult(self.trainer.policy_version, skipped, weights_dir, metrics | published_before)
        publish_start = time.perf_counter()
        published = {} if skipped else await self._publish()
        metrics[TRAINER_PUBLISH_S] = time.perf_counter() - publish_start
        weights_dir = published.pop("weights/dir", None)
        return TrainStepResult(self.trainer.policy_version, skipped, weights_dir, metrics | published)

    async def _published(self) -> dict:
        """Waits for a publish started after a reply (`_train_step`); returns its figures, or {}."""
        publishing, self._publishing = self._publishing, None
        return {} if publishing is None else await publishing

    @endpoint
    async def compute_logprobs(self, episodes: list[Episode]) -> torch.Tensor:
        """Trainer logprobs [N, L] of the episodes' tokens under the current weights (for checks)."""
        from forge_rl.core.batching import pad_columns

        await self._published()
        assert self.trainer is not None  # built by setup, which every rank runs first
        return self.trainer.compute_logprobs(pad_columns(self._columns(episodes), self.pad_id))

    @endpoint
    async def save_checkpoint(self, path: str, written) -> dict:
        """Every rank writes its shards of the training state to the DCP checkpoint `path`
        (`forge_rl.core.checkpoint`) in the background: the endpoint returns once the state is copied
        to host memory, and the copy is written while the next steps train
        (PolicyTrainer.start_checkpoint). Rank 0 sends None on the port `written`
        (monarch.actor.Channel) once every rank's shards are written, or the error's text. Returns
        the policy version saved and how long the trainer was held (`checkpoint/save_s`)."""
        await self._published()  # its snapshot is a collective too: every rank takes it first
        assert self.trainer is not None  # built by setup, which every rank runs first
        started = time.perf_counter()
        write = self.trainer.start_checkpoint(path)
        if self.rank == 0:
            self._telling_written = asyncio.ensure_future(_tell_when_written(write, written))
        return {"policy_version": self.trainer.policy_version, "checkpoint/save_s": time.perf_counter() - started}

    @endpoint
    async def load_checkpoint(self, path: str) -> dict:
        """Restore the training state from the DCP checkpoint `path`, then publish its policy
        version to the weight store, so generators can serve it. Returns the version and, on rank 0,
        where its weights will be (`weights/dir`)."""
        await self._published()
        assert self.trainer is not None  # built by setup, which every rank runs first
        self.trainer.load_checkpoint(path)
        return {"policy_version": self.trainer.policy_version, **await self._publish()}

    async def _publish(self) -> dict:
        """Snapshot the weights (a collective), then write them in the background (rank 0)."""
        assert self.trainer is not None  # built by setup, which every rank runs first
        started = time.perf_counter()
        # Gathered once per version in the dtype the generator serves; private CPU copies, so the
        # next optimizer step cannot change them while they are written. Every rank joins the
        # gathers; only rank 0, which writes, copies the whole model to host memory.
        writes = self.rank == 0
        adapter = None
        if self.config.lora.enabled:
            # Adapters only: gathered on every rank (a collective under FSDP2/TP), full
            # on rank 0, converted there to the PEFT adapter directory vLLM loads.
            dtype = self.publish_config.torch_dtype()
            adapters = self.trainer.adapter_state_dict(dtype, keep=writes)
            if writes:
                from forge_rl.models.peft_format import peft_adapter

                snapshot, adapter_config = peft_adapter(adapters, self.config.lora, self.model_dir, dtype)
                adapter = (adapter_config, str(self.model_dir))
        else:
            snapshot = self.trainer.hf_state_dict(self.publish_config.torch_dtype(), keep=writes)
        snapshot_s = time.perf_counter() - started
        published = {}
        if writes:
            assert self.publisher is not None  # rank 0's, built by setup
            version = self.trainer.policy_version
            metrics = await self.publisher.publish(version, snapshot, snapshot_s, adapter)
            # Where the version will be once complete; generators wait for it through the store.
            published = {**metrics, "weights/dir": str(self.store_root / version_key(version))}
        # The free memory the step's gathers and snapshot leave, given back once a minute at most;
        # with `publish_after_reply`, after the step has answered, off its critical path.
        trim_native_heap_if_due()
        return published


async def _tell_when_written(write: concurrent.futures.Future, written) -> None:
    """Send None on the port `written` once `write` (a checkpoint's background write) is done, or
    its error's text; the trainer raises the error itself at its next checkpoint."""
    try:
        await asyncio.wrap_future(write)
    except Exception as e:  # noqa: BLE001 -- the controller reports it and fails the run
        written.send(f"{type(e).__name__}: {e}")
    else:
        written.send(None)
