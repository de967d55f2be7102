"""Endpoint calls whose replies come back on one long-lived port per caller, for the calls made
once per prompt (a generate, a scoring) that a long run makes millions of.

Why not `call_one`: torchmonarch 0.7 keeps memory in the caller and in the callee for every
`call_one`, for the life of the process (apps/diagnostics/monarch_call_memory.py; the soak's
memory growth in docs/benchmarks/README.md). A `call_one` opens a reply port of its own; a message sent
with `.broadcast` whose answer comes back on a port the caller opened once keeps a small fraction of
that on either side (`--mode port_calls`). So the caller opens one port
(`PortCalls`), sends each request with the port and a request number to the callee's
`call_on_port` endpoint (`PortServed`), and one reader task hands each answer to its request's
future.

The port itself crosses as bytes pickled once, when the caller opens it, and the callee unpickles
each caller's port once (`PortServed._reply_port`): a Monarch `Port` pickles by value (its
`__reduce__` returns a nested function, which cloudpickle sends with its code object): more
than a kilobyte, and more pickling time than the rest of the call (`forge-rl bench scale`). A caller makes
hundreds of calls a step at 128 generators.

What changes for the caller, and what does not:
- An endpoint's error comes back as Monarch's ActorError around it, as with `call_one`
  (`forge_rl.errors.raised_by_actor` unwraps both the same way).
- A callee whose process dies never answers: the caller must watch the callee's process (the
  generator pool's watchdog and `__supervise__` do, and the scorer supervisors'), bound the call
  with a timeout (`within`), or own a callee that lives as long as the run (a dead one then ends
  the run through Monarch's fault hook). `call_one` raises a SupervisionError instead.
- A concurrent endpoint is served by `call_on_port` (itself concurrent), a plain one by
  `call_on_port_in_turn` (itself plain: until it ends, the actor handles no other message, as
  with a plain endpoint's own calls).
- `call_each` calls every actor of a mesh with one message (the trainer's ranks, each step) and
  gathers their answers in rank order; the first error fails the call at once (the other ranks
  may be waiting for the failed one in a collective).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import Any

import cloudpickle
from monarch.actor import ActorError, Channel, Port, concurrent_endpoint, context, endpoint

from forge_rl.plumbing.wire import packed

_CONCURRENT_WRAPPER_ATTR = "_monarch_concurrent_endpoint_wrapper"
"""What torchmonarch's `concurrent_endpoint` sets on the function it wraps (monarch/_src/actor/concurrent.py)."""


def is_concurrent_endpoint(actor_class: type, name: str) -> bool:
    endpoint_property = getattr(actor_class, name, None)
    method = getattr(endpoint_property, "_method", None)
    return method is not None and hasattr(method, _CONCURRENT_WRAPPER_ATTR)


class PortServed:
    """Mix into an Actor whose endpoints `PortCalls` may call."""

    @concurrent_endpoint
    async def call_on_port(self, caller_port: bytes, request: int, name: str, args: tuple, kwargs: dict) -> None:
        """A concurrent endpoint's call, answered on the caller's port."""
        await self._answer_on_port(caller_port, request, name, args, kwargs)

    @endpoint
    async def call_on_port_in_turn(
        self, caller_port: bytes, request: int, name: str, args: tuple, kwargs: dict
    ) -> None:
        """A plain endpoint's call, answered on the caller's port: until it ends, the actor handles
        no other message (as with the endpoint's own calls)."""
        await self._answer_on_port(caller_port, request, name, args, kwargs)

    async def _answer_on_port(self, caller_port: bytes, request: int, name: str, args: tuple, kwargs: dict) -> None:
        reply_to = self._reply_port(caller_port)
        rank = self._forge_rl_rank()
        try:
            method = getattr(type(self), name)._method
            # The endpoint's own function: a concurrent endpoint's wraps it (functools.wraps).
            body = getattr(method, "__wrapped__", method)
            value = await body(self, *args, **kwargs)
        except BaseException as e:  # noqa: B036 -- every outcome is the caller's, a stop's cancellation too
            failed = f"Actor call {type(self).__name__}.{name} failed."
            try:
                reply_to.send((request, False, ActorError(e, failed), rank))
            except Exception as unsendable:  # the error does not pickle: its text does
                reply_to.send(
                    (request, False, ActorError(RuntimeError(f"{e!r} (as sent: {unsendable})"), failed), rank)
                )
            if not isinstance(e, Exception):
                raise
            return
        reply_to.send((request, True, packed(value), rank))

    def _forge_rl_rank(self) -> int:
        """This actor's rank in its mesh (the order `PortCalls.call_each` answers in), looked up once."""
        rank = self.__dict__.get("_forge_rl_mesh_rank")
        if rank is None:
            rank = self.__dict__["_forge_rl_mesh_rank"] = context().actor_instance.rank.rank
        return rank

    def _reply_port(self, caller_port: bytes) -> Port:
        """The port a caller's bytes name, unpickled at its first call (in this actor's context,
        where a port it sends on must be made) and kept: a few callers, each with one port."""
        ports: dict[bytes, Port] = self.__dict__.setdefault("_forge_rl_reply_ports", {})
        port = ports.get(caller_port)
        if port is None:
            port = ports[caller_port] = cloudpickle.loads(caller_port)
        return port


