"""How long a vLLM worker spends running the model: the generator's side of the per-step breakdown.

A generator's time splits into decode work (the engine's forward passes and sampling), waiting
(no request in flight: the timeline's idle time) and the rest (scheduling, detokenization,
messages, weight swaps). The forward time is only visible inside the worker, so this mixin of
forge_rl's `worker_extension_cls` (`forge_rl.engines.routing_capture.ForgeWorkerExtension`)
wraps the worker's `execute_model` and `sample_tokens` and adds up their wall time:

    forge_start_forward_clock()   wrap them (once, after the engine started): warm-up and
                                  profiling runs before it are not counted
    forge_forward_time()          {"forward_s", "forward_steps"} since then, and "add_lora_s": the
                                  newest adapter loads' times in the worker (the engine core runs it between
                                  two decode steps, so the decode stall it causes; the caller's
                                  round trip adds the wait for the step in progress)

On CPU the calls are synchronous, so their wall time is the forward pass. On GPU with asynchronous
scheduling `execute_model` returns before the kernels finish and `sample_tokens` waits for them:
their sum is still the step's model time, minus the host work that overlaps it.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from typing import Any


class ForwardClockExtension:
    add_lora: Callable[..., Any]
    """vLLM's worker's, which this class is mixed into."""

    def forge_start_forward_clock(self) -> None:
        if getattr(self, "_forge_forward_clock", None) is not None:
            return
        clock: dict[str, Any]
        # The newest adapter loads only: a run loads one per policy version.
        self._forge_forward_clock = clock = {
            "forward_s": 0.0,
            "forward_steps": 0,
            "add_lora_s": collections.deque(maxlen=64),
        }
        for name in ("execute_model", "sample_tokens"):
            method = getattr(self, name, None)
            if method is not None:
                setattr(self, name, _timed(method, functools.partial(_add_forward, clock, name == "execute_model")))
        self.add_lora = _timed(self.add_lora, clock["add_lora_s"].append)

    def forge_forward_time(self) -> dict:
        clock = getattr(self, "_forge_forward_clock", None)
        if clock is None:
            return {"forward_s": 0.0, "forward_steps": 0, "add_lora_s": []}
        return {**clock, "add_lora_s": list(clock["add_lora_s"])}


def _add_forward(clock: dict, counts_steps: bool, seconds: float) -> None:
    clock["forward_s"] += seconds
    clock["forward_steps"] += counts_steps


def _timed(method, record: Callable[[float], None]):
    """`method`, passing each call's wall time (seconds) to `record`, raised or not."""

    @functools.wraps(method)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record(time.perf_counter() - started)

    return timed
