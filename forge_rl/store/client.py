"""`WeightStore`: the client every process uses, with torchstore's interface.

    store = WeightStore(index, root)                    # index: a StoreIndexActor
    await store.put_state_dict(state_dict, "v00000003")  # write to this host's /dev/shm, commit
    await store.get_state_dict("v00000003")              # a copy (or into user_state_dict)
    await store.put("bias", tensor); await store.get("bias")
    await store.keys("v"), await store.exists(key), await store.delete(key)

and, for policy versions (keys `version_key(v)`), what generators need:

    async with store.lease(min_version=3) as snapshot:   # waits; leases the newest >= 3
        snapshot.version, snapshot.path        # a local /dev/shm directory vLLM can load
                                               # (never deleted while the lease is held)

Transports, chosen per read: "shm" maps the writer's file when the snapshot has a location on
this host (no copy at all); "rdma" reads the whole file with one `RDMABuffer.read_into` from the
storage volume that holds it into a file of this host's own /dev/shm (the prefetch), then maps
that. "auto" takes shm when it can. torchstore semantics kept: a key is written once (delete it
to write it again); `get(key)` of a one-tensor snapshot returns the tensor, `get("key/name")` one
tensor of a state dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from forge_rl.plumbing.port_calls import BlockingPortCalls, PortCalls
from forge_rl.store.actors import location_of, split_location
from forge_rl.store.host_copies import HostCopies
from forge_rl.store.index import ADAPTER_OF, key_version, version_key
from forge_rl.store.shm import SharedMemorySnapshots, WriteStats

Transport = Literal["auto", "shm", "rdma"]
_SINGLE_TENSOR = "tensor"  # the name of the one tensor of a `put(key, tensor)` snapshot
_clients = itertools.count()
# Record `info` keys: files written beside the weights (name -> text), and names linked to them.
FILES = "files"
WEIGHTS_LINKS = "weights_links"


@dataclass
class LocalSnapshot:
    """A leased snapshot, readable on this host for as long as the lease is held."""

    key: str
    version: int | None
    path: Path
    """Directory with model.safetensors (+ config.json): what vLLM's reload_weights takes."""
    num_bytes: int
    info: dict
    """The writer's metadata: timings (`publish_started_at` wall clock), checksums flag."""
    transport: str
    """"shm" (mapped in place) or "rdma" (fetched to this host)."""
    fetch_s: float = 0.0
    """Seconds until this host's copy was readable: its RDMA fetch, or the wait for another
    reader's fetch of it (0 for shm)."""
    fetched_bytes: int = 0
    """Bytes this lease moved between hosts: the snapshot's when it fetched this host's copy, 0 when
    it mapped a copy another reader here had fetched (store/host_copies.py), or with shm."""
    snapshots: SharedMemorySnapshots = field(repr=False, kw_only=True)
    holder: str | None = field(repr=False, default=None)
    """Its hold on this host's copy (rdma)."""

    def open(self):
        """Zero-copy tensors (a context manager)."""
        return self.snapshots.open(self.key)

    def verify(self) -> dict[str, int]:
        """The checksum of every tensor, checked against the writer's; raises ChecksumError."""
        return self.snapshots.verify(self.key)


