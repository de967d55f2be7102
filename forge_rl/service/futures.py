"""The Tinker API's futures: every long operation answers at once with a request id, and the client
polls /api/v1/retrieve_future for its result.

`FutureTable` runs each operation as an asyncio task and keeps its outcome until the client has
fetched it. Operations on one training model run one at a time in the order of their `seq_id`
(the SDK numbers each training client's requests 1, 2, ... and may send the chunks of one
forward_backward out of order); operations on different models, and samples, run concurrently.

A retrieve waits up to `poll_wait_s` for the outcome before answering "try again", so a client
polls a few times a minute rather than spinning. An outcome stays `retention_s` after it was
fetched (a client whose poll timed out in transit asks again) and `unclaimed_s` if never fetched;
then it is dropped, so the table's memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from forge_rl.service.backend import RequestRefused

logger = logging.getLogger(__name__)

Category = Literal["user", "server"]


@dataclass
class Outcome:
    """A finished operation: its value, or its error and whose fault it was."""

    value: Any = None
    error: str | None = None
    category: Category | None = None


@dataclass
class _Future:
    request_id: str
    kind: str
    model_id: str | None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    task: asyncio.Task[None] | None = None
    seq_key: tuple[str, int] | None = None
    started: bool = False
    finished_at: float | None = None
    retrieved_at: float | None = None


@dataclass(order=True)
class _Queued:
    seq_id: int
    arrival: int
    ordered: bool = field(compare=False)
    """False: sent without a seq_id, queued after what was queued before it."""
    future: _Future | None = field(compare=False)
    """None: a seq_id that was refused before it became an operation, held so the queue does not
    wait for it."""
    run: Callable[[], Awaitable[Any]] | None = field(compare=False)


class _ModelQueue:
    """One training model's operations, run one at a time by seq_id. A missing seq_id is awaited
    up to `gap_wait_s` (the SDK sends a request's chunks concurrently), then passed over, so a
    request lost in transit delays the model's queue and does not stall it."""

    def __init__(self, gap_wait_s: float) -> None:
        self.heap: list[_Queued] = []
        self.next_seq = 1
        self.changed = asyncio.Event()
        self.worker: asyncio.Task[None] | None = None
        self.gap_wait_s = gap_wait_s
        self.gap_since: float | None = None
        """When the queue began waiting for `next_seq`: later arrivals do not extend the wait."""


class FutureTable:
    def __init__(
        self,
        *,
        poll_wait_s: float = 5.0,
        retention_s: float = 60.0,
        unclaimed_s: float = 3600.0,
        gap_wait_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.poll_wait_s = poll_wait_s
        self.retention_s = retention_s
        self.unclaimed_s = unclaimed_s
        self.gap_wait_s = gap_wait_s
        self._clock = clock
        self._futures: dict[str, _Future] = {}
        self._queues: dict[str, _ModelQueue] = {}
        self._by_seq: dict[tuple[str, int], tuple[str, bytes]] = {}
        """(model_id, seq_id) -> the request id and body fingerprint of the request that took it."""
        self._arrivals = itertools.count()
        self._pending: Counter[str] = Counter()

    # --- submitting ----------------------------------------------------------------------------

    def submit(
        self,
        kind: str,
        run: Callable[[], Awaitable[Any]],
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        body: bytes = b"",
    ) -> str:
        """Start `run` (on `model_id`'s queue when given, in `seq_id` order) and return its request
        id. The same `body` again under the same (model_id, seq_id) is the client's retry of one
        request (the SDK resends after a lost connection): it gets the first one's id and runs once."""
        self._sweep()
        fingerprint = hashlib.blake2b(body, digest_size=16).digest()
        if model_id is not None and seq_id is not None:
            earlier = self._by_seq.get((model_id, seq_id))
            if earlier is not None and earlier[1] == fingerprint and earlier[0] in self._futures:
                return earlier[0]
        future = _Future(request_id=f"req-{uuid.uuid4().hex}", kind=kind, model_id=model_id)
        self._futures[future.request_id] = future
        self._pending[kind] += 1
        if model_id is None:
            future.task = asyncio.get_running_loop().create_task(self._run(future, run))
        else:
            if seq_id is not None:
                future.seq_key = (model_id, seq_id)
                self._by_seq[future.seq_key] = (future.request_id, fingerprint)
            self._enqueue(model_id, seq_id, future, run)
        return future.request_id

    def pass_over(self, model_id: str, seq_id: int | None) -> None:
        """Mark `seq_id` of `model_id` as taken by a request refused before it became an operation,
        so the model's later operations do not wait for it."""
        if seq_id is not None:
            self._enqueue(model_id, seq_id, None, None)

    def forget_model(self, model_id: str) -> None:
        """Drop an unloaded model's queue (its operations have all run) and its seq_ids."""
        self._queues.pop(model_id, None)  # its worker, if still running, ends with its heap
        for key in [k for k in self._by_seq if k[0] == model_id]:
            del self._by_seq[key]

    def _enqueue(
        self, model_id: str, seq_id: int | None, future: _Future | None, run: Callable[[], Awaitable[Any]] | None
    ) -> None:
        queue = self._queues.get(model_id)
        if queue is None:
            queue = self._queues[model_id] = _ModelQueue(self.gap_wait_s)
        if seq_id is not None:
            key = seq_id
        else:  # after everything queued before it
            key = max((q.seq_id for q in queue.heap), default=queue.next_seq - 1)
        heapq.heappush(queue.heap, _Queued(key, next(self._arrivals), seq_id is not None, future, run))
        queue.changed.set()
        if queue.worker is None or queue.worker.done():
            queue.worker = asyncio.get_running_loop().create_task(self._drain(model_id, queue))

    async def _drain(self, model_id: str, queue: _ModelQueue) -> None:
        loop = asyncio.get_running_loop()
        while queue.heap:
            head = queue.heap[0]
            if head.seq_id > queue.next_seq:
                if queue.gap_since is None:
                    queue.gap_since = loop.time()
                remaining = queue.gap_since + queue.gap_wait_s - loop.time()
                if remaining > 0:
                    queue.changed.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(queue.changed.wait(), timeout=remaining)
                    continue
                logger.warning(
                    "model %s: no request with seq_id %d arrived in %g s; running seq_id %d next",
                    model_id,
                    queue.next_seq,
                    queue.gap_wait_s,
                    head.seq_id,
                )
            queue.gap_since = None
            heapq.heappop(queue.heap)
            if head.ordered:
                queue.next_seq = max(queue.next_seq, head.seq_id + 1)
            if head.future is None or head.future.done.is_set():
                continue
            assert head.run is not None
            await self._run(head.future, head.run)

    async def _run(self, future: _Future, run: Callable[[], Awaitable[Any]]) -> None:
        future.started = True
        try:
            outcome = Outcome(value=await run())
        except RequestRefused as e:
            outcome = Outcome(error=str(e), category="user")
        except asyncio.CancelledError:
            self._finish(future, Outcome(error=f"request {future.request_id} was cancelled", category="user"))
            if future.model_id is None:
                return  # the future's own task: cancelling it ends it
            raise  # the model's worker, cancelled by close()
        except Exception as e:
            logger.exception("%s request %s failed", future.kind, future.request_id)
            outcome = Outcome(error=f"{future.kind} failed on the server: {type(e).__name__}: {e}", category="server")
        self._finish(future, outcome)

    def _finish(self, future: _Future, outcome: Outcome) -> None:
        if future.done.is_set():
            return
        future.outcome = outcome
        future.finished_at = self._clock()
        future.done.set()
        self._pending[future.kind] -= 1

    # --- retrieving ----------------------------------------------------------------------------

    def known(self, request_id: str) -> bool:
        return request_id in self._futures

    async def retrieve(self, request_id: str, wait_s: float | None = None) -> Outcome | None:
        """The outcome of `request_id`, waiting up to `wait_s` (default `poll_wait_s`) for it;
        None while it is still running. KeyError for an id never issued or already dropped."""
        future = self._futures[request_id]
        if not future.done.is_set():
            try:
                await asyncio.wait_for(future.done.wait(), timeout=self.poll_wait_s if wait_s is None else wait_s)
            except asyncio.TimeoutError:
                return None
        if future.retrieved_at is None:
            future.retrieved_at = self._clock()
        assert future.outcome is not None
        return future.outcome

    def cancel(self, request_id: str) -> bool:
        """Cancel a request that has not finished: one not yet started never runs, a running
        sample is interrupted. A running operation on a training model runs to its end, since the
        model's state would otherwise be half-changed; False then, and for an unknown or finished id."""
        future = self._futures.get(request_id)
        if future is None or future.done.is_set():
            return False
        if future.model_id is not None and future.started:
            return False
        outcome = Outcome(error=f"request {request_id} was cancelled", category="user")
        if future.model_id is None and future.task is not None:
            future.task.cancel()
        self._finish(future, outcome)
        return True

    # --- bookkeeping ---------------------------------------------------------------------------

    def _sweep(self) -> None:
        now = self._clock()
        for request_id, future in list(self._futures.items()):
            if future.finished_at is None:
                continue
            if future.retrieved_at is not None:
                expired = now - future.retrieved_at > self.retention_s
            else:
                expired = now - future.finished_at > self.unclaimed_s
            if expired:
                del self._futures[request_id]
                if future.seq_key is not None and self._by_seq.get(future.seq_key, ("",))[0] == request_id:
                    del self._by_seq[future.seq_key]

    def sweep(self) -> None:
        """Drop the outcomes past their retention (each submit does this too)."""
        self._sweep()

    def pending(self, kind: str) -> int:
        """How many `kind` operations are unfinished."""
        return self._pending[kind]

    def counts(self) -> dict[str, int]:
        pending = sum(1 for f in self._futures.values() if not f.done.is_set())
        return {"futures_pending": pending, "futures_held": len(self._futures) - pending}

    async def close(self) -> None:
        """Cancel every running operation and wait for the tasks to end."""
        tasks = [f.task for f in self._futures.values() if f.task is not None and not f.task.done()]
        tasks += [q.worker for q in self._queues.values() if q.worker is not None and not q.worker.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