class _Answers:
    """What a request waits for: the answers of `expected` actors, by rank."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.by_rank: dict[int, Any] = {}
        self.future = asyncio.get_running_loop().create_future()


class PortCalls:
    """The caller's side: `await calls.call(actor, "generate", *args)` is
    `await actor.generate.call_one(*args)` answered on this caller's one port, and
    `await calls.call_each(mesh, "train_next_step", *args)` is `await mesh.train_next_step.call(*args)`
    (the answers in rank order, a list). The port is opened at the first call, in the event loop
    (the actor) that makes the calls; its reader runs there. A handle that is not a Monarch actor
    mesh (an in-process stand-in, as unit tests pass) is called as it is, with `call_one` / `call`."""

    def __init__(self) -> None:
        self._reply_to: Any = None
        self._receiver: Any = None
        self._reply_to_pickled = b""
        """The port as the callees get it: pickled once, when it opens."""
        self._pending: dict[int, _Answers] = {}
        self._requests = itertools.count()
        self._reader: asyncio.Task | None = None

    def __reduce__(self):
        return (PortCalls, ())  # a copy in another process opens a port of its own

    async def call(self, actor, name: str, *args, **kwargs) -> Any:
        if getattr(actor, "_class", None) is None:  # not a Monarch actor mesh
            return await getattr(actor, name).call_one(*args, **kwargs)
        if actor.size() != 1:
            raise ValueError(
                f"PortCalls.call calls one actor; {actor._class.__name__}'s mesh has {actor.size()}: slice it, or use call_each"
            )
        return (await self._answered(actor, name, args, kwargs))[0]

    async def call_each(self, mesh, name: str, *args, **kwargs) -> list:
        """Every actor of `mesh` runs endpoint `name` on one message; their answers in rank order."""
        if getattr(mesh, "_class", None) is None:  # not a Monarch actor mesh
            return [value for _, value in (await getattr(mesh, name).call(*args, **kwargs)).items()]
        return await self._answered(mesh, name, args, kwargs)

    async def _answered(self, mesh, name: str, args: tuple, kwargs: dict) -> list:
        actor_class = mesh._class
        if not (
            issubclass(actor_class, PortServed) and callable(getattr(getattr(actor_class, name, None), "_method", None))
        ):
            raise TypeError(
                f"{actor_class.__name__}.{name} is not an endpoint of a PortServed actor, so PortCalls cannot call it: "
                "mix PortServed into the actor, or call the endpoint with call_one / call"
            )
        if self._reader is None:
            self._reply_to, self._receiver = Channel.open()
            self._reply_to_pickled = cloudpickle.dumps(self._reply_to)
            self._reader = asyncio.ensure_future(self._read())
            self._reader.add_done_callback(self._reader_ended)
            # The reader waits for as long as its event loop runs: pending when a process exits is
            # its normal end (BlockingPortCalls' loop never stops), not a task someone forgot.
            self._reader._log_destroy_pending = False  # type: ignore[attr-defined]  # asyncio's private flag
        request = next(self._requests)
        answers = self._pending[request] = _Answers(mesh.size())
        served_by = mesh.call_on_port if is_concurrent_endpoint(actor_class, name) else mesh.call_on_port_in_turn
        try:
            # Arguments and answers cross as the C pickler's bytes (`forge_rl.plumbing.wire`): a prompt or a
            # scored group is one object to Monarch's Python-level pickler instead of hundreds.
            served_by.broadcast(
                self._reply_to_pickled, request, name, packed(args), packed(kwargs) if kwargs else kwargs
            )
            return await answers.future
        finally:
            self._pending.pop(request, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def _read(self) -> None:
        while True:
            request, returned, value, rank = await self._receiver.recv()
            answers = self._pending.get(request)
            if answers is None or answers.future.done():
                continue  # its caller gave up (a timeout, a cancel) or an actor failed: no one to go to
            if not returned:
                answers.future.set_exception(value)
                continue
            answers.by_rank[rank] = value
            if len(answers.by_rank) == answers.expected:
                answers.future.set_result([answers.by_rank[r] for r in sorted(answers.by_rank)])

    def _reader_ended(self, reader: asyncio.Task) -> None:
        """The port failed (or its actor is stopping): every call waiting fails with the cause, and
        the next call opens a new port."""
        self._reader = None
        error = None if reader.cancelled() else reader.exception()
        for answers in self._pending.values():
            if answers.future.done():
                continue
            if error is None:
                answers.future.cancel()
            else:
                answers.future.set_exception(RuntimeError(f"the reply port stopped: {error!r}"))


class BlockingPortCalls:
    """`PortCalls` for a plain thread that has no event loop and may block (the trainer's weight
    writer): `calls.call(actor, "commit", ...)` returns the answer, `calls.submit(...)` a
    concurrent future of it. The calls run on one event loop per process, in a daemon thread of
    its own, so the port opened there stays open for the life of the process."""

    _loop: asyncio.AbstractEventLoop | None = None
    _loop_lock = threading.Lock()

    def __init__(self) -> None:
        self._calls = PortCalls()

    def __reduce__(self):
        return (BlockingPortCalls, ())

    def submit(self, actor, name: str, *args, **kwargs) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._calls.call(actor, name, *args, **kwargs), self._event_loop())

    def call(self, actor, name: str, *args, **kwargs) -> Any:
        return self.submit(actor, name, *args, **kwargs).result()

    @classmethod
    def _event_loop(cls) -> asyncio.AbstractEventLoop:
        with cls._loop_lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="forge_rl-blocking-port-calls", daemon=True).start()
                cls._loop = loop
            return cls._loop


class PortCalled:
    """`actor` as the loops call it (`handle.generate.call_one(...)`), its endpoints `only` (all,
    if None) answered on `calls`' port and the others as Monarch's own: hands the functional core
    (`forge_rl.pipeline.rollouts`, `forge_rl.run.loop`, which never import Monarch) a handle whose frequent
    calls keep nothing behind. Sent to another actor, it arrives as `actor` itself."""

    def __init__(self, actor, calls: PortCalls, only: tuple[str, ...] | None = None):
        self._actor, self._calls, self._only = actor, calls, only

    def __getattr__(self, name: str):
        if name.startswith("_") or (self._only is not None and name not in self._only):
            return getattr(self._actor, name)
        return _PortEndpoint(self._actor, self._calls, name)

    def __reduce_ex__(self, protocol):
        return self._actor.__reduce_ex__(protocol)


class _PortEndpoint:
    def __init__(self, actor, calls: PortCalls, name: str):
        self._actor, self._calls, self._name = actor, calls, name

    async def call_one(self, *args, **kwargs) -> Any:
        return await self._calls.call(self._actor, self._name, *args, **kwargs)

    async def call(self, *args, **kwargs) -> list:
        """Every actor of the mesh: their answers in rank order (a list, where Monarch's `call`
        gives a ValueMesh; `forge_rl.plumbing.replies.rank_zero` reads both)."""
        return await self._calls.call_each(self._actor, self._name, *args, **kwargs)
