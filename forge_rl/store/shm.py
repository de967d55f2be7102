"""Versioned weight snapshots in host shared memory, in the HF wire format vLLM reloads.

Layout under `root` (a /dev/shm directory on Linux):

    v00000003/model.safetensors    HF parameter names, the dtype the generator serves
    v00000003/config.json          copied from the model directory (vLLM's reload needs it)

A snapshot is written to `v00000003.partial/` and renamed into place, so a reader that sees
`v00000003/` sees a complete version (rename is atomic within one filesystem). The newest
`keep_versions` snapshots are kept; generators always load the newest, so an older one is only
deleted once `keep_versions - 1` newer ones exist.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

_VERSION_DIR = re.compile(r"^v(\d{8})$")
_CONFIG_FILES = ("config.json", "generation_config.json")


def default_store_root(run_name: str) -> Path:
    """Host shared memory where the OS has it (Linux), else a temp directory."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"forge_rl-{run_name}"


@dataclass(frozen=True)
class PublishStats:
    policy_version: int
    num_bytes: int
    write_s: float


class SharedMemoryWeightStore:
    def __init__(self, root: Path, model_dir: Path, keep_versions: int = 3):
        self.root = Path(root)
        self.model_dir = Path(model_dir)
        self.keep_versions = keep_versions
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, policy_version: int) -> Path:
        return self.root / f"v{policy_version:08d}"

    def versions(self) -> list[int]:
        found = (_VERSION_DIR.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest_version(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def publish(self, policy_version: int, hf_state_dict: dict[str, torch.Tensor]) -> PublishStats:
        start = time.perf_counter()
        final = self.path(policy_version)
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        tensors = {name: t.detach().contiguous().cpu() for name, t in hf_state_dict.items()}
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        for name in _CONFIG_FILES:
            if (self.model_dir / name).is_file():
                shutil.copy2(self.model_dir / name, partial / name)
        partial.rename(final)
        self._collect_garbage()
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return PublishStats(policy_version, num_bytes, time.perf_counter() - start)

    def _collect_garbage(self) -> None:
        for version in self.versions()[: -self.keep_versions]:
            shutil.rmtree(self.path(version), ignore_errors=True)

    def destroy(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
