"""A trainer step as the train loop and the trainer's actor see it, without torch: what a step
answers (`TrainStepResult`, `PulledStep`) and how a rank takes its batch and trains in turn. The
controller unpickles these replies and spawns the trainer's actor; both stay torch-free
(tests/unit/test_package_boundaries.py), so a run's controller starts without importing torch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from forge_rl.core.columns import BatchColumns


@dataclass(frozen=True)
class TrainStepResult:
    """What one trainer step hands the train loop: what it decides on, apart from what it logs."""

    policy_version: int
    """The trainer's version after the step (unchanged when skipped)."""
    skipped: bool
    """The loss or gradient was not finite: no optimizer step, nothing published."""
    weights_dir: str | None
    """Where the new version will be in the weight store (rank 0; None when skipped)."""
    metrics: dict[str, float]
    """Batch-wide metrics for the log (`step_skipped` and `policy_version` among them)."""


@dataclass
class PulledBatch:
    """A step's batch as the rollouts hand it to each trainer rank (`Rollouts.batch_for_trainer`):
    the episodes as columns (`forge_rl.core.columns`), built once in the rollouts' process."""

    train_version: int
    """The policy version it trains at (the gate counts it from then)."""
    columns: BatchColumns | None
    """None: nothing for this trainer in the batch (with several policies, no agent of the
    seats its policy plays spoke in it); its step trains nothing and publishes nothing."""
    ready_s: float
    """When it left the buffer, on the run's timeline (the controller's clock): the end of the
    train loop's data wait."""


@dataclass
class PulledStep:
    """A trainer step on a batch the trainer took from the rollouts itself (`train_on_pulled_batch`)."""

    trained: TrainStepResult
    train_version: int
    """The version the admission gate took the batch for."""
    ready_s: float
    """When the batch left the buffer, on the run's timeline: the end of the train loop's data wait."""


class StepTurns:
    """The order a trainer rank trains the steps of its concurrent `train_next_step` calls: the order
    the calls arrived in (Monarch starts concurrent calls from one sender in order, so `take`, made
    before a call's first await, numbers them the same on every rank), whatever order their batches
    come back in. Every rank must run the same step's collectives at the same time."""

    def __init__(self) -> None:
        self._taken = 0
        self._serving = 0
        self._changed = asyncio.Condition()

    def take(self) -> int:
        """The calling step's turn number (synchronous: call it before the first await)."""
        self._taken += 1
        return self._taken - 1

    @contextlib.asynccontextmanager
    async def turn(self, ticket: int):
        """Waits until every earlier turn has ended; the turn ends with the block."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._serving == ticket)
        try:
            yield
        finally:
            await self._end(ticket)

    async def end_unused(self, ticket: int) -> None:
        """A turn that trained nothing (its batch withheld, or its call failed) ends in its order."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._serving >= ticket)
        if self._serving == ticket:
            await self._end(ticket)

    async def _end(self, ticket: int) -> None:
        async with self._changed:
            self._serving = ticket + 1
            self._changed.notify_all()


class BatchPrefetch:
    """The batches a trainer rank asked the rollouts for ahead of their steps: step k + 1's is asked
    for as soon as step k's batch is in hand, while step k trains, when the train loop says it will
    send step k + 1 next (`train_next_step`'s `prefetch_next`). Its gate wait, its message and its
    unpickling then overlap step k instead of following its reply; `train_next_step` is a plain
    endpoint, so step k + 1's call itself starts only once step k has answered."""

    def __init__(self, policy: str | None = None) -> None:
        self.policy = policy
        """The one of the run's `policies` whose part of each batch this trainer takes; None: the run's own."""
        self._asked: dict[int, asyncio.Future] = {}
        """Step -> its `batch_for_trainer` call, from the newest step taken on."""
        self._rollouts: Any = None
        """The rollouts the train loop sent with its first step (a mesh handle pickles by value, kilobytes
        and a noticeable share of a small step's time, so it is not sent with every step)."""

    def ask(self, step: int, num_ranks: int) -> asyncio.Future:
        """Asks for step `step`'s batch, unless asked already (each rank asks once per step)."""
        if step not in self._asked:
            policy = () if self.policy is None else (self.policy,)
            asked = self._asked[step] = asyncio.ensure_future(
                self._rollouts.batch_for_trainer.call_one(step, num_ranks, *policy)
            )
            # A run that stops or fails before step `step`'s call leaves its outcome unread.
            asked.add_done_callback(lambda done: done.cancelled() or done.exception())
        return self._asked[step]

    def take(self, step: int, rollouts, num_ranks: int) -> asyncio.Future:
        """Step `step`'s batch (PulledBatch, or None if withheld): the one asked for ahead, or asked
        for now. `rollouts`: the rollouts to take it from, or None for those an earlier step came
        with."""
        if rollouts is not None:
            self._rollouts = rollouts
        elif self._rollouts is None:
            raise RuntimeError(
                f"step {step} came without the rollouts to take its batch from, and no step before it brought them: "
                "the train loop sends the rollouts' handle with the first step it sends (forge_rl/run/loop.py _send_step)"
            )
        for older in [s for s in self._asked if s < step]:
            del self._asked[older]
        return self.ask(step, num_ranks)


async def train_on_pulled_batch(
    step: int,
    rollouts,
    num_ranks: int,
    train: Callable[[BatchColumns | None], Awaitable[TrainStepResult]],
    prefetch: BatchPrefetch,
    prefetch_next: bool,
) -> PulledStep | None:
    """What a trainer rank does for step `step`: ask the rollouts
    (`forge_rl.pipeline.rollouts.Rollouts.batch_for_trainer`) for the step's batch (unless `prefetch` asked
    already), which they hand to
    each of the `num_ranks` ranks once the admission gate lets it go, then, with `prefetch_next`,
    ask for step + 1's, and `train` on this one. The batch then crosses one message from where its
    last episode arrived to the trainer, instead of two through the controller. None if a stop
    withheld the batch: nothing was taken, nothing trained, nothing asked for ahead. `rollouts` is
    None after the first step: `prefetch` keeps the first step's."""
    batch = await prefetch.take(step, rollouts, num_ranks)
    if batch is None:
        return None
    if prefetch_next:
        prefetch.ask(step + 1, num_ranks)
        # Let the ask go out now: a real trainer's step holds the event loop until it ends.
        await asyncio.sleep(0)
    return PulledStep(await train(batch.columns), batch.train_version, batch.ready_s)


async def train_pulled_batch_in_turn(
    turns: StepTurns,
    step: int,
    rollouts,
    num_ranks: int,
    train: Callable[[BatchColumns | None], Awaitable[TrainStepResult]],
    prefetch: BatchPrefetch,
    prefetch_next: bool,
) -> PulledStep | None:
    """`train_on_pulled_batch` with the step trained in its turn (`StepTurns`): safe should the
    endpoint run concurrently with an earlier step's (batch asked for at once, training in order)."""
    ticket = turns.take()

    async def train_in_turn(columns: BatchColumns | None) -> TrainStepResult:
        async with turns.turn(ticket):
            return await train(columns)

    try:
        return await train_on_pulled_batch(step, rollouts, num_ranks, train_in_turn, prefetch, prefetch_next)
    finally:
        await turns.end_unused(ticket)
