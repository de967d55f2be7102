"""One copy per host of snapshots fetched from another host (forge_rl/store/host_copies.py).

The fetch here is a FAKE transport (it fills the reserved file from a byte pattern, as one RDMA
read would); the sharing, the locks and the lifetime of the copies are the real code."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import torch

from forge_rl.store.host_copies import HostCopies
from forge_rl.store.shm import SharedMemorySnapshots

NUM_BYTES = 4096


def fake_fetch(key: str, fetches: list[str], before_commit: asyncio.Event | None = None):
    """A fetch that records itself and, given an event, waits for it before the copy is complete."""

    async def fetch(snapshots: SharedMemorySnapshots) -> None:
        fetches.append(key)
        destination = snapshots.reserve(key, NUM_BYTES)
        destination.copy_(torch.full((NUM_BYTES,), int(key[-1]), dtype=torch.uint8))
        del destination
        if before_commit is not None:
            await before_commit.wait()
        snapshots.commit_reserved(key)

    return fetch


def test_readers_of_one_host_fetch_a_version_once_and_map_that_copy(tmp_path):
    async def scenario():
        readers = [HostCopies(tmp_path / "copies", f"generator{i}") for i in range(3)]
        fetches: list[str] = []
        commit = asyncio.Event()
        first = asyncio.create_task(readers[0].acquire("v00000001", fake_fetch("v00000001", fetches, commit)))
        while not fetches:  # the first reader is inside its fetch, holding the version's lock
            await asyncio.sleep(0)
        others = [asyncio.create_task(r.acquire("v00000001", fake_fetch("v00000001", fetches))) for r in readers[1:]]
        commit.set()
        results = await asyncio.gather(first, *others)
        return readers, fetches, results

    readers, fetches, results = asyncio.run(scenario())
    assert fetches == ["v00000001"]
    assert [fetched for _, fetched in results] == [True, False, False]
    paths = {reader.snapshots.file("v00000001") for reader in readers}
    assert len(paths) == 1 and paths.pop().read_bytes() == bytes([1]) * NUM_BYTES


def test_a_copy_stays_while_newest_or_held_and_goes_once_a_newer_one_is_here(tmp_path):
    async def scenario():
        a, b = HostCopies(tmp_path / "copies", "a"), HostCopies(tmp_path / "copies", "b")
        fetches: list[str] = []
        held_a, _ = await a.acquire("v00000001", fake_fetch("v00000001", fetches))
        held_b, _ = await b.acquire("v00000001", fake_fetch("v00000001", fetches))
        await a.release("v00000001", held_a)
        await b.release("v00000001", held_b)
        kept_while_newest = a.snapshots.exists("v00000001")
        again, fetched_again = await a.acquire("v00000001", fake_fetch("v00000001", fetches))  # mapped, not fetched
        newer, _ = await b.acquire("v00000002", fake_fetch("v00000002", fetches))
        kept_while_held = a.snapshots.exists("v00000001")
        await a.release("v00000001", again)
        return fetches, kept_while_newest, fetched_again, kept_while_held, a.snapshots.keys()

    fetches, kept_while_newest, fetched_again, kept_while_held, left = asyncio.run(scenario())
    assert fetches == ["v00000001", "v00000002"] and not fetched_again
    assert kept_while_newest and kept_while_held
    assert left == ["v00000002"]


HOLD_AND_DIE = """
import asyncio, os, sys
from forge_rl.store.host_copies import HostCopies
sys.path.insert(0, {tests!r})
from test_store_host_copies import fake_fetch
asyncio.run(HostCopies({root!r}, "killed").acquire("v00000001", fake_fetch("v00000001", [])))
os._exit(0)  # dies holding v1, with no release
"""


def test_a_holder_whose_process_died_does_not_keep_its_copy(tmp_path):
    root = tmp_path / "copies"
    script = HOLD_AND_DIE.format(tests=str(Path(__file__).parent), root=str(root))
    subprocess.run([sys.executable, "-c", script], check=True)
    reader = HostCopies(root, "survivor")
    assert reader.snapshots.exists("v00000001")
    asyncio.run(reader.acquire("v00000002", fake_fetch("v00000002", [])))
    assert reader.snapshots.keys() == ["v00000002"]


def test_the_last_reader_to_close_removes_the_directory(tmp_path):
    root = tmp_path / "copies"

    async def scenario():
        a, b = HostCopies(root, "a"), HostCopies(root, "b")
        await a.acquire("v00000001", fake_fetch("v00000001", []))
        await b.acquire("v00000001", fake_fetch("v00000001", []))
        await a.close()
        after_first = root.exists() and b.snapshots.exists("v00000001")
        await b.close()
        return after_first

    assert asyncio.run(scenario())
    assert not root.exists()
