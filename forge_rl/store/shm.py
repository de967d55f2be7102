"""Snapshots in host shared memory (/dev/shm files): the same-host transport of the weight store.

Layout under `root` (one per launch of a run, `default_store_root`):

    .owner                         {"host", "pid", "start_ticks"} of the launch's controller
    v00000003/model.safetensors    one flat buffer in the safetensors format (store/layout.py)
    v00000003/config.json          copied from `extra_files_dir` (vLLM's reload reads it)
    v00000004.partial/...          being written; never read
    .free/<n>.bin                  files of deleted snapshots, kept for reuse

A snapshot is written into `<key>.partial/` and renamed into place, so a reader that sees `<key>/`
sees a complete snapshot (rename is atomic within one filesystem). The writer maps the file and
copies each tensor straight into its slot: one memcpy per tensor, dtype conversion fused in.

Why recycle files and keep mappings: the first write to a fresh tmpfs page faults and zeroes it,
and every page of a fresh mapping faults once more to enter the page table. Writing into a fresh
/dev/shm file runs several times slower than memcpy, and into an existing file through a fresh
mapping (reading too) still well below it; only through a mapping kept from before do writes and
reads run at about memcpy's speed. So a deleted snapshot's file moves to `.free/`, the next
write of about the same size takes it (`max_free_files` bounds the pool), and every process keeps
its mappings per inode (`map_file`), so a recycled file is written and read through page tables
that already exist. A mapping is dropped once its file is unlinked (its pages are then freed).
Deleting is safe only once no reader holds the snapshot: the index's leases decide that
(store/index.py), never this class.
"""

from __future__ import annotations

import concurrent.futures
import glob
import itertools
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forge_rl.store.layout import (
    SAFETENSORS_FILE,
    SnapshotLayout,
    header_length,
    layout_of,
    parse_header,
    tensor_checksum,
)

if TYPE_CHECKING:
    import torch
# torch is imported by the methods that touch tensors: the run's controller (which makes and
# removes the root) and the services' process (the volume serves files) import this module and
# hold no tensor, and torch's import costs seconds of CPU at every run's start.

_PARTIAL = ".partial"
FREE_DIR = ".free"
_OWNER_FILE = ".owner"
# Files next to the weights that vLLM's reload_weights needs (it re-reads the model config).
EXTRA_FILES = ("config.json", "generation_config.json")


def default_store_root(run_name: str, base: Path | None = None) -> Path:
    """A new, empty store root for this launch of run `run_name`, owned by this process.

    In host shared memory where the OS has it (Linux), else a temp directory (or `base`). Named
    per launch (`forge_rl-<run>-<pid>-<nonce>`), not per run: after a crash the dead launch's root
    is still there with its versions, and a resumed run republishes those version numbers.
    First removes the roots of launches whose owner is dead (`sweep_stale_roots`), since a
    killed controller never runs its cleanup; the owner is recorded in the root (`.owner`).
    """
    base = Path(base) if base is not None else _store_base()
    sweep_stale_roots(base)
    root = base / f"forge_rl-{run_name}-{os.getpid()}-{secrets.token_hex(4)}"
    root.mkdir(parents=True)
    partial = root / (_OWNER_FILE + _PARTIAL)
    partial.write_text(json.dumps(this_process()))
    partial.rename(root / _OWNER_FILE)  # a sweeper sees a complete record or none
    return root


def sweep_stale_roots(base: Path) -> list[Path]:
    """Remove the store roots under `base` whose owning process is dead, with the caches of
    snapshots fetched from other hosts named after them (`<root>-fetched-host`); returns what was removed.

    A root is removed only when its `.owner` says it belongs to this host and that process is
    gone (or its pid now names a process started later). A root with no owner record (being
    created, or written before owners were recorded) or another host's is left alone.
    """
    removed = []
    for root in sorted(Path(base).glob("forge_rl-*")):
        owner = read_owner(root / _OWNER_FILE)
        if owner is None or is_alive(owner):
            continue
        for path in [root, *Path(base).glob(glob.escape(root.name) + "-fetched-*")]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        _MAPPINGS.drop_unlinked()
    return removed


def _store_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid())}


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None
    where /proc is absent. Tells a live owner from a later process that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name start at 3


def read_owner(path: Path) -> dict | None:
    """The owner record (`this_process`) written at `path`; None if absent or not complete yet."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_alive(owner: dict) -> bool:
    """Whether the process an owner record (`this_process`) names still runs; another host's: assumed."""
    if owner.get("host") != socket.gethostname():
        return True  # another host's process: nothing here can tell
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return True  # not a pid we wrote: leave the root alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    except OverflowError:
        return True  # not a pid we wrote: leave the root alone
    recorded = owner.get("start_ticks")
    return recorded is None or _start_ticks(pid) in (None, recorded)


