"""A gate that lets many holders in at once, or one exclusive holder alone (a readers-writer lock
that prefers the writer: once an exclusive holder waits, new shared holders wait behind it, so a
steady stream of shared ones cannot starve it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SharedOrExclusive:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._changed:
                self._shared -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            self._exclusive_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._changed:
                self._exclusive = False
                self._changed.notify_all()

    @property
    def holders(self) -> int:
        """Shared holders in now (1 for an exclusive one)."""
        return self._shared + self._exclusive

    @property
    def exclusive_waiting(self) -> int:
        """Exclusive holders waiting to come in."""
        return self._exclusive_waiting
