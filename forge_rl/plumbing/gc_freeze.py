"""Keep the garbage collector's full collections off the run's critical paths.

A process of a run holds a few million objects from its start (torch, TorchTitan, Monarch, the
model, the configs) that live until it exits. CPython's full (generation 2) collection scans all of
them, so every one stalls the process for a noticeable part of a step on the CPU demo
(`configs/grpo_tiny_cpu.yaml`; gc.callbacks shows them): in the controller every rollout and the
train loop wait meanwhile, in the trainer it falls inside a step. `gc.freeze()` moves every object
alive now to a permanent generation that collections skip; objects made later are collected as
before, so a full collection then scans only the run's own short-lived state. Cycles among the
frozen objects are never freed, which costs nothing for objects that live as long as the process
anyway.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from later collections (see the module
    docstring). Call it when a process has finished starting, before its steady-state work.

    Unfrozen again at the interpreter's exit, so the exit's own collections free them: frozen,
    native objects were left alive at exit, and nanobind printed "leaked instances" warnings for
    triton's after every run (the trainer's process imports triton through torch)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # registering twice is harmless: unfreeze is idempotent


@contextlib.contextmanager
def frozen_startup_objects() -> Iterator[None]:
    """`freeze_startup_objects()` for the duration of the block, for a process that outlives it
    (the controller's, which may run several runs, as the tests do): the objects frozen at its
    start are collectable again afterwards."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()
