"""The weight store's Monarch actors: one index for the run, one storage volume per host.

    StoreIndexActor        the catalogue (store/index.py): begin/commit, leases, waits, GC orders
    StorageVolumeActor     a host's /dev/shm snapshots: deletes them when the index says so, and
                           serves each as one RDMABuffer to readers on other hosts

Bytes never pass through the index. A writer on the volume's host writes the snapshot file
itself (store/shm.py) and only tells the index begin/commit; a reader on the same host maps the
file; a reader on another host reads it with one RDMA read from the volume (store/client.py).

Every index endpoint is concurrent: `wait_for_version` parks until a commit, and the others must
keep flowing meanwhile. The index's state is only touched between awaits, on one event loop.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from monarch.actor import Actor, concurrent_endpoint, endpoint, get_or_spawn_controller

from forge_rl.core.deadlines import within
from forge_rl.errors import StoreError
from forge_rl.plumbing.native_heap import trim_native_heap_if_due
from forge_rl.plumbing.port_calls import PortCalls, PortServed
from forge_rl.store.index import SnapshotRecord, VersionIndex


def location_of(root: Path | str, host: str | None = None) -> str:
    """A volume's name: "host:/dev/shm/forge_rl-run". Same host = same first part."""
    return f"{host or socket.gethostname()}:{Path(root)}"


def split_location(location: str) -> tuple[str, Path]:
    host, _, root = location.partition(":")
    return host, Path(root)


def index_name(root: Path | str) -> str:
    """The index's Monarch name (a singleton per store root, so per run)."""
    return f"forge_rl.store.index:{Path(root)}"


async def open_store(root: Path | str, extra_files_dir: Path | str | None = None, keep_latest: int = 1, procs=None):
    """The store of `root`: its index (spawned once, found by name from any actor) and a storage
    volume for `root`, registered with the index. Call it where the snapshots will be written
    (the trainer's host); `procs` puts the volume on that mesh (default: the controller's process).
    Returns (index, volume)."""
    index = await get_or_spawn_controller(index_name(root), StoreIndexActor, keep_latest)
    name = f"{index_name(root)}:volume"
    extra = str(extra_files_dir) if extra_files_dir else None
    if procs is None:
        volume = await get_or_spawn_controller(name, StorageVolumeActor, str(root), extra)
    else:
        volume = procs.spawn("store_volume", StorageVolumeActor, str(root), extra)
    await index.register_volume.call_one(location_of(root), volume)
    return index, volume


async def spawn_store(
    procs, root: Path | str, extra_files_dir: Path | str | None = None, keep_latest: int = 1, volume_procs=None
):
    """A run's store on `procs`: its index and a volume, owned by the owner of `procs`, so they
    stop with the run (unlike `open_store`'s process-wide singletons, which outlive it). The volume
    goes on `volume_procs` (default `procs`), which must be on the writer's host: it serves the
    files written there to readers on other hosts, and registers under its own host's name.
    Pass the returned index to every reader and writer. Returns (index, volume)."""
    index = procs.spawn("store_index", StoreIndexActor, keep_latest)
    extra = str(extra_files_dir) if extra_files_dir else None
    volume = (volume_procs or procs).spawn("store_volume", StorageVolumeActor, str(root), extra)
    await index.register_volume.call_one(await volume.location.call_one(), volume)
    return index, volume


async def find_index(root: Path | str) -> StoreIndexActor:
    """The index `open_store(root)` made (by name: works from any actor of the job)."""
    return await get_or_spawn_controller(index_name(root), StoreIndexActor)