@dataclass(frozen=True)
class WriteStats:
    key: str
    num_bytes: int
    """Bytes of the file (header + tensors)."""
    write_s: float
    recycled: bool
    """Whether the file reused a deleted snapshot's pages (see the module docstring)."""
    layout: SnapshotLayout


class SharedMemorySnapshots:
    """Complete, immutable snapshots under one directory of host shared memory."""

    def __init__(self, root: Path, extra_files_dir: Path | None = None, max_free_files: int = 2, create: bool = True):
        self.root = Path(root)
        self.extra_files_dir = Path(extra_files_dir) if extra_files_dir else None
        self.max_free_files = max_free_files
        if create:  # a reader of another process's directory passes create=False
            (self.root / FREE_DIR).mkdir(parents=True, exist_ok=True)
        self._names = itertools.count()

    def path(self, key: str) -> Path:
        """Directory of a complete snapshot (what vLLM's reload_weights takes)."""
        return self.root / key

    def file(self, key: str) -> Path:
        return self.root / key / SAFETENSORS_FILE

    def keys(self) -> list[str]:
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(_PARTIAL)
        )

    def exists(self, key: str) -> bool:
        return self.file(key).is_file()

    def write(
        self,
        key: str,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        checksum: bool = True,
        metadata: dict[str, str] | None = None,
        files: dict[str, str] | None = None,
        weights_links: tuple[str, ...] = (),
    ) -> WriteStats:
        """Write `state_dict` (converted to `dtype` if given) as snapshot `key`; returns when complete.

        `files` (name -> text) are written beside the weights, and each name in `weights_links` is
        a link to the weights file: an adapter version's directory is then also a PEFT adapter
        directory (adapter_config.json, adapter_model.safetensors), which vLLM loads by path."""
        import torch

        started = time.perf_counter()
        final = self.path(key)
        if final.exists():
            raise FileExistsError(f"snapshot {key!r} already exists in {self.root}; snapshots are immutable")
        layout = layout_of(state_dict, dtype, **(metadata or {}))
        partial = self.root / (key + _PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        recycled = self._allocate(partial / SAFETENSORS_FILE, layout.num_bytes)
        buffer = map_file(partial / SAFETENSORS_FILE, layout.num_bytes)
        # Checksums in a second thread, one tensor behind the copy (XXH3 outruns memcpy and
        # releases the GIL), so they add almost nothing to the write on two cores or more.
        with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(1) as hasher:
            pending = {}
            for slot in layout.slots:
                destination = slot.view(buffer)
                destination.copy_(state_dict[slot.name])
                if checksum:
                    pending[slot.name] = hasher.submit(tensor_checksum, destination)
            checksums = {name: future.result() for name, future in pending.items()}
        layout = layout.with_checksums(checksums)
        buffer[: layout.header_size].copy_(torch.frombuffer(bytearray(layout.header_bytes()), dtype=torch.uint8))
        del buffer
        self._copy_extra_files(partial, files, weights_links)
        partial.rename(final)
        return WriteStats(key, layout.num_bytes, time.perf_counter() - started, recycled, layout)

    def reserve(self, key: str, num_bytes: int) -> torch.Tensor:
        """A writable `num_bytes` file for snapshot `key` (for a transport that fills it whole)."""
        partial = self.root / (key + _PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        self._allocate(partial / SAFETENSORS_FILE, num_bytes)
        return map_file(partial / SAFETENSORS_FILE, num_bytes)

    def commit_reserved(
        self, key: str, files: dict[str, str] | None = None, weights_links: tuple[str, ...] = ()
    ) -> None:
        """Make a filled reservation a complete snapshot (drop the tensor `reserve` returned first);
        `files` and `weights_links` as in `write`."""
        partial = self.root / (key + _PARTIAL)
        self._copy_extra_files(partial, files, weights_links)
        partial.rename(self.path(key))

    def discard_reserved(self, key: str) -> None:
        shutil.rmtree(self.root / (key + _PARTIAL), ignore_errors=True)

    def layout(self, key: str) -> SnapshotLayout:
        with open(self.file(key), "rb") as f:
            prefix = f.read(8)
            f.seek(0)
            return parse_header(f.read(header_length(prefix)))

    @contextmanager
    def open(self, key: str) -> Iterator[dict[str, torch.Tensor]]:
        """Zero-copy tensors of a complete snapshot. Read them only: the mapping is shared."""
        layout = self.layout(key)
        buffer = map_file(self.file(key), layout.num_bytes)
        try:
            yield {slot.name: slot.view(buffer) for slot in layout.slots}
        finally:
            del buffer

    def read_into(self, key: str, destination: dict[str, torch.Tensor], verify: bool = False) -> int:
        """Copy snapshot `key` into `destination` (same names and shapes); returns bytes copied."""
        import torch

        layout = self.layout(key)
        checksums = dict(layout.checksums)
        num_bytes = 0
        with self.open(key) as tensors, torch.no_grad():
            for name, tensor in tensors.items():
                destination[name].copy_(tensor)
                num_bytes += tensor.numel() * tensor.element_size()
                if verify and name in checksums and tensor_checksum(tensor) != checksums[name]:
                    raise ChecksumError(f"snapshot {key!r}: tensor {name!r} does not match its checksum")
        return num_bytes

    def verify(self, key: str) -> dict[str, int]:
        """The checksum of every tensor as read now; raises ChecksumError on a mismatch with the header."""
        expected = dict(self.layout(key).checksums)
        with self.open(key) as tensors:
            actual = {name: tensor_checksum(tensor) for name, tensor in tensors.items()}
        bad = [name for name, value in expected.items() if actual.get(name) != value]
        if bad or not expected:
            raise ChecksumError(
                f"snapshot {key!r}: {len(bad)} tensors differ from their checksum ({bad[:3]})"
                if bad
                else f"snapshot {key!r} carries no checksums"
            )
        return actual

    def delete(self, key: str) -> None:
        """Remove a snapshot; its file joins the free pool. Only call when no reader holds it."""
        file = self.file(key)
        if file.is_file():
            free = self.root / FREE_DIR / f"{os.getpid()}-{next(self._names)}.bin"
            os.rename(file, free)
            self._trim_free_pool()
        shutil.rmtree(self.path(key), ignore_errors=True)

    def destroy(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        _MAPPINGS.drop_unlinked()

    def _allocate(self, path: Path, num_bytes: int) -> bool:
        """Create `path` with `num_bytes`, reusing a free file (closest in size) when there is one."""
        free = sorted((p for p in (self.root / FREE_DIR).glob("*.bin")), key=lambda p: abs(_size(p) - num_bytes))
        for candidate in free:
            try:
                os.rename(candidate, path)  # another writer may have taken it first
            except FileNotFoundError:
                continue
            os.truncate(path, num_bytes)
            return True
        with open(path, "wb") as f:
            f.truncate(num_bytes)
        return False

    def _trim_free_pool(self) -> None:
        free = sorted((self.root / FREE_DIR).glob("*.bin"), key=_mtime)
        for stale in free[: max(0, len(free) - self.max_free_files)]:
            stale.unlink(missing_ok=True)

    def _copy_extra_files(
        self, directory: Path, files: dict[str, str] | None = None, weights_links: tuple[str, ...] = ()
    ) -> None:
        for name, text in (files or {}).items():
            (directory / name).write_text(text)
        for name in weights_links:  # relative: the directory is renamed into place afterwards
            os.symlink(SAFETENSORS_FILE, directory / name)
        if self.extra_files_dir is None:
            return
        for name in EXTRA_FILES:
            if (self.extra_files_dir / name).is_file():
                shutil.copy2(self.extra_files_dir / name, directory / name)


class _Mappings:
    """This process's shared mappings of snapshot files, one per inode (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (dev, inode) -> (fd, bytes)

    def get(self, path: Path, num_bytes: int) -> torch.Tensor:
        import torch

        with self._lock:
            self._drop_unlinked()
            try:
                fd, shared = os.open(path, os.O_RDWR), True
            except PermissionError:  # a read-only checkpoint: a private mapping reads it as well
                fd, shared = os.open(path, os.O_RDONLY), False
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino)
            cached = self._maps.get(key)
            if cached is not None and cached[1].numel() >= num_bytes:
                os.close(fd)
                return cached[1][:num_bytes]
            if cached is not None:  # the file grew since: map it again
                os.close(cached[0])
            mapped = torch.from_file(str(path), shared=shared, size=stat.st_size, dtype=torch.uint8)
            self._maps[key] = (fd, mapped)  # the fd tells us when the file is unlinked
            return mapped[:num_bytes]

    def drop_unlinked(self) -> None:
        with self._lock:
            self._drop_unlinked()

    def _drop_unlinked(self) -> None:
        for key, (fd, _) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                del self._maps[key]


_MAPPINGS = _Mappings()


def map_file(path: Path, num_bytes: int) -> torch.Tensor:
    """The first `num_bytes` of a /dev/shm file as a shared uint8 tensor, reusing this process's
    mapping of the same inode. Never touch bytes past the file's current size."""
    return _MAPPINGS.get(Path(path), num_bytes)


class ChecksumError(RuntimeError):
    """A snapshot's bytes do not match the checksum its writer recorded."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
