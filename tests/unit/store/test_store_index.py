"""The weight store's index rules (forge_rl/store/index.py), driven without Monarch."""

import subprocess
import sys

import pytest

from forge_rl.errors import StoreError
from forge_rl.store.index import SnapshotState, VersionIndex, key_version, version_key

HERE = "host:/dev/shm/forge_rl-test"


def committed(index: VersionIndex, *versions: int) -> list[str]:
    """Begin and commit each version; returns what the last commit made collectable."""
    collectable = []
    for version in versions:
        index.begin(version_key(version), HERE)
        collectable = index.commit(version_key(version), num_bytes=100)
    return collectable


def test_version_keys_round_trip_and_sort_like_versions():
    assert version_key(3) == "v00000003"
    assert key_version(version_key(12345)) == 12345
    assert key_version("bias") is None
    assert sorted(version_key(v) for v in (10, 9, 100)) == [version_key(v) for v in (9, 10, 100)]


def test_a_version_being_written_is_invisible_to_readers():
    index = VersionIndex()
    index.begin(version_key(1), HERE)

    assert index.latest_version() is None
    assert index.keys() == []
    assert not index.exists(version_key(1))
    with pytest.raises(StoreError, match="still being written"):
        index.acquire("generator0", version_key(1))
    with pytest.raises(StoreError, match="no complete policy version"):
        index.acquire("generator0")

    index.commit(version_key(1), num_bytes=100)
    assert index.acquire("generator0").key == version_key(1)


def test_a_late_reader_gets_the_newest_complete_version():
    index = VersionIndex(keep_latest=2)
    committed(index, 1, 2, 3)
    index.begin(version_key(4), HERE)  # in progress: not the newest complete one

    record = index.acquire("late-generator")

    assert record.version == 3
    assert record.state is SnapshotState.COMPLETE


def test_snapshots_are_immutable_once_complete():
    index = VersionIndex()
    committed(index, 1)

    with pytest.raises(StoreError, match="immutable"):
        index.begin(version_key(1), HERE)


def test_gc_keeps_the_newest_versions_and_collects_older_unheld_ones():
    index = VersionIndex(keep_latest=1)

    assert committed(index, 1) == []
    assert committed(index, 2) == [version_key(1)]
    index.forget(version_key(1))
    assert index.complete_versions() == [2]


def test_gc_never_collects_a_held_version():
    index = VersionIndex(keep_latest=1)
    committed(index, 1)
    index.acquire("generator0", version_key(1))

    assert committed(index, 2, 3) == [version_key(2)]  # 1 is held, 3 is the newest
    with pytest.raises(StoreError, match="held by"):
        index.forget(version_key(1))

    assert index.release("generator0", version_key(1)) == [version_key(1), version_key(2)]


def test_every_lease_must_be_released_before_collection():
    index = VersionIndex(keep_latest=1)
    committed(index, 1)
    index.acquire("generator0", version_key(1))
    index.acquire("generator0", version_key(1))
    index.acquire("generator1", version_key(1))
    committed(index, 2)

    assert index.release("generator0", version_key(1)) == []
    assert index.release("generator1", version_key(1)) == []
    assert index.holders(version_key(1)) == {"generator0": 1}
    assert index.release("generator0", version_key(1)) == [version_key(1)]


def test_a_dead_readers_leases_are_dropped():
    index = VersionIndex(keep_latest=1)
    committed(index, 1)
    index.acquire("generator0", version_key(1))
    committed(index, 2)

    assert index.drop_reader("generator0") == [version_key(1)]


def test_a_dropped_reader_is_refused_new_leases():
    """A dead reader's call still in flight (one parked waiting for a version, say) must not pin a
    version after its leases were dropped; its replacement reads under a new id."""
    index = VersionIndex(keep_latest=1)
    committed(index, 1)
    index.drop_reader("generator0-r1")

    with pytest.raises(StoreError, match="'generator0-r1' was dropped"):
        index.acquire("generator0-r1")
    committed(index, 2)
    assert index.holders(version_key(2)) == {}
    assert index.acquire("generator0-r2").version == 2


