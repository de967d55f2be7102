"""Snapshots fetched from another host, one copy per host shared by every reader there.

Without it each reader (a generator) on a remote host fetched every version into a directory of
its own: N generators on a host moved each version across the network N times and held N copies
in its shared memory. Now the first reader of a version on a host fetches it into the host's copy
directory; the others wait for that fetch and map the same files.

    <root>/v00000003/...          a complete copy (SharedMemorySnapshots layout)
    <root>/.locks/<key>           flock'ed while a reader fetches or lets go of <key>
    <root>/.holders/<key>/<id>    one file per lease on <key>: {"host", "pid", "start_ticks"}
    <root>/.clients/<id>          one file per reader (WeightStore) using the directory

Which copies stay: a copy nobody holds is kept while it is the newest on the host, so a reader
that asks for that version just after another let go of it maps it instead of fetching it again
(the readers of one host are told of a version at about the same time, but not exactly); it goes
once a newer version's copy is complete here. The last reader to close removes the directory.
Holders and readers whose process died (pid and start time, as for store roots) count as gone, so
a killed generator's lease does not keep a copy forever.

Locks are flock(2) on per-key files, taken without blocking and retried every _LOCK_POLL_S, so a
waiting reader never holds its event loop and a cancelled wait leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from forge_rl.store.index import key_version
from forge_rl.store.shm import FREE_DIR, SharedMemorySnapshots, is_alive, read_owner, this_process

_LOCKS, _HOLDERS, _CLIENTS = ".locks", ".holders", ".clients"
_DIRECTORY_LOCK = ".directory"
"""Lock of the directory itself: taken to register or unregister a reader and to remove it."""
_LOCK_POLL_S = 0.005


class HostCopies:
    """The fetched-snapshot directory of one store on this host, as one reader (`client_id`) uses it."""

    def __init__(self, root: Path, client_id: str, extra_files_dir: Path | None = None):
        self.root = Path(root)
        self.client_id = client_id
        self.snapshots = SharedMemorySnapshots(self.root, extra_files_dir)
        for name in (_LOCKS, _HOLDERS, _CLIENTS):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self._leases = 0
        self._registered = False

    async def acquire(self, key: str, fetch: Callable[[SharedMemorySnapshots], Awaitable[None]]) -> tuple[str, bool]:
        """Hold this host's copy of `key`, calling `fetch(snapshots)` to make it (reserve, fill,
        commit) when there is none yet. Returns (holder id, whether this call fetched it); give
        the holder id back to `release`."""
        await self._register()
        self._leases += 1
        holder = f"{self.client_id}-{self._leases}"
        async with self._locked(key):
            fetched = not self.snapshots.exists(key)
            if fetched:
                await fetch(self.snapshots)
            holders = self.root / _HOLDERS / key
            holders.mkdir(exist_ok=True)
            (holders / holder).write_text(json.dumps(this_process()))
        if fetched:
            await self._drop_older_than(key)
        return holder, fetched

    async def release(self, key: str, holder: str) -> None:
        """Let go of `key`; its copy goes once nobody holds it and a newer copy is here."""
        async with self._locked(key):
            (self.root / _HOLDERS / key / holder).unlink(missing_ok=True)
            if self._newer_than(key):
                self._delete_if_unheld(key)

    async def close(self) -> None:
        """This reader is done; the last one removes the directory."""
        if not self._registered:
            return
        async with self._locked(_DIRECTORY_LOCK):
            (self.root / _CLIENTS / self.client_id).unlink(missing_ok=True)
            if not _live_entries(self.root / _CLIENTS):
                shutil.rmtree(self.root, ignore_errors=True)
        self._registered = False

    async def _register(self) -> None:
        if self._registered:
            return
        async with self._locked(_DIRECTORY_LOCK):
            for name in (_LOCKS, _HOLDERS, _CLIENTS):  # the last reader may have just removed it
                (self.root / name).mkdir(parents=True, exist_ok=True)
            (self.root / FREE_DIR).mkdir(parents=True, exist_ok=True)
            (self.root / _CLIENTS / self.client_id).write_text(json.dumps(this_process()))
        self._registered = True

    async def _drop_older_than(self, key: str) -> None:
        version = key_version(key)
        for older in self.snapshots.keys():
            older_version = key_version(older)
            if older_version is not None and version is not None and older_version < version:
                async with self._locked(older):
                    self._delete_if_unheld(older)

    def _newer_than(self, key: str) -> bool:
        version = key_version(key)
        return version is not None and any((key_version(k) or -1) > version for k in self.snapshots.keys())

    def _delete_if_unheld(self, key: str) -> None:
        """Called with `key`'s lock held."""
        holders = self.root / _HOLDERS / key
        if not _live_entries(holders):
            self.snapshots.delete(key)
            shutil.rmtree(holders, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def _locked(self, name: str) -> AsyncIterator[None]:
        (self.root / _LOCKS).mkdir(parents=True, exist_ok=True)  # the last reader may have removed it
        fd = os.open(self.root / _LOCKS / name, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(_LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock


def _live_entries(directory: Path) -> list[Path]:
    """The entries of a holders or readers directory whose process lives; the others are removed."""
    live = []
    for entry in directory.glob("*") if directory.is_dir() else ():
        owner = read_owner(entry)
        if owner is None or is_alive(owner):  # None: being written, so its writer lives
            live.append(entry)
        else:
            entry.unlink(missing_ok=True)
    return live
