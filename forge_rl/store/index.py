"""The weight store's index: which snapshots exist, which are complete, who holds which.

Plain logic, no Monarch and no I/O: `StoreIndexActor` (store/actors.py) wraps one `VersionIndex`
and carries out what its methods return (deleting files, waking waiters). Every rule of the store
lives here, so the tests drive it with fabricated calls.

Vocabulary
    key        a snapshot's name. Policy versions use `version_key(v)` = "v00000003"; `put(key, t)`
               may use any other name (no version, never superseded).
    location   where a complete copy lives: a storage volume's name ("host:/dev/shm/forge_rl-run").
    lease      a reader's hold on a snapshot (acquire ... release); a held snapshot is never deleted.

Rules
    1. A snapshot is readable only once committed: `begin` opens it, `commit` completes it. A reader
       never sees a partial snapshot (acquire refuses it, `latest_version` skips it).
    2. Snapshots are immutable: a second `begin` of a committed key is refused.
    3. Garbage collection: a policy-version snapshot is collectable when it is complete, not held,
       and older than the newest `keep_latest` complete versions. `delete(key)` marks a snapshot
       collectable at once (if held, it goes when the last lease is released).
    3a. Reservation: `reserve(reader, v)` is a lease on policy version v taken now if v is
       complete, else at the moment v commits, so no commit in between can collect it (an
       evaluation of exactly v, asked for before the trainer publishes v, or v+1).
       `cancel_reservation` withdraws one not yet taken; a taken one is released like any lease.
    4. Reader failure: `drop_reader` releases every lease of a reader that died (or closed), and
       refuses it new ones: a call of a dead reader still in flight, such as one parked waiting for
       a version, must not pin that version after the death. A reader id is used once.
    5. Adapter versions: a version may hold only LoRA adapter tensors (a PEFT adapter directory)
       instead of full weights; its record says so and names its base (`adapter_of`). Versions,
       leases and GC are the same for both kinds.
"""

from __future__ import annotations

import collections
import enum
import re
from dataclasses import dataclass, field

from forge_rl.errors import StoreError

_VERSION_KEY = re.compile(r"^v(\d{8})$")
ADAPTER_OF = "adapter_of"
"""The `info` key of an adapter version's record: the base model it applies to (rule 5)."""


def version_key(policy_version: int) -> str:
    """Snapshot key of a policy version: version_key(3) == "v00000003"."""
    if policy_version < 0:
        raise ValueError(f"policy_version ({policy_version}) must be >= 0")
    return f"v{policy_version:08d}"


def key_version(key: str) -> int | None:
    """The policy version a key names, or None for other keys."""
    match = _VERSION_KEY.match(key)
    return int(match.group(1)) if match else None


class SnapshotState(enum.Enum):
    WRITING = "writing"
    """Begun, not committed: invisible to readers."""
    COMPLETE = "complete"
    """Committed: readable from each of its locations."""


@dataclass
class SnapshotRecord:
    key: str
    state: SnapshotState
    locations: set[str]
    num_bytes: int = 0
    info: dict = field(default_factory=dict)
    """What readers need besides the bytes (the layout's checksums, the writer's timings)."""
    holders: collections.Counter = field(default_factory=collections.Counter)
    """reader id -> number of leases it holds on this snapshot."""
    delete_requested: bool = False

    @property
    def version(self) -> int | None:
        return key_version(self.key)

    @property
    def adapter_of(self) -> str | None:
        """For an adapter version (LoRA: only the adapter tensors), the base model it
        applies to, as the writer named it (the base's model directory); None for full weights."""
        return self.info.get(ADAPTER_OF)

    @property
    def held(self) -> bool:
        return sum(self.holders.values()) > 0


