"""Calls answered on the caller's one port (forge_rl/plumbing/port_calls.py), between real Monarch
actors: answers reach their own request, an endpoint's error comes back as with `call_one`, a plain
endpoint is served in turn, a call on a mesh gathers its actors' answers in rank order, and what
cannot be called that way is refused before anything is sent. That these calls keep no memory
behind is measured, not tested: `python apps/diagnostics/monarch_call_memory.py --mode port_calls`."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from monarch.actor import Actor, Channel, concurrent_endpoint, endpoint, this_host

from forge_rl.errors import raised_by_actor
from forge_rl.plumbing.port_calls import BlockingPortCalls, PortCalled, PortCalls, PortServed
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.types import Episode
from tests.support.fakes import completions_for

pytestmark = pytest.mark.integration


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class Served(PortServed, Actor):
    def __init__(self):
        self.release = asyncio.Event()
        self.plain_order: list[str] = []

    @concurrent_endpoint
    async def double(self, value: int) -> int:
        return 2 * value

    @concurrent_endpoint
    async def held(self, value: int) -> int:
        await self.release.wait()  # answers only once `release` is called
        return value

    @concurrent_endpoint
    async def release_held(self) -> None:
        self.release.set()

    @concurrent_endpoint
    async def fail(self, kind: str) -> None:
        if kind == "key":
            raise KeyError("no such row")
        raise Unpicklable()

    @concurrent_endpoint
    async def echo(self, value, *, times: int = 1):
        return [value] * times

    @concurrent_endpoint
    async def apply(self, function, value):
        return function(value)

    @concurrent_endpoint
    async def pid(self) -> int:
        return os.getpid()

    @concurrent_endpoint
    async def num_reply_ports(self) -> int:
        return len(self._forge_rl_reply_ports)

    @endpoint
    async def handle_arrived(self, handle) -> str:
        """What a PortCalled arrived as."""
        return type(handle).__name__

    @endpoint
    async def plain(self) -> int:
        self.plain_order.append("plain")
        return 1

    @endpoint
    async def plain_held(self, tell) -> str:
        """A plain endpoint that sends `tell` a port and answers once something comes on it. While it
        waits, the actor handles no other message (Monarch's plain endpoints hold its mailbox)."""
        self.plain_order.append("held")
        release, released = Channel.open()
        tell.send(release)
        await released.recv()
        self.plain_order.append("held-end")
        return "held"

    @endpoint
    async def order_of_plain_calls(self) -> list[str]:
        return self.plain_order

    def not_an_endpoint(self) -> None:
        pass


class Ranked(PortServed, Actor):
    """A mesh of two, as the trainer's ranks."""

    def __init__(self):
        from monarch.actor import context

        self.rank = context().actor_instance.rank.rank
        self.released = asyncio.Event()

    @endpoint
    async def rank_and(self, value: int) -> tuple[int, int]:
        return self.rank, value

    @concurrent_endpoint  # so that `release` is served while rank 0 waits here
    async def fail_on_rank_one(self) -> None:
        if self.rank == 1:
            raise KeyError("rank one failed")
        await self.released.wait()  # as a rank waiting in a collective for the one that failed

    @concurrent_endpoint
    async def release(self) -> None:
        """Ends rank 0's wait, so that stopping the mesh finds no endpoint still running (an actor
        stopped mid-endpoint may outlast the stop's grace on a loaded machine, and its process
        is then killed: a fault of the mesh)."""
        self.released.set()


class Caller(Actor):
    """Makes the calls from an actor, as the pool and the rollouts do."""

    def __init__(self, served, ranked):
        self.served, self.ranked = served, ranked
        self.calls = PortCalls()

    @endpoint
    async def run(self) -> dict:
        served, calls = self.served, self.calls
        out = {"single": await calls.call(served, "double", 21)}
        # Answers that arrive out of order reach their own requests.
        held = [asyncio.ensure_future(calls.call(served, "held", i)) for i in range(3)]
        doubled = await asyncio.gather(*(calls.call(served, "double", i) for i in range(5)))
        out["pending_while_held"] = calls.num_pending
        await calls.call(served, "release_held")
        out["held"] = await asyncio.gather(*held)
        out["doubled"] = doubled
        out["pending_after"] = calls.num_pending
        try:
            await calls.call(served, "fail", "key")
        except Exception as e:
            out["error"] = (type(raised_by_actor(e)).__name__, "no such row" in str(raised_by_actor(e)))
        try:
            await calls.call(served, "fail", "unpicklable")
        except Exception as e:
            out["unpicklable"] = (type(raised_by_actor(e)).__name__, "holds a lock" in str(raised_by_actor(e)))
        out["plain"] = await calls.call(served, "plain")
        # A plain endpoint is served in turn: the plain call sent after a held one runs once it ended.
        tell, told = Channel.open()
        held = asyncio.ensure_future(calls.call(served, "plain_held", tell))
        after = asyncio.ensure_future(calls.call(served, "plain"))
        release = await told.recv()  # the held call runs
        release.send(None)
        out["plain_answers"] = await asyncio.gather(held, after)
        out["plain_order"] = await calls.call(served, "order_of_plain_calls")
        try:
            await calls.call(served, "not_an_endpoint")
        except TypeError as e:
            out["not_an_endpoint"] = str(e)
        out["each"] = await calls.call_each(self.ranked, "rank_and", 7)
        out["each_through_handle"] = await PortCalled(self.ranked, calls).rank_and.call(8)
        try:
            await calls.call_each(self.ranked, "fail_on_rank_one")
        except Exception as e:
            out["each_error"] = (type(raised_by_actor(e)).__name__, "rank one failed" in str(raised_by_actor(e)))
        out["through_handle"] = await PortCalled(served, calls).double.call_one(4)
        # Episodes cross packed as the C pickler's bytes (forge_rl/plumbing/wire.py), and so does the answer;
        # a function, which only cloudpickle pickles, crosses as it always did.
        out["episodes_sent"] = [Episode(3, "M37=", "7", [1, 2, 3], completions_for(Episode(3, "", "", []), 2, 5))]
        out["episodes_back"] = await calls.call(served, "echo", out["episodes_sent"], times=2)
        out["applied"] = await calls.call(served, "apply", lambda x: x + 1, 41)
        out["from_a_thread"] = await asyncio.to_thread(self._blocking_calls, served)
        out["reply_ports_held"] = await calls.call(served, "num_reply_ports")
        out["handle_arrived"] = await served.handle_arrived.call_one(PortCalled(served, calls))
        return out

    @staticmethod
    def _blocking_calls(served) -> list:
        """From a plain thread, as the trainer's weight writer calls the store's index."""
        blocking = BlockingPortCalls()
        submitted = blocking.submit(served, "double", 3)
        answers = [blocking.call(served, "double", 5), submitted.result()]
        try:
            blocking.call(served, "fail", "key")
        except Exception as e:
            answers.append(type(raised_by_actor(e)).__name__)
        return answers


@pytest.fixture(scope="module")
def results():
    async def run():
        procs = spawn_procs(this_host(), "callee", 4)
        served = procs.slice(procs=0).spawn("served", Served)
        ranked = procs.slice(procs=slice(2, 4)).spawn("ranked", Ranked)
        caller = procs.slice(procs=1).spawn("caller", Caller, served, ranked)
        try:
            return await caller.run.call_one()
        finally:
            await ranked.release.call()
            await procs.stop()

    return asyncio.run(run())


def test_answers_reach_their_own_requests_whatever_the_order(results):
    assert results["single"] == 42
    assert results["doubled"] == [0, 2, 4, 6, 8]
    assert results["pending_while_held"] == 3  # the held calls wait; the others were answered
    assert results["held"] == [0, 1, 2]
    assert results["pending_after"] == 0
    assert results["through_handle"] == 8
    assert results["from_a_thread"] == [10, 6, "KeyError"]


def test_the_callee_unpickles_each_callers_port_once(results):
    # About thirty calls from two callers (this actor's PortCalls and a BlockingPortCalls' own
    # port): each port crossed as bytes pickled once, and the callee made a Port of them once.
    assert results["reply_ports_held"] == 2


def test_a_port_called_handle_arrives_as_the_handle_itself(results):
    # Not unpickled once per process: a handle's bytes pickled inside Monarch's message pickler may
    # hold a mesh-reference slot that only that message fills (this test
    # caught it). The train loop sends the rollouts' handle once instead.
    assert results["handle_arrived"] == "ActorMesh"


def test_episodes_and_keywords_cross_and_come_back_whole_and_a_function_crosses_as_before(results):
    assert results["episodes_back"] == [results["episodes_sent"]] * 2
    assert results["applied"] == 42


def test_an_endpoint_error_comes_back_to_its_caller_with_its_type_and_an_unpicklable_one_as_text(results):
    assert results["error"] == ("KeyError", True)
    assert results["unpicklable"] == ("RuntimeError", True)


def test_a_plain_endpoint_is_served_in_turn(results):
    assert results["plain"] == 1
    assert results["plain_answers"] == ["held", 1]
    assert results["plain_order"] == ["plain", "held", "held-end", "plain"]  # the second plain call waited


def test_what_is_not_an_endpoint_is_refused_before_anything_is_sent(results):
    assert "Served.not_an_endpoint is not an endpoint of a PortServed actor" in results["not_an_endpoint"]


def test_a_call_on_a_mesh_gathers_its_answers_in_rank_order_and_fails_at_the_first_error(results):
    assert results["each"] == [(0, 7), (1, 7)]
    assert results["each_through_handle"] == [(0, 8), (1, 8)]
    # Rank 0 never answers (it waits as in a collective): the call fails with rank 1's error anyway.
    assert results["each_error"] == ("KeyError", True)


def test_an_in_process_handle_is_called_as_it_is():
    class Handle:  # an in-process stand-in, as unit tests pass (no `_class`)
        class double:
            @staticmethod
            async def call_one(value):
                return 2 * value

    assert asyncio.run(PortCalls().call(Handle(), "double", 5)) == 10