class WeightStore:
    """A client of one store: its index actor and this host's shared-memory directory."""

    def __init__(
        self,
        index,
        root: Path | str,
        client_id: str | None = None,
        transport: Transport = "auto",
        extra_files_dir: Path | str | None = None,
        checksum: bool = True,
    ):
        self.index = index
        self._calls = PortCalls()
        """The index's calls (`forge_rl.plumbing.port_calls`): a reader leases every version it loads."""
        self._blocking_calls = BlockingPortCalls()
        """The same for `put_state_dict_blocking`, which runs in a writer thread without an event loop."""
        self.local = SharedMemorySnapshots(Path(root), Path(extra_files_dir) if extra_files_dir else None)
        self.location = location_of(root)
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{next(_clients)}"
        self.transport = transport
        self.checksum = checksum
        """Writers record a checksum per tensor (XXH3-64, faster than memcpy) for readers to verify."""
        self._host_copies: HostCopies | None = None
        self._extra_files_dir = Path(extra_files_dir) if extra_files_dir else None

    # torchstore's interface ---------------------------------------------------------------------

    async def put(self, key: str, value: torch.Tensor) -> WriteStats:
        return await self.put_state_dict({_SINGLE_TENSOR: value}, key)

    async def get(self, key: str, inplace_tensor: torch.Tensor | None = None) -> torch.Tensor:
        snapshot_key, _, name = key.partition("/")
        async with self.lease(snapshot_key) as snapshot:
            with snapshot.open() as tensors:
                tensor = tensors[name or _single_name(tensors, key)]
                return inplace_tensor.copy_(tensor) if inplace_tensor is not None else tensor.clone()

    async def put_state_dict(
        self, state_dict: dict[str, torch.Tensor], key: str, dtype: torch.dtype | None = None, info: dict | None = None
    ) -> WriteStats:
        """Write `state_dict` (in `dtype` if given) as snapshot `key`; readable once this returns.

        The bytes are copied in a worker thread, so the caller's event loop keeps running.
        """
        return await asyncio.to_thread(self.put_state_dict_blocking, state_dict, key, dtype, info)

    def put_state_dict_blocking(
        self, state_dict: dict[str, torch.Tensor], key: str, dtype: torch.dtype | None = None, info: dict | None = None
    ) -> WriteStats:
        """`put_state_dict` for a plain thread: its index calls block instead of awaiting, so it
        completes even while the owning actor's event loop is busy (a training step runs there).

        `info[FILES]` (name -> text) and `info[WEIGHTS_LINKS]` go into the snapshot's directory
        beside the weights (`SharedMemorySnapshots.write`), and travel in the record to readers
        that fetch the snapshot to another host."""
        info = {"publish_started_at": time.time(), **(info or {})}
        begun = self._blocking_calls.submit(
            self.index, "begin", key, self.location
        )  # its round trip overlaps the write
        try:
            stats = self.local.write(
                key,
                state_dict,
                dtype,
                self.checksum,
                files=info.get(FILES),
                weights_links=tuple(info.get(WEIGHTS_LINKS, ())),
            )
            begun.result()
        except BaseException:
            self._blocking_calls.call(self.index, "abort", key)
            raise
        info.update(
            write_s=stats.write_s,
            recycled=stats.recycled,
            checksums=bool(stats.layout.checksums),
            committed_at=time.time(),
        )
        self._blocking_calls.call(self.index, "commit", key, stats.num_bytes, info)
        return stats

    async def get_state_dict(
        self, key: str, user_state_dict: dict[str, torch.Tensor] | None = None, strict: bool = True
    ) -> dict[str, torch.Tensor]:
        """A copy of snapshot `key`, or its tensors copied into `user_state_dict` (returned)."""
        async with self.lease(key) as snapshot:
            with snapshot.open() as tensors:
                if user_state_dict is None:
                    return {name: tensor.clone() for name, tensor in tensors.items()}
                if strict and set(user_state_dict) != set(tensors):
                    missing, extra = set(user_state_dict) - set(tensors), set(tensors) - set(user_state_dict)
                    raise KeyError(
                        f"snapshot {key!r} and user_state_dict differ: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(extra)[:3]} (pass strict=False to copy the overlap)"
                    )
                await asyncio.to_thread(_copy_into, user_state_dict, tensors)
                return user_state_dict

    async def keys(self, prefix: str | None = None) -> list[str]:
        return await self._calls.call(self.index, "keys", prefix)

    async def exists(self, key: str) -> bool:
        return await self._calls.call(self.index, "exists", key)

    async def delete(self, key: str) -> None:
        """Delete `key` now, or once the last reader releases it."""
        await self._calls.call(self.index, "delete", key)

    # Policy versions ----------------------------------------------------------------------------

    async def publish(self, policy_version: int, state_dict: dict[str, torch.Tensor], **kwargs) -> WriteStats:
        return await self.put_state_dict(state_dict, version_key(policy_version), **kwargs)

    def publish_blocking(self, policy_version: int, state_dict: dict[str, torch.Tensor], **kwargs) -> WriteStats:
        return self.put_state_dict_blocking(state_dict, version_key(policy_version), **kwargs)

    def publish_adapter_blocking(
        self,
        policy_version: int,
        peft_tensors: dict[str, torch.Tensor],
        adapter_config: dict,
        base: str,
        info: dict | None = None,
    ) -> WriteStats:
        """Publish policy version `policy_version` as LoRA adapters only: its directory is a PEFT
        adapter directory (adapter_config.json + adapter_model.safetensors, a link to the store's
        weights file) that vLLM loads by path, and its record says it is an adapter of `base`
        (index rule 5). `peft_tensors` in PEFT names (`forge_rl.models.peft_format`)."""
        from forge_rl.models.peft_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

        info = {
            **(info or {}),
            ADAPTER_OF: base,
            FILES: {ADAPTER_CONFIG_FILE: json.dumps(adapter_config, indent=2)},
            WEIGHTS_LINKS: [ADAPTER_WEIGHTS_FILE],
        }
        return self.put_state_dict_blocking(peft_tensors, version_key(policy_version), info=info)

    async def latest_version(self) -> int | None:
        return await self._calls.call(self.index, "latest_version")

    async def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int:
        return await self._calls.call(self.index, "wait_for_version", min_version, timeout_s)

    async def reserve(self, policy_version: int) -> bool:
        """Hold `policy_version` from now on, or from the moment it commits if it has not yet (index
        rule 3a): no later commit can collect it until `cancel_reservation`. True if it is held now."""
        return await self._calls.call(self.index, "reserve", self.client_id, policy_version)

    async def cancel_reservation(self, policy_version: int) -> None:
        """Give up a reservation (and the hold it took, if the version committed)."""
        await self._calls.call(self.index, "cancel_reservation", self.client_id, policy_version)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        key: str | None = None,
        transport: Transport | None = None,
        min_version: int | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[LocalSnapshot]:
        """Hold snapshot `key` readable on this host. Without a key: the newest policy version,
        once one >= `min_version` is complete (waiting for it, then leasing it, atomically)."""
        if key is None and min_version is not None:
            record = await self._calls.call(self.index, "acquire_newest", self.client_id, min_version, timeout_s)
        else:
            record = await self._calls.call(self.index, "acquire", self.client_id, key)
        key = record["key"]
        snapshot = None
        try:
            snapshot = await self._localize(record, transport or self.transport)
            yield snapshot
        finally:
            if snapshot is not None and snapshot.holder is not None:
                await self._copies().release(key, snapshot.holder)
            await self._calls.call(self.index, "release", self.client_id, key)

    async def close(self) -> None:
        """Release every lease this client still holds (a reader that stops)."""
        await self._calls.call(self.index, "drop_reader", self.client_id)
        if self._host_copies is not None:
            await self._host_copies.close()

    # Transports ---------------------------------------------------------------------------------

    async def _localize(self, record: dict, transport: Transport) -> LocalSnapshot:
        key, host = record["key"], socket.gethostname()
        local = [loc for loc in record["locations"] if split_location(loc)[0] == host]
        if transport != "rdma" and local:
            snapshots = SharedMemorySnapshots(split_location(local[0])[1], create=False)
            return LocalSnapshot(
                key,
                key_version(key),
                snapshots.path(key),
                record["num_bytes"],
                record["info"],
                "shm",
                snapshots=snapshots,
            )
        if transport == "shm":
            raise FileNotFoundError(
                f"snapshot {key!r} has no copy on host {host} ({record['locations']}); use transport='rdma' or 'auto'"
            )
        return await self._fetch_rdma(record)

    async def _fetch_rdma(self, record: dict) -> LocalSnapshot:
        """This host's copy of the snapshot: the first reader here reads the whole file from its
        volume into this host's /dev/shm (one RDMA read); the others map that copy."""
        key, info = record["key"], record["info"]
        started = time.perf_counter()

        async def fetch(snapshots: SharedMemorySnapshots) -> None:
            volume = await self._calls.call(self.index, "volume", record["locations"][0])
            buffer, num_bytes = await volume.rdma_buffer.call_one(key)
            destination = snapshots.reserve(key, num_bytes)
            try:
                await buffer.read_into(destination)
            except BaseException:
                snapshots.discard_reserved(key)
                raise
            del destination
            snapshots.commit_reserved(key, info.get(FILES), tuple(info.get(WEIGHTS_LINKS, ())))

        copies = self._copies()
        holder, fetched = await copies.acquire(key, fetch)
        return LocalSnapshot(
            key,
            key_version(key),
            copies.snapshots.path(key),
            record["num_bytes"],
            info,
            "rdma",
            fetch_s=time.perf_counter() - started,
            fetched_bytes=record["num_bytes"] if fetched else 0,
            snapshots=copies.snapshots,
            holder=holder,
        )

    def _copies(self) -> HostCopies:
        """This host's directory of snapshots fetched from other hosts, shared by its readers."""
        if self._host_copies is None:
            root = self.local.root.parent / f"{self.local.root.name}-fetched-host"
            self._host_copies = HostCopies(root, self.client_id, self._extra_files_dir)
        return self._host_copies


def _single_name(tensors: dict[str, torch.Tensor], key: str) -> str:
    if _SINGLE_TENSOR in tensors and len(tensors) == 1:
        return _SINGLE_TENSOR
    raise KeyError(f"{key!r} holds {len(tensors)} tensors; get one as '{key}/<name>' or use get_state_dict")


def _copy_into(destination: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in source.items():
            if name in destination:
                destination[name].copy_(tensor)
