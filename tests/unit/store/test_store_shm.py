"""Snapshot layout and the shared-memory transport (forge_rl/store/layout.py, shm.py)."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from forge_rl.store.layout import layout_of, parse_header, tensor_checksum
from forge_rl.store.shm import ChecksumError, SharedMemorySnapshots, default_store_root, sweep_stale_roots


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=generator),
        "model.norm.weight": torch.randn(32, generator=generator).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 32, generator=generator),
        "step": torch.tensor([seed], dtype=torch.int64),
        "odd": torch.randn(3, generator=generator).to(torch.float16),  # 6 bytes: alignment check
    }


@pytest.fixture
def snapshots(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    return SharedMemorySnapshots(tmp_path / "store", extra_files_dir=model_dir)


def test_the_planned_header_parses_back_to_the_same_slots():
    layout = layout_of(state_dict(), metadata_key="x")
    parsed = parse_header(layout.header_bytes())

    assert parsed.slots == layout.slots
    assert parsed.header_size == layout.header_size
    assert layout.header_size % 8 == 0
    assert dict(parsed.metadata)["metadata_key"] == "x"


def test_every_slot_is_aligned_to_its_element_size():
    for slot in layout_of(state_dict()).slots:
        assert slot.offset % slot.dtype.itemsize == 0


def test_a_written_snapshot_is_a_valid_safetensors_file_with_the_same_contents(snapshots):
    written = state_dict()
    snapshots.write("v00000001", written)

    loaded = load_file(str(snapshots.file("v00000001")))  # what vLLM's loader reads
    assert loaded.keys() == written.keys()
    for name, tensor in written.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    assert (snapshots.path("v00000001") / "config.json").is_file()  # vLLM's reload needs it


def test_the_write_converts_to_the_requested_dtype(snapshots):
    written = {"w": torch.randn(8, 8)}
    snapshots.write("v00000001", written, dtype=torch.bfloat16)

    with snapshots.open("v00000001") as tensors:
        assert tensors["w"].dtype == torch.bfloat16
        assert torch.equal(tensors["w"], written["w"].to(torch.bfloat16))


def test_checksums_match_what_a_reader_reads_and_catch_corruption(snapshots):
    snapshots.write("v00000001", state_dict())
    checksums = snapshots.verify("v00000001")
    assert checksums == {name: tensor_checksum(t) for name, t in state_dict().items()}

    layout = snapshots.layout("v00000001")
    slot = layout.slot("lm_head.weight")
    with open(snapshots.file("v00000001"), "r+b") as f:  # flip one byte of one tensor
        f.seek(slot.offset + 5)
        byte = f.read(1)
        f.seek(slot.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="lm_head.weight"):
        snapshots.verify("v00000001")


def test_read_into_copies_into_existing_tensors_and_verifies(snapshots):
    snapshots.write("v00000001", state_dict(1))
    destination = {name: torch.zeros_like(t) for name, t in state_dict().items()}

    snapshots.read_into("v00000001", destination, verify=True)

    for name, tensor in state_dict(1).items():
        assert torch.equal(destination[name], tensor)


def test_snapshots_are_immutable(snapshots):
    snapshots.write("v00000001", state_dict())
    with pytest.raises(FileExistsError):
        snapshots.write("v00000001", state_dict())


def test_a_reader_never_sees_a_partial_snapshot(snapshots):
    """While a writer thread writes many versions, every snapshot a reader finds is complete."""
    big = {f"layer{i}": torch.randn(256, 256) for i in range(16)}
    seen, errors = [], []

    def write_all():
        for version in range(1, 9):
            snapshots.write(f"v{version:08d}", big)

    def check_new_keys():
        for key in snapshots.keys():
            if key in seen:
                continue
            try:
                snapshots.verify(key)  # parses the header and checks every checksum
                seen.append(key)
            except Exception as error:  # noqa: BLE001 - any failure is a partial read
                errors.append((key, repr(error)))

    writer = threading.Thread(target=write_all)
    writer.start()
    while writer.is_alive():
        check_new_keys()
    writer.join()
    check_new_keys()
    assert errors == []
    assert set(seen) == {f"v{v:08d}" for v in range(1, 9)}


def test_deleted_files_are_recycled_for_the_next_write(snapshots):
    first = snapshots.write("v00000001", state_dict(1))
    snapshots.delete("v00000001")
    second = snapshots.write("v00000002", state_dict(2))

    assert not first.recycled and second.recycled
    assert not snapshots.exists("v00000001")
    with snapshots.open("v00000002") as tensors:
        assert torch.equal(tensors["lm_head.weight"], state_dict(2)["lm_head.weight"])
    snapshots.verify("v00000002")


def test_the_free_pool_is_bounded(snapshots):
    for version in range(1, 6):
        snapshots.write(f"v{version:08d}", state_dict())
    for version in range(1, 6):
        snapshots.delete(f"v{version:08d}")

    assert len(list((snapshots.root / ".free").glob("*.bin"))) == snapshots.max_free_files


def crashed_launch_root(base, run_name: str) -> str:
    """The root of a launch whose controller died without cleaning up (as under kill -9)."""
    code = f"from forge_rl.store.shm import default_store_root; print(default_store_root({run_name!r}, {str(base)!r}))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def test_a_resumed_launch_can_republish_the_versions_a_crashed_launch_left(tmp_path):
    crashed = SharedMemorySnapshots(default_store_root("run", tmp_path))
    crashed.write("v00000115", state_dict())

    resumed = SharedMemorySnapshots(default_store_root("run", tmp_path))
    resumed.write("v00000115", state_dict(1))  # no FileExistsError: a root of its own

    assert resumed.root != crashed.root and crashed.exists("v00000115")  # the first owner is alive
    assert json.loads((resumed.root / ".owner").read_text())["pid"] == os.getpid()


def test_a_new_launch_sweeps_the_roots_of_dead_launches_only(tmp_path):
    dead = crashed_launch_root(tmp_path, "run")
    fetched = tmp_path / (os.path.basename(dead) + "-fetched-host-123-0")
    (fetched / ".free").mkdir(parents=True)
    SharedMemorySnapshots(dead).write("v00000003", state_dict())
    live = default_store_root("other", tmp_path)
    unowned = tmp_path / "forge_rl-older-layout"  # no owner record: could be anyone's
    unowned.mkdir()
    reused_pid = default_store_root("reused", tmp_path)  # this pid, but a process started earlier
    owner = json.loads((reused_pid / ".owner").read_text())
    (reused_pid / ".owner").write_text(json.dumps(owner | {"start_ticks": owner["start_ticks"] - 1}))

    new = default_store_root("run", tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, unowned.name, new.name])
    assert sweep_stale_roots(tmp_path) == []


def test_an_adapter_version_directory_is_also_a_peft_adapter_directory(snapshots):
    """Files beside the weights and links to them: what vLLM's LoRA loader reads by path."""
    snapshots.write(
        "v00000001",
        state_dict(1),
        files={"adapter_config.json": '{"r": 4}'},
        weights_links=("adapter_model.safetensors",),
    )
    directory = snapshots.path("v00000001")
    assert json.loads((directory / "adapter_config.json").read_text()) == {"r": 4}
    assert os.readlink(directory / "adapter_model.safetensors") == "model.safetensors"  # relative: survives the rename
    loaded = load_file(str(directory / "adapter_model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state_dict(1).items())
