"""`within`: the one deadline forge_rl puts on awaited calls."""

import asyncio

import pytest

from forge_rl.core.deadlines import within


class Hung(RuntimeError):
    pass


def test_past_the_deadline_the_caller_gets_the_failure_it_names():
    async def main():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(Hung):
            await within(0.01, never, lambda: Hung("hung"))
        assert never.cancelled()  # the awaited call does not outlive its deadline

    asyncio.run(main())


def test_a_timeout_the_call_raises_itself_passes_through_untouched():
    async def times_out_on_its_own():
        raise TimeoutError("the call's own")

    async def main():
        with pytest.raises(TimeoutError, match="the call's own"):
            await within(60, times_out_on_its_own(), lambda: Hung("not ours"))

    asyncio.run(main())


def test_without_a_named_failure_a_deadline_raises_timeout_error():
    async def main():
        with pytest.raises(TimeoutError):
            await within(0.01, asyncio.Event().wait())
        assert await within(None, asyncio.sleep(0, "done")) == "done"  # None: no deadline

    asyncio.run(main())


def test_a_cancellation_landing_as_the_call_finishes_is_not_swallowed():
    """The Python 3.11 asyncio.wait_for defect this module exists for: the caller is cancelled in the
    same loop iteration as the awaited call completes; the caller must still see CancelledError."""

    async def main():
        finished = asyncio.get_running_loop().create_future()

        async def caller():
            await within(60, finished)
            return "carried on"

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0)  # the caller now waits on `finished`
        finished.set_result(None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
