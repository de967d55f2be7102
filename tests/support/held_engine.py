"""A VLLMEngine the test can hold mid-request, so a weight swap lands between two known decode steps.

The swap tests need every request of a batch to have decoded some tokens and to have some left
when the swap lands. Racing a probe or a sleep against the engine cannot promise that (the engine
may finish the batch, or not have started it, before the pause arrives); this module makes it true
by construction, from what vLLM 0.32 guarantees (vllm/v1/engine/core.py, v1/core/sched/scheduler.py):

1. While paused in "keep" mode (`PauseState.PAUSED_ALL`) the engine core schedules nothing; requests
   added meanwhile wait in its queue. Adds and utility calls (pause, resume) travel on one socket
   and the busy loop handles them in arrival order, all of them before its next step, so every
   request sent before `resume` is waiting when the first step after it is scheduled.
2. That step schedules the waiting requests first come, first served, as many as `max_num_seqs` and
   the token budget allow: a batch that fits starts together and then decodes in lockstep (the CPU
   platform turns async scheduling off, so a step is schedule, execute, `update_from_output`).
3. `HoldingScheduler` (this engine's scheduler, tests/support/holding_scheduler.py) pauses the engine itself, inside the very
   `update_from_output` that finishes a request for `HOLD_PROMPT`. A holder request of
   `forced_length=k` started with the batch thus stops the engine exactly when every request of
   the batch has decoded k tokens; nothing is sampled until someone resumes (a weight swap does).

`hold_mid_request` strings these together; `start_held_batch` is it for a batch of `generate`
calls. The engine is a test subclass, not a library feature: the hold exists only to make a race
testable. Nothing here imports vLLM (collecting the tests
stays cheap); the scheduler module is imported by the engine-core process only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from forge_rl.engines.vllm_engine import VLLMEngine
from tests.support.helpers import wait_until_async

T = TypeVar("T")

HOLD_PROMPT = [1, 3, 3, 3, 3, 2]
"""The holder's prompt; no other test sends it (the scheduler recognises the holder by it)."""


class HoldableEngine(VLLMEngine):
    """A VLLMEngine whose engine core runs `HoldingScheduler`, with the calls `hold_mid_request` needs."""

    def _engine_kwargs(self, model_dir, max_model_len) -> dict:
        return super()._engine_kwargs(model_dir, max_model_len) | {
            "scheduler_cls": "tests.support.holding_scheduler.HoldingScheduler"
        }

    async def pause(self) -> None:
        """Pause in "keep" mode: nothing is scheduled, new requests queue."""
        await self._running_llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self._running_llm.resume_generation()

    def num_submitted(self) -> int:
        """Requests (children of n > 1 one each) handed to the engine core and not finished.

        AsyncLLM registers a request and sends it to the engine core in one synchronous run
        (`_add_request`; pyzmq sends without blocking), so a registered request is a sent one.
        """
        return self._running_llm.get_num_unfinished_requests()


async def start_held_batch(
    engine: HoldableEngine, prompts: list[list[int]], n: int, hold_after_tokens: int = 4
) -> asyncio.Future:
    """Start `n` samples of each prompt (eos ignored) and return their gathered future once the
    engine is held with every one of them mid-request: each has decoded exactly
    `hold_after_tokens` tokens, none has finished, and nothing decodes until the next resume (a
    weight swap resumes). The batch plus the holder must fit one step (`max_num_seqs`).
    """
    return await hold_mid_request(
        engine,
        lambda: asyncio.gather(*(engine.generate(p, n=n, eos_id=None) for p in prompts)),
        num_requests=len(prompts) * n,
        hold_after_tokens=hold_after_tokens,
    )


async def hold_mid_request(
    engine: HoldableEngine, submit: Callable[[], Awaitable[T]], num_requests: int, hold_after_tokens: int
) -> asyncio.Future[T]:
    """Run `submit()` (which sends `num_requests` requests to the engine, none of which may stop
    before `hold_after_tokens` tokens: eos ignored) and return its future once the engine is held
    with each of them `hold_after_tokens` tokens in; nothing decodes until the next resume.
    """
    await engine.pause()
    expected = engine.num_submitted() + num_requests + 1
    requests = asyncio.ensure_future(submit())
    holder = asyncio.ensure_future(engine.generate(HOLD_PROMPT, n=1, eos_id=None, forced_length=hold_after_tokens))
    # Every request is sent before the resume, so all start in the first step after it.
    await wait_until_async(lambda: engine.num_submitted() == expected, "the requests reaching the engine")
    await engine.resume()
    (held,) = await holder  # finished: the engine has paused itself in the same step
    assert held.num_tokens == hold_after_tokens
    return requests
