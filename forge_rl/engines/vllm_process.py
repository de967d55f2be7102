"""The processes of a vLLM engine: the environment they start with, the socket directories they leave
behind when killed, the devices they see, and the resource tracker that is not one of them."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import psutil

ENGINE_PROCESS_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
"""Settings read when a process starts (`engine_process_env`): variable -> one ':'-separated item."""


def engine_process_env() -> dict[str, str]:
    """Environment a process that will host a VLLMEngine must start with (read at its exec, so
    it is set where the process is spawned: `forge_rl.actors.generator_pool`).

    Transparent huge pages for malloc's large blocks (glibc >= 2.35; ignored before): every
    staged version repacks its linear weights into fresh oneDNN buffers, and with 4 KiB pages
    their first touch costs a minor fault per page of every version (where THP is
    "madvise", the common default, nothing else asks for huge pages). The engine core is forked
    from this process on CPU (`VLLMEngine._engine_core_start`), so it has this process's
    malloc settings."""
    env = {}
    for key, item in ENGINE_PROCESS_ENV.items():
        items = [i for i in os.environ.get(key, "").split(":") if i]
        env[key] = ":".join(items if item in items else [*items, item])
    return env


SOCKET_DIR_PREFIX = "forge_rl_vllm_"
"""An engine's socket directory in the temp directory: this, its process's pid, "_", a random tail."""


def remove_dead_engines_socket_dirs(min_age_s: float = 600.0) -> list[str]:
    """Removes the socket directories (`VLLMEngine.start`) of engines whose process is gone, as a
    SIGKILL of the engine's whole process tree (its reaper included) leaves them; returns them.
    Only directories older than `min_age_s`: a temp directory shared with another pid namespace
    (a container's) may hold a starting engine whose pid means nothing here."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{SOCKET_DIR_PREFIX}*_*")):
        pid = os.path.basename(path)[len(SOCKET_DIR_PREFIX) :].split("_", 1)[0]
        try:
            if not pid.isdigit() or psutil.pid_exists(int(pid)) or time.time() - os.stat(path).st_mtime < min_age_s:
                continue
        except FileNotFoundError:  # another engine's start removed it first
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def is_resource_tracker(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker (started by vLLM's shared memory), which is not part of
    the engine: it exits on its own once no process holds it."""
    with contextlib.suppress(psutil.Error):
        return "resource_tracker" in " ".join(process.cmdline())
    return False


def visible_devices(cuda_devices: tuple[int, ...], inherited: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine assigned `cuda_devices`, indices among the devices this
    process sees. When this process already has a CUDA_VISIBLE_DEVICES (a SLURM job step sets one
    for its GPUs), the indices pick entries of it, so the engine stays on the job's GPUs:

        visible_devices((1,), None)       -> "1"
        visible_devices((1,), "4,5,6,7")  -> "5"
    """
    if not inherited or not inherited.strip():
        return ",".join(str(index) for index in cuda_devices)
    entries = [entry.strip() for entry in inherited.split(",") if entry.strip()]
    outside = [index for index in cuda_devices if index >= len(entries)]
    if outside:
        raise ValueError(
            f"the engine was assigned CUDA device {outside[0]}, but this process sees {len(entries)} "
            f"(CUDA_VISIBLE_DEVICES={inherited}). Place fewer generators or ranks on this host "
            "(--launch.placement.*, --num-generators, --generator.tensor-parallel-size)."
        )
    return ",".join(entries[index] for index in cuda_devices)


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the processes started inside the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
