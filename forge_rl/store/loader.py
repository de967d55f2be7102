"""The generator's side: bring version >= v from the store into a running engine.

    wait until complete ──▶ lease ──▶ prefetch to this host ──▶ stage in the engine ──▶ swap
      (index wakes us)       (no GC)   (shm: nothing to do;     (worker thread; the    (pause between two
                                        rdma: one read into     engine keeps decoding   decode steps, swap
                                        local /dev/shm)         with v-1)               references, resume)

The lease is released as soon as the engine holds its own copy (after staging, or after the
stock reload), so the store can collect the snapshot while the engine serves it. A generator that
falls behind loads the newest complete version, not every one in between (`skipped_versions`).

Metric names (per update; seconds unless named otherwise) are the constants below, so the
controller, the benchmark and the docs say the same thing.
"""

from __future__ import annotations

import time
from pathlib import Path

from forge_rl.store.index import ADAPTER_OF, version_key

# What each metric means, by its name in the update's result (and the run's metrics.jsonl).
PUBLISH_S = "weights/publish_s"  # trainer: snapshot + write to /dev/shm of this version
WAIT_S = "weights/wait_s"  # generator: asked to update until the version was complete
NOTICE_S = "weights/notice_s"  # writer's commit to this generator holding the lease (wall clock)
PREFETCH_S = "weights/prefetch_s"  # lease + fetch to this host (0 when mapped in place) + checksum check if asked
STAGE_S = "weights/stage_s"  # engine worker: load + repack beside the served version
# The worker's own split of staging (absent with the stock reload): shadow modules, copying the
# snapshot into them, vLLM's processing (the CPU repack), and the page faults that cost.
STAGE_LOAD_S = "weights/stage_load_s"
STAGE_PROCESS_S = "weights/stage_process_s"
STAGE_FAULTS = "weights/stage_minor_faults"
STALL_S = "weights/stall_s"  # pause asked to resume: includes finishing the current step
PAUSED_S = "weights/paused_s"  # paused to resumed: the engine could not decode at all
LOAD_S = "weights/load_s"  # this update end to end (kept for the controller's metrics)
BYTES = "weights/bytes"  # bytes of the snapshot moved into the engine
FETCHED_BYTES = "weights/fetched_bytes"  # bytes this update moved between hosts (0: shm, or this host's copy mapped)
GBPS = "weights/gbps"  # bytes / (prefetch + stage + paused)
PUBLISH_TO_SERVABLE_S = "weights/publish_to_servable_s"  # trainer's publish call to serving (wall clock)
REQUESTS_OVER_OLDER_KV = "weights/requests_over_older_kv"  # swap_kv=reuse: requests continued on older KV
# Adapter versions (LoRA): add_lora's time is STALL_S and PAUSED_S (its upper bound: the engine
# core loads the adapter between two decode steps); these two say what else happened.
ADAPTER_WAIT_S = "weights/adapter_wait_s"  # waiting for the previous update's unload of the oldest adapter
ADAPTERS_RESIDENT = (
    "weights/adapters_resident"  # adapters loaded right after this update (resident + 1 until the oldest goes)
)


