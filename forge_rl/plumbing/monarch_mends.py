"""Mends for races in torchmonarch that forge_rl's processes meet, each installed once per process
before any actor runs (`install`): in every process forge_rl spawns (`forge_rl.plumbing.proc_main`) and in a
controller or worker that spawns them (`forge_rl.run.launch`)."""

from __future__ import annotations

import threading


def install() -> None:
    make_torch_pickling_thread_safe()


def make_torch_pickling_thread_safe() -> None:
    """torchmonarch 0.7 builds its torch-aware pickler lazily (`monarch._src.actor.pickle.
    _ensure_torch_pickle`) and marks it built before building it: a second thread pickling a
    message meanwhile finds it marked and calls a pickler that is still None ("TypeError:
    'NoneType' object is not callable"). Two supervisors in one process starting at once meet it on
    a loaded machine (test_frozen_model_recovery). Here the building is done under a lock, once,
    and a caller waits for it instead of racing past it."""
    from monarch._src.actor import pickle as monarch_pickle

    build = monarch_pickle._ensure_torch_pickle
    if getattr(build, "forge_rl_locked", False):
        return
    lock = threading.Lock()

    def ensure_torch_pickle() -> None:
        if monarch_pickle._TorchPickler is not None:
            return
        with lock:
            if monarch_pickle._TorchPickler is None:
                monarch_pickle._torch_pickle_initialized = False  # marked by a racer, never built
                build()

    ensure_torch_pickle.forge_rl_locked = True  # type: ignore[attr-defined]  # a mark read back by getattr above
    monarch_pickle._ensure_torch_pickle = ensure_torch_pickle
