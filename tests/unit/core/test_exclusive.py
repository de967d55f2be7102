"""SharedOrExclusive: many shared holders at once, an exclusive one alone, and a waiting exclusive
holder served before shared ones that arrive after it."""

import asyncio

from forge_rl.core.exclusive import SharedOrExclusive
from tests.support.helpers import wait_until_async


def test_an_exclusive_holder_waits_for_the_shared_ones_and_new_shared_ones_wait_for_it():
    async def scenario():
        gate = SharedOrExclusive()
        order: list[str] = []
        release_first = asyncio.Event()

        async def shared(name: str, release: asyncio.Event | None = None):
            async with gate.shared():
                order.append(f"{name} in")
                if release is not None:
                    await release.wait()
                order.append(f"{name} out")

        async def exclusive():
            async with gate.exclusive():
                assert gate.holders == 1
                order.append("exclusive")

        first = asyncio.create_task(shared("first", release_first))
        await wait_until_async(lambda: order == ["first in"], "the first shared holder to be in")
        waiting = asyncio.create_task(exclusive())
        await wait_until_async(lambda: gate.exclusive_waiting == 1, "the exclusive holder to wait")
        late = asyncio.create_task(shared("late"))
        # The late one has run to where it blocks (a task runs up to its first suspension in one
        # turn of the loop): nothing of it may show yet.
        await asyncio.sleep(0)
        assert (
            order == ["first in"] and gate.holders == 1
        )  # the exclusive one waits for the first; the late one behind it
        release_first.set()
        await asyncio.gather(first, waiting, late)
        assert order == ["first in", "first out", "exclusive", "late in", "late out"]
        assert gate.holders == 0

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_shared_holders_hold_together_and_a_cancelled_exclusive_waiter_blocks_nobody():
    async def scenario():
        gate = SharedOrExclusive()
        inside = asyncio.Event()
        release = asyncio.Event()

        async def shared():
            async with gate.shared():
                if gate.holders == 2:
                    inside.set()
                await release.wait()

        holders = [asyncio.create_task(shared()) for _ in range(2)]
        await inside.wait()  # both inside at once
        waiter = asyncio.create_task(gate.exclusive().__aenter__())
        await wait_until_async(lambda: gate.exclusive_waiting == 1, "the exclusive holder to wait")
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert gate.exclusive_waiting == 0
        async with gate.shared():  # not held back by the waiter that gave up
            assert gate.holders == 3
        release.set()
        await asyncio.gather(*holders)

    asyncio.run(asyncio.wait_for(scenario(), 10))
