"""`forge-rl bench weight-sync`'s summary of the store part."""

from forge_rl.bench.weight_sync import summarize


def _row(size_mb: int, vs_memcpy: float) -> dict:
    shm = {"vs_memcpy": vs_memcpy, "checksums_ok": True}
    return {"size_mb": size_mb, "memcpy_gbps": 5.0, "shm": shm, "rdma": {**shm, "vs_memcpy": vs_memcpy / 2}}


def test_ratios_are_read_at_100_mb_and_up():
    summary = summarize({"store": [_row(10, 0.05), _row(100, 0.3), _row(500, 0.4)], "wall_s": 1.0})
    assert summary["publish_to_servable_vs_memcpy"] == 0.3
    assert summary["publish_to_servable_vs_memcpy_rdma"] == 0.15
    assert summary["store_checksums_ok"]


def test_only_small_sizes_summarize_without_the_ratios():
    # `--sizes-mb 10` (a smoke run) once failed here, after the whole run, on min() of no rows.
    summary = summarize({"store": [_row(10, 0.05)], "wall_s": 1.0})
    assert summary["publish_to_servable_vs_memcpy"] is None
    assert summary["publish_to_servable_vs_memcpy_rdma"] is None
    assert summary["memcpy_gbps"] == 5.0 and summary["wall_s"] == 1.0
