"""The byte layout of one snapshot: a safetensors file, planned before any byte is written.

A snapshot is one flat byte buffer in the safetensors format (8-byte header length, JSON header,
tensor bytes back to back), so the same bytes are at once

- what vLLM's stock `reload_weights` reads from a directory (`model.safetensors` + `config.json`),
- what `torch.frombuffer` views zero-copy in a reader that maps the file (same host), and
- what one `RDMABuffer` over the whole file moves to a reader on another host in one read.

The header is planned from shapes and dtypes alone (`plan_layout`), so a writer can size the file,
copy every tensor straight into its slot (one memcpy each, dtype conversion fused into the copy)
and write the header last. A checksum of every tensor (XXH3-64) travels in the header's
`__metadata__` as fixed-width hex, so filling them in after the copy does not change the header's
length. XXH3 because it is faster than memcpy, so it adds little to a publish (zlib's CRC32, slower
than memcpy, would add markedly to one), and `xxhash` already comes with torchmonarch.

safetensors requires the tensors to tile the data region with no holes, so there is no padding
between them; tensors are ordered by element size (largest first) so that every slot stays aligned
to its element size. Worked example: {"b": bf16[3], "a": f32[2]} plans to
    header  {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "BF16", "shape": [3], "data_offsets": [8, 14]}, "__metadata__": {...}}
    data    bytes 0-8 a, bytes 8-14 b; total = 8 + header length + 14.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

SAFETENSORS_FILE = "model.safetensors"


# Tables, not module constants: torch is imported where a tensor's layout is planned or parsed,
# not by every process that imports the store (the run's controller and services import it and
# hold no tensor; torch's import costs seconds of CPU at every run's start).
@functools.cache
def _safetensors_names() -> dict[torch.dtype, str]:
    import torch

    return {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    return {name: dtype for dtype, name in _safetensors_names().items()}


# Header keys of forge_rl's own metadata (safetensors metadata values must be strings).
_CHECKSUM_KEY = "forge_rl.xxh3_64"
_CHECKSUM_WIDTH = 16  # hex digits of a 64-bit checksum: fixed, so filling them in never resizes the header
_HEADER_ALIGN = 8


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a snapshot. offset is from the start of the file, in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    num_bytes: int

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor as a zero-copy view of `buffer` (the whole file as a 1-D uint8 tensor)."""
        flat = buffer[self.offset : self.offset + self.num_bytes]
        return flat.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class SnapshotLayout:
    """Slots in file order, the total file size, and (once written) a checksum per tensor."""

    slots: tuple[TensorSlot, ...]
    header_size: int
    """Bytes before the first tensor: the 8-byte length and the padded JSON header."""
    metadata: tuple[tuple[str, str], ...] = ()
    checksums: tuple[tuple[str, int], ...] = ()

    @property
    def num_bytes(self) -> int:
        """Size of the whole file."""
        return self.header_size + sum(slot.num_bytes for slot in self.slots)

    def slot(self, name: str) -> TensorSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(f"tensor {name!r} is not in this snapshot (it has {len(self.slots)} tensors)")

    def with_checksums(self, checksums: dict[str, int]) -> SnapshotLayout:
        return SnapshotLayout(self.slots, self.header_size, self.metadata, tuple(sorted(checksums.items())))

    def header_bytes(self) -> bytes:
        """The file's first `header_size` bytes (length prefix + JSON padded with spaces)."""
        return _encode_header(self.slots, dict(self.metadata), dict(self.checksums), self.header_size)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _safetensors_names()[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} has no safetensors name; supported: {sorted(map(str, _safetensors_names()))}"
        ) from None


def plan_layout(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str] | None = None
) -> SnapshotLayout:
    """Slots for tensors of these (shape, dtype)s, largest element size first, then by name."""
    metadata = {"format": "pt", **(metadata or {})}
    order = sorted(shapes, key=lambda name: (-shapes[name][1].itemsize, name))
    offsets, cursor = {}, 0
    for name in order:
        shape, dtype = shapes[name]
        dtype_name(dtype)  # validates
        num_bytes = _numel(shape) * dtype.itemsize
        offsets[name] = (cursor, num_bytes)
        cursor += num_bytes
    # Placeholder checksums of the final width, so the planned header size is the final one.
    placeholder = {name: 0 for name in order}
    relative = tuple(
        TensorSlot(name, shapes[name][1], tuple(shapes[name][0]), offsets[name][0], offsets[name][1]) for name in order
    )
    header_size = len(_encode_header(relative, metadata, placeholder, None))
    slots = tuple(TensorSlot(s.name, s.dtype, s.shape, s.offset + header_size, s.num_bytes) for s in relative)
    return SnapshotLayout(slots, header_size, tuple(sorted(metadata.items())))


def layout_of(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None, **metadata: str) -> SnapshotLayout:
    """The layout `state_dict` gets when written, converted to `dtype` if given."""
    return plan_layout({name: (tuple(t.shape), dtype or t.dtype) for name, t in state_dict.items()}, metadata)


def parse_header(prefix: bytes) -> SnapshotLayout:
    """The layout from a file's first bytes (at least 8 + header length of them)."""
    (length,) = struct.unpack("<Q", prefix[:8])
    header = json.loads(prefix[8 : 8 + length])
    metadata = header.pop("__metadata__", {}) or {}
    checksums_text = metadata.pop(_CHECKSUM_KEY, None)
    header_size = 8 + length
    slots = tuple(
        sorted(
            (
                TensorSlot(
                    name,
                    _torch_dtypes()[entry["dtype"]],
                    tuple(entry["shape"]),
                    header_size + entry["data_offsets"][0],
                    entry["data_offsets"][1] - entry["data_offsets"][0],
                )
                for name, entry in header.items()
            ),
            key=lambda slot: slot.offset,
        )
    )
    checksums = {}
    if checksums_text:
        checksums = {name: int(value, 16) for name, value in json.loads(checksums_text).items() if int(value, 16)}
    return SnapshotLayout(slots, header_size, tuple(sorted(metadata.items())), tuple(sorted(checksums.items())))


def header_length(prefix8: bytes) -> int:
    """Total header size (length prefix included) from a file's first 8 bytes."""
    return 8 + struct.unpack("<Q", prefix8[:8])[0]


def tensor_checksum(tensor: torch.Tensor) -> int:
    """XXH3-64 of a CPU tensor's bytes (faster than memcpy: the module docstring); 0 is reserved for "none recorded"."""
    import torch

    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(memoryview(data)) or 1


def _encode_header(
    slots: tuple[TensorSlot, ...], metadata: dict[str, str], checksums: dict[str, int], size: int | None
) -> bytes:
    base = slots[0].offset if slots else 0
    header: dict = {
        slot.name: {
            "dtype": _safetensors_names()[slot.dtype],
            "shape": list(slot.shape),
            "data_offsets": [slot.offset - base, slot.offset - base + slot.num_bytes],
        }
        for slot in slots
    }
    meta = dict(metadata)
    if checksums:
        meta[_CHECKSUM_KEY] = json.dumps(
            {name: f"{value:0{_CHECKSUM_WIDTH}x}" for name, value in sorted(checksums.items())}
        )
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    if size is None:
        size = 8 + len(text) + (-(8 + len(text)) % _HEADER_ALIGN)
    if 8 + len(text) > size:
        raise ValueError(f"header grew to {8 + len(text)} bytes, more than the {size} planned")
    text += b" " * (size - 8 - len(text))
    return struct.pack("<Q", len(text)) + text


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel
