"""`StepTurns` (forge_rl/training/trainer.py): a trainer rank trains its concurrent steps in the order they were asked for."""

import asyncio

from forge_rl.training.trainer_steps import StepTurns


def test_steps_train_in_the_order_asked_whatever_order_their_batches_come_in():
    turns = StepTurns()
    trained: list[int] = []
    batches = {step: asyncio.Event() for step in (1, 2, 3)}

    async def step(number: int, ticket: int):
        await batches[number].wait()  # the batch
        async with turns.turn(ticket):
            trained.append(number)

    async def scenario():
        tasks = [asyncio.ensure_future(step(number, turns.take())) for number in (1, 2, 3)]
        for number in (3, 2, 1):  # batches back in reverse order
            batches[number].set()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert trained == [1, 2, 3]


def test_a_turn_that_trains_nothing_passes_in_its_order_and_a_used_one_is_not_passed_twice():
    turns = StepTurns()
    trained: list[int] = []

    async def scenario():
        first, withheld, last = turns.take(), turns.take(), turns.take()

        async def train(ticket: int, number: int):
            async with turns.turn(ticket):
                trained.append(number)
            await turns.end_unused(ticket)  # what train_pulled_batch_in_turn does after any step: a no-op here

        later = asyncio.ensure_future(train(last, 3))
        await asyncio.sleep(0)
        assert trained == []  # turn 2 is not over
        await train(first, 1)
        await turns.end_unused(withheld)
        await later

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert trained == [1, 3]