class StoreIndexActor(PortServed, Actor):
    """Readers and writers call it on ports (`PortCalls`): a generator leases every version and a
    trainer commits every version, so a long run makes millions of these calls."""

    def __init__(self, keep_latest: int = 1):
        self.index = VersionIndex(keep_latest)
        self._calls = PortCalls()  # the volumes' `delete`
        self.volumes: dict[str, StorageVolumeActor] = {}
        self._changed: asyncio.Condition | None = None
        self.num_deleted = 0
        self.num_waiting = 0
        """Calls waiting for a policy version that is not complete yet (`wait_for_version`, `acquire_newest`)."""

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # bound to the actor's running loop on first use
            self._changed = asyncio.Condition()
        return self._changed

    @concurrent_endpoint
    async def register_volume(self, location: str, volume: StorageVolumeActor) -> None:
        self.volumes[location] = volume

    @concurrent_endpoint
    async def begin(self, key: str, location: str) -> None:
        self.index.begin(key, location)

    @concurrent_endpoint
    async def commit(self, key: str, num_bytes: int, info: dict | None = None) -> list[str]:
        collectable = self.index.commit(key, num_bytes, info)
        async with self.changed:
            self.changed.notify_all()
        trim_native_heap_if_due()  # once a minute at most
        return await self._collect(collectable)

    @concurrent_endpoint
    async def abort(self, key: str) -> None:
        self.index.abort(key)

    @concurrent_endpoint
    async def add_location(self, key: str, location: str) -> None:
        self.index.add_location(key, location)

    @concurrent_endpoint
    async def acquire(self, reader: str, key: str | None = None) -> dict:
        """Lease `key` (default: the newest policy version); returns what a reader needs."""
        return _describe(self.index.acquire(reader, key))

    @concurrent_endpoint
    async def reserve(self, reader: str, version: int) -> bool:
        """Lease policy version `version` now, or the moment it commits (index rule 3a)."""
        return self.index.reserve(reader, version)

    @concurrent_endpoint
    async def cancel_reservation(self, reader: str, version: int) -> list[str]:
        return await self._collect(self.index.cancel_reservation(reader, version))

    @concurrent_endpoint
    async def release(self, reader: str, key: str) -> list[str]:
        return await self._collect(self.index.release(reader, key))

    @concurrent_endpoint
    async def drop_reader(self, reader: str) -> list[str]:
        return await self._collect(self.index.drop_reader(reader))

    @concurrent_endpoint
    async def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int:
        """The newest complete policy version once it is >= `min_version`."""
        await self._wait_for(min_version, timeout_s)
        latest = self.index.latest_version()
        assert latest is not None  # _wait_for returns once a version >= min_version is complete
        return latest

    @concurrent_endpoint
    async def acquire_newest(self, reader: str, min_version: int, timeout_s: float | None = None) -> dict:
        """Wait for a version >= `min_version`, then lease the newest, in one step: between a
        separate wait and acquire, a newer commit could collect the version waited for."""
        await self._wait_for(min_version, timeout_s)
        return _describe(self.index.acquire(reader))

    async def _wait_for(self, min_version: int, timeout_s: float | None) -> None:
        def ready() -> bool:
            latest = self.index.latest_version()
            return latest is not None and latest >= min_version

        self.num_waiting += 1
        try:
            async with self.changed:
                waiting = self.changed.wait_for(ready)
                await (waiting if timeout_s is None else within(timeout_s, waiting))
        finally:
            self.num_waiting -= 1

    @concurrent_endpoint
    async def latest_version(self) -> int | None:
        return self.index.latest_version()

    @concurrent_endpoint
    async def keys(self, prefix: str | None = None) -> list[str]:
        return self.index.keys(prefix)

    @concurrent_endpoint
    async def exists(self, key: str) -> bool:
        return self.index.exists(key)

    @concurrent_endpoint
    async def delete(self, key: str) -> list[str]:
        return await self._collect(self.index.delete(key))

    @concurrent_endpoint
    async def volume(self, location: str) -> StorageVolumeActor:
        try:
            return self.volumes[location]
        except KeyError:
            raise StoreError(f"no storage volume registered at {location!r} (have {sorted(self.volumes)})") from None

    @concurrent_endpoint
    async def describe(self) -> dict:
        """Every snapshot: state, locations, holders, bytes; and counts of deleted snapshots and of
        calls waiting for a version (for logs and tests)."""
        return {
            key: {**_describe(record), "state": record.state.value} for key, record in self.index._records.items()
        } | {"_deleted": self.num_deleted, "_waiting": self.num_waiting}

    async def _collect(self, keys: list[str]) -> list[str]:
        # Forget every record before the first await, so no reader can lease one meanwhile.
        records = [self.index.forget(key) for key in keys]
        for record in records:
            for location in record.locations:
                volume = self.volumes.get(location)
                if volume is not None:
                    await self._calls.call(volume, "delete", record.key)
        self.num_deleted += len(records)
        return keys


class StorageVolumeActor(PortServed, Actor):
    """The snapshots under one /dev/shm directory of one host."""

    def __init__(self, root: str, extra_files_dir: str | None = None):
        # Imported here: it needs torch, which the processes holding a handle to the store's actors
        # (the rollouts', through the generator pool) do not.
        from forge_rl.store.shm import SharedMemorySnapshots

        self.snapshots = SharedMemorySnapshots(Path(root), Path(extra_files_dir) if extra_files_dir else None)
        self._rdma: dict[str, tuple] = {}  # key -> (RDMABuffer, the mapped file it reads from)

    @endpoint
    async def location(self) -> str:
        return location_of(self.snapshots.root)

    @endpoint
    async def rdma_buffer(self, key: str):
        """One RDMABuffer over the whole snapshot file (registered once per key)."""
        if key not in self._rdma:
            import torch
            from monarch.rdma import RDMABuffer

            num_bytes = self.snapshots.file(key).stat().st_size
            mapped = torch.from_file(str(self.snapshots.file(key)), shared=False, size=num_bytes, dtype=torch.uint8)
            self._rdma[key] = (RDMABuffer(mapped), mapped)
        buffer, mapped = self._rdma[key]
        return buffer, mapped.numel()

    @concurrent_endpoint
    async def delete(self, key: str) -> None:
        """Called once per key (the index forgets a record before it deletes it)."""
        registered = self._rdma.pop(key, None)
        if registered is not None:
            await registered[0].drop()
        self.snapshots.delete(key)

    @endpoint
    async def keys(self) -> list[str]:
        return self.snapshots.keys()

    @endpoint
    async def destroy(self) -> None:
        for buffer, _ in self._rdma.values():
            await buffer.drop()
        self._rdma.clear()
        self.snapshots.destroy()


def _describe(record: SnapshotRecord) -> dict:
    return {
        "key": record.key,
        "version": record.version,
        "locations": sorted(record.locations),
        "num_bytes": record.num_bytes,
        "info": record.info,
        "adapter_of": record.adapter_of,
        "holders": dict(record.holders),
    }
