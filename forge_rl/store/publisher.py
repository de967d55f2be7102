"""The trainer's side: publish version v without holding up step v+1.

    step v ──▶ snapshot (gather once, copy to CPU in the served dtype) ──▶ return: step v+1 starts
                    └──▶ worker thread: copy into /dev/shm, checksum ──▶ index.commit(v)

Only the snapshot is synchronous. It must be: the next optimizer step overwrites the parameters,
and sharded (FSDP/TP) parameters are gathered by a collective every rank joins in order. The full
state dict is gathered once per version, whatever the number of generators, and written once;
every generator on the host maps the same file, and generators on other hosts read it over RDMA.

The writer is a plain thread, not an asyncio task: the trainer actor runs its (synchronous)
training step on its event loop, and the write, the checksums and the index commit must not wait for
that step to end. The thread's index calls block on their replies instead of awaiting them.

At most one write is in flight: if version v is still being written when v+1 is published (a
trainer faster than its memory bandwidth), publishing v+1 first waits for it
(`weights/publish_wait_s`), so memory holds at most two snapshots in staging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # PublishConfig is read by the controller and the CLI, which need no torch
    import torch


@dataclass(frozen=True)
class PublishConfig:
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of published weights. "auto": the dtype the generator serves, bfloat16 with CUDA
    and float32 on CPU (VLLMEngine's choice), so the engine never converts on load."""
    background: bool = True
    """Write to shared memory in a worker thread while the next step trains; False writes before
    train_step returns (what `forge-rl bench weight-sync` compares)."""
    checksum: bool = True
    """Record a checksum per tensor (XXH3-64, faster than the copy, in the writer thread) for readers to verify."""

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return getattr(torch, self.dtype)


class WeightPublisher:
    """Publishes policy versions through a `WeightStore`; one per trainer rank that writes."""

    def __init__(self, store, config: PublishConfig = PublishConfig()):
        self.store = store
        self.config = config
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-publish")
        self._pending: concurrent.futures.Future | None = None
        self._last_write: dict = {}

    async def publish(
        self,
        policy_version: int,
        snapshot: dict[str, torch.Tensor],
        snapshot_s: float,
        adapter: tuple[dict, str] | None = None,
    ) -> dict:
        """Start writing `snapshot` (private CPU tensors) as `policy_version`; returns metrics.

        `adapter` = (adapter_config.json, base model directory) publishes an adapter version
        (LoRA; `snapshot` in PEFT names): `WeightStore.publish_adapter_blocking`.
        The metrics describe this publish's synchronous part and the last finished write.
        """
        waited = time.perf_counter()
        await self.flush()
        wait_s = time.perf_counter() - waited
        info = {"snapshot_s": snapshot_s, "policy_version": policy_version}
        self._pending = self._writer.submit(self._write, policy_version, snapshot, info, adapter)
        if not self.config.background:
            await self.flush()
        return {
            "weights/snapshot_s": snapshot_s,
            "weights/publish_wait_s": wait_s,
            "weights/bytes": sum(t.numel() * t.element_size() for t in snapshot.values()),
            **self._last_write,
        }

    @property
    def last_write(self) -> dict:
        """Metrics of the last finished write (weights/write_s, write_gbps, written_version)."""
        return dict(self._last_write)

    async def flush(self) -> None:
        """Wait for the write in flight, if any (raises what it raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await asyncio.wrap_future(pending)

    def _write(self, policy_version: int, snapshot: dict[str, torch.Tensor], info: dict, adapter) -> None:
        if adapter is None:
            stats = self.store.publish_blocking(policy_version, snapshot, info=info)
        else:
            stats = self.store.publish_adapter_blocking(policy_version, snapshot, *adapter, info=info)
        self._last_write = {
            "weights/write_s": stats.write_s,
            "weights/write_gbps": stats.num_bytes / max(stats.write_s, 1e-9) / 1e9,
            "weights/written_version": policy_version,
        }