def test_releasing_an_unheld_lease_is_an_error():
    index = VersionIndex()
    committed(index, 1)

    with pytest.raises(StoreError, match="holds no lease"):
        index.release("generator0", version_key(1))


def test_explicit_delete_waits_for_the_last_reader_and_blocks_new_leases():
    index = VersionIndex(keep_latest=5)
    index.begin("bias", HERE)
    index.commit("bias", num_bytes=4)
    index.acquire("reader", "bias")

    assert index.delete("bias") == []
    with pytest.raises(StoreError, match="being deleted"):
        index.acquire("another", "bias")
    assert index.release("reader", "bias") == ["bias"]


def test_a_failed_write_can_be_aborted_and_retried():
    index = VersionIndex()
    index.begin(version_key(1), HERE)
    index.abort(version_key(1))
    index.begin(version_key(1), HERE)
    index.commit(version_key(1), num_bytes=1)

    assert index.keys("v") == [version_key(1)]


def test_replicas_add_locations():
    index = VersionIndex()
    committed(index, 1)
    index.add_location(version_key(1), "other-host:/dev/shm/forge_rl-test")

    assert index.record(version_key(1)).locations == {HERE, "other-host:/dev/shm/forge_rl-test"}


def test_keep_latest_must_keep_at_least_one_version():
    with pytest.raises(ValueError, match="keep_latest"):
        VersionIndex(keep_latest=0)


def test_store_core_modules_import_neither_monarch_nor_vllm():
    modules = ["forge_rl.store.index", "forge_rl.store.layout", "forge_rl.store.shm", "forge_rl.store.publisher"]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + ("print(','.join(m for m in ('monarch', 'vllm', 'torchtitan') if m in sys.modules))")
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_the_index_says_which_versions_are_adapters_and_of_which_base():
    from forge_rl.store.index import ADAPTER_OF

    index = VersionIndex()
    index.begin(version_key(1), HERE)
    index.commit(version_key(1), num_bytes=100)
    index.begin(version_key(2), HERE)
    index.commit(version_key(2), num_bytes=10, info={ADAPTER_OF: "/models/base"})
    assert index.record(version_key(1)).adapter_of is None  # full weights
    assert index.record(version_key(2)).adapter_of == "/models/base"


def test_a_reserved_version_is_held_from_its_commit_so_the_next_commit_cannot_collect_it():
    index = VersionIndex(keep_latest=1)
    index.begin("v00000000", "h:/s")
    index.commit("v00000000", 1)
    assert index.reserve("evaluator", 1) is False  # not published yet: held from its commit
    index.begin("v00000001", "h:/s")
    index.commit("v00000001", 1)
    assert index.holders("v00000001") == {"evaluator": 1}
    index.begin("v00000002", "h:/s")
    assert index.commit("v00000002", 1) == ["v00000000"]  # v1 is older than the newest, but held
    index.forget("v00000000")  # what the store's actor does with what is collectable
    assert index.cancel_reservation("evaluator", 1) == ["v00000001"]


def test_a_complete_version_is_leased_by_its_reservation_at_once_and_a_collected_one_is_refused():
    index = VersionIndex(keep_latest=1)
    for collectable in map(lambda v: committed(index, v), range(2)):
        for key in collectable:
            index.forget(key)  # what the store's actor does with what is collectable
    assert index.reserve("evaluator", 1) is True
    assert index.holders("v00000001") == {"evaluator": 1}
    with pytest.raises(StoreError, match="policy version 0 cannot be reserved"):
        index.reserve("evaluator", 0)


def test_a_reservation_withdrawn_before_its_commit_holds_nothing_and_a_dropped_reader_loses_its_reservations():
    index = VersionIndex(keep_latest=1)
    index.reserve("evaluator", 0)
    index.cancel_reservation("evaluator", 0)
    index.reserve("dead", 0)
    index.drop_reader("dead")
    index.begin("v00000000", "h:/s")
    index.commit("v00000000", 1)
    assert index.holders("v00000000") == {}