async def load_version(
    engine,
    store,
    min_version: int,
    swap_mode: str = "keep",
    verify: bool = False,
    exact: bool = False,
    **swap_overrides,
) -> dict:
    """Serve the newest complete version >= `min_version` on `engine`; returns the update's metrics.

    `exact` serves `min_version` itself, never a newer one (an evaluation of exactly that version,
    whose caller holds a reservation of it: the version is complete and cannot be collected).

    `verify` checks every tensor's checksum against the writer's before the engine reads it
    (XXH3-64, off the critical path), raising ChecksumError on a mismatch. `swap_overrides`
    (loader=, swap_kv=) go to `engine.swap_weights` (benchmarks compare them).
    """
    started = time.perf_counter()
    lease = store.lease(version_key(min_version)) if exact else store.lease(min_version=min_version)
    async with lease as snapshot:  # waits until one is complete
        version = snapshot.version
        leased_at = time.time() - snapshot.fetch_s  # an RDMA fetch counts as prefetch
        complete = time.perf_counter() - snapshot.fetch_s  # the RDMA fetch counts as prefetch
        if version <= engine.policy_version:
            return {"policy_version": engine.policy_version, STALL_S: 0.0, LOAD_S: 0.0}
        if verify:
            snapshot.verify()
        adapter_of = snapshot.info.get(ADAPTER_OF)
        if adapter_of is not None or getattr(engine, "adapters", None) is not None:
            # Loaded while the lease is held: vLLM reads the adapter directory in add_lora.
            fetched = time.perf_counter()
            load = await engine.load_adapter(snapshot.path, version, adapter_of)
            return _adapter_metrics(snapshot, version, min_version, started, complete, fetched, load, leased_at)
        fetched = time.perf_counter()
        stage = {}
        if swap_overrides.get("loader", "staged") == "staged":
            stage = await engine.stage_weights(snapshot.path, version)  # {} when the engine cannot stage
        staged = time.perf_counter()
        if not stage:  # stock reload reads the files while paused: keep the lease through the swap
            swap = await engine.swap_weights(snapshot.path, version, swap_mode, **swap_overrides)
    if stage:
        swap = await engine.swap_weights(Path(snapshot.path), version, swap_mode, **swap_overrides)
    serving_at = time.time()
    moved_s = (fetched - complete) + (staged - fetched) + swap.paused_s
    info = snapshot.info
    return {
        "policy_version": version,
        "skipped_versions": version - min_version,
        "transport": snapshot.transport,
        "loader": swap.loader,
        "swap_mode": swap_mode,
        "verified": verify,
        PUBLISH_S: info.get("snapshot_s", 0.0) + info.get("write_s", 0.0),
        WAIT_S: complete - started,
        NOTICE_S: max(0.0, leased_at - info.get("committed_at", leased_at)),
        PREFETCH_S: fetched - complete,
        STAGE_S: staged - fetched,
        STAGE_LOAD_S: stage.get("load_s", 0.0),
        STAGE_PROCESS_S: stage.get("process_s", 0.0),
        STAGE_FAULTS: stage.get("minor_faults", 0),
        STALL_S: swap.stall_s,
        PAUSED_S: swap.paused_s,
        LOAD_S: time.perf_counter() - started,
        BYTES: snapshot.num_bytes,
        FETCHED_BYTES: snapshot.fetched_bytes,
        GBPS: snapshot.num_bytes / max(moved_s, 1e-9) / 1e9,
        PUBLISH_TO_SERVABLE_S: serving_at - info.get("publish_started_at", serving_at),
        REQUESTS_OVER_OLDER_KV: swap.num_requests_over_older_kv,
    }


def _adapter_metrics(snapshot, version, min_version, started, complete, fetched, load, leased_at) -> dict:
    """`load_version`'s metrics for an adapter version (same names as for full weights)."""
    info = snapshot.info
    return {
        "policy_version": version,
        "skipped_versions": version - min_version,
        "transport": snapshot.transport,
        "loader": "adapter",
        PUBLISH_S: info.get("snapshot_s", 0.0) + info.get("write_s", 0.0),
        WAIT_S: complete - started,
        NOTICE_S: max(0.0, leased_at - info.get("committed_at", leased_at)),
        PREFETCH_S: fetched - complete,
        STAGE_S: 0.0,
        STALL_S: load.load_s,
        PAUSED_S: load.load_s,
        ADAPTER_WAIT_S: load.wait_s,
        ADAPTERS_RESIDENT: len(load.resident),
        LOAD_S: time.perf_counter() - started,
        BYTES: snapshot.num_bytes,
        FETCHED_BYTES: snapshot.fetched_bytes,
        GBPS: snapshot.num_bytes / max(fetched - complete + load.load_s, 1e-9) / 1e9,
        PUBLISH_TO_SERVABLE_S: time.time() - info.get("publish_started_at", time.time()),
    }
