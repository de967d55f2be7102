"""Deadlines on awaited calls: one way everywhere in forge_rl.

`asyncio.timeout`, never `asyncio.wait_for`: Python 3.11's `wait_for` swallows a cancellation (a
stop, Ctrl-C) that lands just as the awaited call finishes, and the caller then carries on as if it
had not been cancelled (it hung a loop test). `deadline.expired()` tells our deadline from a
TimeoutError that the awaited call raised on its own, which passes through untouched.

Plain Python: importing this module imports nothing else of forge_rl, Monarch or vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def within(timeout_s: float, awaitable: Awaitable[T], timed_out: Callable[[], BaseException] | None = None) -> T:
    """`await awaitable`, cancelled after `timeout_s`. Past the deadline this raises `timed_out()`
    (the failure it means to the caller: a typed error, after any side effect such as starting a
    recovery), or TimeoutError when `timed_out` is None."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return await awaitable
    except TimeoutError:
        if not deadline.expired() or timed_out is None:
            raise
        raise timed_out() from None