class VersionIndex:
    """The store's catalogue; every mutating call returns the keys that became collectable."""

    def __init__(self, keep_latest: int = 1):
        if keep_latest < 1:
            raise ValueError(f"keep_latest ({keep_latest}) must be >= 1: readers need the newest version")
        self.keep_latest = keep_latest
        self._records: dict[str, SnapshotRecord] = {}
        self._dropped_readers: set[str] = set()
        """Readers `drop_reader` was called for (rule 4)."""
        self._reservations: dict[str, collections.Counter] = {}
        """key -> {reader: reservations} of versions not committed yet (rule 3a)."""

    # Writers -------------------------------------------------------------------------------

    def begin(self, key: str, location: str) -> None:
        record = self._records.get(key)
        if record is not None and record.state is SnapshotState.COMPLETE:
            raise StoreError(f"snapshot {key!r} is already complete; snapshots are immutable (delete it first)")
        self._records[key] = SnapshotRecord(key, SnapshotState.WRITING, {location})

    def commit(self, key: str, num_bytes: int, info: dict | None = None) -> list[str]:
        record = self._record(key)
        if record.state is not SnapshotState.WRITING:
            raise StoreError(f"snapshot {key!r} is {record.state.value}; only a begun snapshot can be committed")
        record.state, record.num_bytes, record.info = SnapshotState.COMPLETE, num_bytes, dict(info or {})
        record.holders.update(self._reservations.pop(key, collections.Counter()))
        return self.collectable()

    def abort(self, key: str) -> None:
        """Forget a snapshot whose write failed (it was never visible)."""
        record = self._records.get(key)
        if record is not None and record.state is SnapshotState.WRITING:
            del self._records[key]

    def add_location(self, key: str, location: str) -> None:
        """Another complete copy of `key` (a replica a reader fetched to its own host)."""
        self._complete(key).locations.add(location)

    # Readers -------------------------------------------------------------------------------

    def acquire(self, reader: str, key: str | None = None) -> SnapshotRecord:
        """Lease `key` (default: the newest complete policy version) for `reader`."""
        if reader in self._dropped_readers:
            raise StoreError(
                f"reader {reader!r} was dropped (it died or closed) and cannot lease {key or 'a version'}; "
                "a reader that starts again needs a new id"
            )
        if key is None:
            newest = self.latest_version()
            if newest is None:
                raise StoreError("no complete policy version yet; wait for one (wait_for_version)")
            key = version_key(newest)
        record = self._complete(key)
        if record.delete_requested:
            raise StoreError(f"snapshot {key!r} is being deleted and cannot be leased")
        record.holders[reader] += 1
        return record

    def reserve(self, reader: str, version: int) -> bool:
        """Lease policy version `version` for `reader` now if it is complete, else when it commits
        (rule 3a); True if the lease is held already. Refuses a version already collected."""
        key = version_key(version)
        record = self._records.get(key)
        if record is not None and record.state is SnapshotState.COMPLETE:
            self.acquire(reader, key)
            return True
        if reader in self._dropped_readers:
            raise StoreError(f"reader {reader!r} was dropped (it died or closed) and cannot reserve {key}")
        complete = self.complete_versions()
        if record is None and complete and version < complete[-1]:
            raise StoreError(
                f"policy version {version} cannot be reserved: it is older than the newest ({complete[-1]}) and was "
                "collected, or never published; reserve a version before the one after it commits"
            )
        self._reservations.setdefault(key, collections.Counter())[reader] += 1
        return False

    def cancel_reservation(self, reader: str, version: int) -> list[str]:
        """Withdraw `reader`'s reservation of `version`: release it if it was taken (the version
        committed), else forget it."""
        key = version_key(version)
        pending = self._reservations.get(key)
        if pending is not None and pending[reader] > 0:
            pending[reader] -= 1
            if not +pending:
                del self._reservations[key]
            return self.collectable()
        return self.release(reader, key)

    def release(self, reader: str, key: str) -> list[str]:
        record = self._records.get(key)
        if record is None or record.holders[reader] <= 0:
            raise StoreError(f"reader {reader!r} holds no lease on {key!r}")
        record.holders[reader] -= 1
        if record.holders[reader] == 0:
            del record.holders[reader]
        return self.collectable()

    def drop_reader(self, reader: str) -> list[str]:
        """Release every lease of `reader` and refuse it new ones (rule 4)."""
        self._dropped_readers.add(reader)
        for record in self._records.values():
            record.holders.pop(reader, None)
        for pending in self._reservations.values():
            pending.pop(reader, None)
        return self.collectable()

    # Queries -------------------------------------------------------------------------------

    def latest_version(self) -> int | None:
        versions = self.complete_versions()
        return versions[-1] if versions else None

    def complete_versions(self) -> list[int]:
        return sorted(
            r.version for r in self._records.values() if r.state is SnapshotState.COMPLETE and r.version is not None
        )

    def keys(self, prefix: str | None = None) -> list[str]:
        """Complete snapshots whose key starts with `prefix`."""
        return sorted(
            key
            for key, r in self._records.items()
            if r.state is SnapshotState.COMPLETE and (prefix is None or key.startswith(prefix))
        )

    def exists(self, key: str) -> bool:
        record = self._records.get(key)
        return record is not None and record.state is SnapshotState.COMPLETE

    def record(self, key: str) -> SnapshotRecord:
        return self._complete(key)

    def holders(self, key: str) -> dict[str, int]:
        return dict(self._record(key).holders)

    # Deletion ------------------------------------------------------------------------------

    def delete(self, key: str) -> list[str]:
        """Ask for `key` to go; it goes once no reader holds it."""
        self._record(key).delete_requested = True
        return self.collectable()

    def collectable(self) -> list[str]:
        """Keys that may be deleted now (rule 3)."""
        recent = set(self.complete_versions()[-self.keep_latest :])
        return sorted(
            r.key
            for r in self._records.values()
            if r.state is SnapshotState.COMPLETE
            and not r.held
            and (r.delete_requested or (r.version is not None and r.version not in recent))
        )

    def forget(self, key: str) -> SnapshotRecord:
        """Remove a collected snapshot's record; refuses a held one (rule 3)."""
        record = self._record(key)
        if record.held:
            raise StoreError(f"snapshot {key!r} is held by {dict(record.holders)} and cannot be deleted")
        return self._records.pop(key)

    def _record(self, key: str) -> SnapshotRecord:
        try:
            return self._records[key]
        except KeyError:
            raise StoreError(f"no snapshot {key!r} in the store (complete: {self.keys()[-5:]})") from None

    def _complete(self, key: str) -> SnapshotRecord:
        record = self._record(key)
        if record.state is not SnapshotState.COMPLETE:
            raise StoreError(f"snapshot {key!r} is still being written and cannot be read")
        return record
