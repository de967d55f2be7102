"""Admission control: start a rollout only if its episodes can be trained within the age bound,
and only if the buffer will have room for them.

Every episode admitted under generator version v must be trained by version v + max_policy_age (its
deadline), and the trainer trains `prompts_per_step` episodes (prompts, each with its group) a step.
The gate counts the episodes admitted and not yet taken by start version (in flight or buffered) and
keeps that schedule feasible, earliest deadline first: for every version v, the episodes admitted at
v or earlier fit in the steps from `next_train_version` to v + max_policy_age
(`schedule_is_feasible`). A rollout starts only if it keeps the schedule feasible. Pausing
generation here, instead of generating and dropping, keeps long completions from being starved (they
are the ones a drop would hit). The buffer still enforces the bound on its own, per token; this gate
only avoids wasted work.

Completions finish out of order, so the buffer may hold later-admitted short episodes while
earlier-admitted long ones are still decoding. The buffer serves the earliest-admitted first
(`Episode.schedule_version`), so the batch it would serve now is known here; the train loop waits
(`batch_may_be_sampled`) while taking that batch would leave the episodes still in flight more
than the remaining steps can train in time, i.e. until the ones that need this step have arrived.
Taking the short ones first and letting the gate admit new work into the slots the long ones need
would drop an admitted episode (`forge-rl bench scale` counts such drops).
Together, with the trainer waiting for stragglers (the default): nothing the gate admitted is ever
dropped.

That wait must never wait on the buffer itself: an episode that finished but cannot enter a full
buffer is still in flight, and the trainer would wait for it while it waits for the trainer. So the
gate never admits more episodes than the buffer can hold (`max_episodes_queued`, derived in
`GRPOConfig.max_episodes_queued` from the buffer's episode and token capacities): a `put` of an
admitted episode always finds room, by construction.

With `wait_for_stragglers=False` (partial rollouts) the train loop does not wait: a batch goes as
soon as a full one is buffered, and an episode that misses its last step arrives overdue, its
over-age tokens masked by the buffer and the rest trained. Admission is unchanged (overdue
episodes count as due now), so the gate still keeps generation within one bound of the trainer.

With `admission="drop"` only that capacity bound applies: generation never waits for the age
bound, and the buffer drops what grows too old (counted, with its lengths).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
from collections.abc import Iterable, Mapping
from typing import Literal


def schedule_is_feasible(
    queued_versions: Mapping[int, int], next_train_version: int, prompts_per_step: int, max_policy_age: int
) -> bool:
    """Whether episodes queued by start version (`queued_versions`: version -> episodes) can all be
    trained within the age bound, earliest deadline first, from version `next_train_version` on."""
    num_due = 0
    for version in sorted(queued_versions):
        num_due += queued_versions[version]
        steps_left = version + max_policy_age - next_train_version + 1
        if num_due > steps_left * prompts_per_step:
            return False
    return True


def overdue_as_due_now(
    queued_versions: Mapping[int, int], next_train_version: int, max_policy_age: int
) -> collections.Counter[int]:
    """`queued_versions` with the episodes whose deadline has passed by the gate's count moved to
    the oldest version still trainable. They exist only after a step that the train loop could not
    hold (nothing left in flight to wait for): the buffer keeps such an episode if its tokens are
    younger than its start and evicts it otherwise. Admission counts them as due now; counting them
    as infeasible forever would stop admission while the trainer waits for a batch."""
    oldest_trainable = next_train_version - max_policy_age
    due_now: collections.Counter[int] = collections.Counter()
    for version, count in queued_versions.items():
        due_now[max(version, oldest_trainable)] += count
    return due_now


def buffered_versions(
    queued_versions: Mapping[int, int], in_flight_versions: Mapping[int, int]
) -> collections.Counter[int]:
    """Start version of each episode admitted, not yet taken and no longer in flight: in the buffer."""
    return collections.Counter(queued_versions) - collections.Counter(in_flight_versions)


def batch_may_be_sampled(
    queued_versions: Mapping[int, int],
    in_flight_versions: Mapping[int, int],
    next_train_version: int,
    prompts_per_step: int,
    max_policy_age: int,
) -> bool:
    """Whether the batch the buffer serves now (its earliest-admitted episodes) leaves a feasible
    schedule for the rest. False while an episode that needs this step, or whose place later
    would be taken by this batch, is still being generated."""
    buffered = buffered_versions(queued_versions, in_flight_versions)
    if buffered.total() < prompts_per_step:
        # The buffer would complete the batch with whatever arrives first (a short episode admitted
        # late, say): only once a full batch is here is it the one judged below.
        return False
    if not any(in_flight_versions.values()):
        return True  # waiting cannot change which episodes the batch takes
    remaining = collections.Counter(queued_versions)
    num_to_take = prompts_per_step
    for version in sorted(buffered):
        taken = min(buffered[version], num_to_take)
        remaining[version] -= taken
        num_to_take -= taken
        if not num_to_take:
            break
    return schedule_is_feasible(+remaining, next_train_version + 1, prompts_per_step, max_policy_age)


ADMISSIONS_PER_TURN = 16
"""Most rollouts one admission pass admits in one event-loop turn (`AdmissionGate._admit_waiting`)."""


class AdmissionGate:
    """What the rollout loops and the train loop agree on: versions, episodes queued, episodes in
    flight. Only one event loop touches it, so it needs no locks.

    A rollout calls `admit` (waits), generates, then `settle`s; the train loop calls
    `wait_for_batch`, takes a batch from the buffer, then `took_batch`.

    Waiting rollouts queue per generator, first come first served. After every change the gate
    admits as many as now may start, each to the generator with the most waiting (the least
    loaded), and wakes only those: whether a rollout may start depends on its generator's version
    and the counts, not on the rollout, so once a generator's first waiter may not start, none
    behind it may. (Waking every waiter to check for itself cost the rollouts' process a check per
    waiting rollout per change: 512 at 128 generators with 4 rollouts each.)
    """

    def __init__(
        self,
        num_generators: int,
        prompts_per_step: int,
        max_policy_age: int,
        max_episodes_queued: int,
        admission: Literal["pause", "drop"] = "pause",
        wait_for_stragglers: bool = True,
    ):
        if max_episodes_queued < prompts_per_step:
            raise ValueError(
                f"max_episodes_queued ({max_episodes_queued}) is below one step's episodes ({prompts_per_step}); "
                "the trainer could never take a batch"
            )
        self.prompts_per_step = prompts_per_step
        self.max_policy_age = max_policy_age
        self.max_episodes_queued = max_episodes_queued
        self.admission = admission
        self.wait_for_stragglers = wait_for_stragglers
        """False: a batch goes as soon as a full one is buffered; an episode that misses its last
        step keeps decoding and arrives overdue (`overdue_as_due_now` schedules it next), its
        over-age tokens masked by the buffer (`BufferConfig.wait_for_stragglers`)."""
        self.generator_versions = [0] * num_generators
        """Policy version each generator serves now."""
        self.generator_targets = [0] * num_generators
        """Version each generator was last told to load: above its `generator_versions` entry while
        it swaps (`generator_updating`)."""
        self.next_train_version = 0
        """Version the next batch will be trained at = batches taken so far."""
        self.queued_versions: collections.Counter[int] = collections.Counter()
        """Start version of each episode admitted and not yet taken by the trainer, filtered, or
        dropped as stale: in flight or buffered."""
        self.in_flight_versions: collections.Counter[int] = collections.Counter()
        """Start version of each episode still being generated or scored."""
        self._changed = asyncio.Condition()
        """Wakes the train loop's `wait_for_batch`."""
        self._waiting: list[collections.deque[_Waiter]] = [collections.deque() for _ in range(num_generators)]
        """Rollouts waiting for an admission, per generator, in arrival order."""
        self._num_waiting = 0
        """Entries of all `_waiting` queues (a cancelled waiter counts until its queue drops it)."""
        self._arrivals = 0
        self._admission_pass: asyncio.Handle | None = None
        """The admission pass scheduled for this event-loop turn, if one is."""

    @property
    def num_episodes_queued(self) -> int:
        return self.queued_versions.total()

    def may_start_rollout(self, generator_index: int, num_new_episodes: int = 1) -> bool:
        if self.num_episodes_queued + num_new_episodes > self.max_episodes_queued:
            return False  # the buffer could not take them: wait for the trainer
        if self.admission == "drop":
            return True
        generator_version = self.generator_versions[generator_index]
        if generator_version + self.max_policy_age < self.next_train_version:
            return False  # too old for any step still to come: wait for the swap
        queued = overdue_as_due_now(self.queued_versions, self.next_train_version, self.max_policy_age)
        queued[generator_version] += num_new_episodes
        return schedule_is_feasible(queued, self.next_train_version, self.prompts_per_step, self.max_policy_age)

    def may_sample_batch(self) -> bool:
        if self.admission == "drop":
            return True  # stragglers that miss their last step are dropped, not waited for
        if not self.wait_for_stragglers:
            return buffered_versions(self.queued_versions, self.in_flight_versions).total() >= self.prompts_per_step
        return batch_may_be_sampled(
            self.queued_versions,
            self.in_flight_versions,
            self.next_train_version,
            self.prompts_per_step,
            self.max_policy_age,
        )

    async def admit(self, generator_index: int, num_episodes: int = 1) -> int:
        """Waits until `num_episodes` may start on generator `generator_index`; returns the version
        they start at (stamp it on the episodes as `admitted_version`, hand it back to `settle`)."""
        queue = self._waiting[generator_index]
        # With rollouts waiting anywhere, the admission pass decides (in this event-loop turn):
        # which generator goes first is its choice.
        if not self._num_waiting and self.may_start_rollout(generator_index, num_episodes):
            return self._admitted(generator_index, num_episodes)
        self._arrivals += 1
        waiter = _Waiter(self._arrivals, num_episodes, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        self._num_waiting += 1
        if len(queue) == 1:
            self._schedule_admission_pass()  # a new first waiter: it may start before the others
        try:
            return await waiter.admitted
        except asyncio.CancelledError:
            if waiter.admitted.done() and not waiter.admitted.cancelled():
                # Admitted, then cancelled before it could run: the admission goes back.
                await self.settle(waiter.admitted.result(), num_episodes, num_not_queued=num_episodes)
            elif waiter in queue:
                queue.remove(waiter)
                self._num_waiting -= 1
                self._admit_waiting()  # those behind it may start now
            raise

    def _admitted(self, generator_index: int, num_episodes: int) -> int:
        start_version = self.generator_versions[generator_index]
        self.queued_versions[start_version] += num_episodes
        self.in_flight_versions[start_version] += num_episodes
        return start_version

    def _admit_waiting(self) -> None:
        """Admit every waiting rollout that may start now, one at a time to the generator with the
        most rollouts waiting (ties: the earliest first waiter), each generator's waiters in
        arrival order until one may not start. Every generator runs the same number of rollout
        loops, so the one with the most waiting has the fewest sequences decoding: admissions
        spread the work evenly over the engines. Whether one may start depends on its generator's
        version and the counts, and admitting only adds to the counts: a version that may not
        start stays so for the rest of the pass.

        A generator refused only because it is still swapping to the version the others serve
        holds back those with fewer rollouts waiting (more decoding): they are not admitted past
        it. Otherwise the first engine to finish its swap would take every slot the step freed, and
        keep winning: the engines' loads would drift several times apart, and the loaded engines'
        longest completions, decoded slowest, would set the pace of the whole run under the age
        bound (`forge-rl bench scale`). The slots wait for the swap
        instead, a fraction of a step.

        At most ADMISSIONS_PER_TURN per event-loop turn, then the pass goes on in the next turn:
        each admitted rollout sends its generate call in the turn after its admission, and 128 of
        them at once held the loop for tens of milliseconds, the train loop's `take_batch` and
        every reply waiting behind them."""
        self._admission_pass = None
        refused: set[tuple[int, int]] = set()
        admitted = 0
        held_below = 0  # generators with fewer rollouts waiting than this wait for a swapping one
        candidates = [(-len(queue), queue[0].arrival, index) for index, queue in enumerate(self._waiting) if queue]
        heapq.heapify(candidates)
        while candidates:
            _, _, index = heapq.heappop(candidates)
            queue = self._waiting[index]
            while queue and queue[0].admitted.done():  # a rollout cancelled while it waited takes nothing
                queue.popleft()
                self._num_waiting -= 1
            if not queue or len(queue) < held_below:
                continue
            waiter = queue[0]
            key = (self.generator_versions[index], waiter.num_episodes)
            if key not in refused:
                if admitted == ADMISSIONS_PER_TURN:
                    self._admission_pass = asyncio.get_running_loop().call_soon(self._admit_waiting)
                    return
                if self.may_start_rollout(index, waiter.num_episodes):
                    waiter.admitted.set_result(self._admitted(index, waiter.num_episodes))
                    admitted += 1
                    queue.popleft()
                    self._num_waiting -= 1
                    if queue:
                        heapq.heappush(candidates, (-len(queue), queue[0].arrival, index))
                    continue
                refused.add(key)
            if self.generator_targets[index] > self.generator_versions[index]:  # swapping
                held_below = max(held_below, len(queue))

    def _schedule_admission_pass(self) -> None:
        if self._admission_pass is None:
            self._admission_pass = asyncio.get_running_loop().call_soon(self._admit_waiting)

    async def _notify(self) -> None:
        """A change: admit the rollouts that may start now (one pass for all the changes of one
        event-loop turn: 128 generators' swaps, say), and wake the train loop."""
        self._schedule_admission_pass()
        async with self._changed:
            self._changed.notify_all()

    async def settle(self, start_version: int, num_episodes: int, num_not_queued: int) -> None:
        """`num_episodes` admitted at `start_version` left flight; `num_not_queued` of them did not
        reach the buffer (filtered, dropped at entry, or handed out again after a generator died)."""
        _remove(self.in_flight_versions, [start_version] * num_episodes)
        _remove(self.queued_versions, [start_version] * num_not_queued)
        await self._notify()

    async def wait_for_batch(self) -> int:
        """Waits until the next batch may be taken; returns the version it trains at."""
        async with self._changed:
            await self._changed.wait_for(self.may_sample_batch)
            return self.next_train_version

    async def took_batch(self, batch_versions: Iterable[int], evicted_versions: Iterable[int]) -> None:
        """The trainer took episodes admitted at `batch_versions`, and the buffer evicted stale
        ones admitted at `evicted_versions` meanwhile."""
        self.next_train_version += 1
        _remove(self.queued_versions, [*batch_versions, *evicted_versions])
        await self._notify()

    async def step_skipped(self) -> None:
        """The batch's step was skipped (non-finite loss): no version was published, so the next
        batch trains at the same version."""
        self.next_train_version -= 1
        await self._notify()

    def add_generator(self, policy_version: int) -> int:
        """A generator joined the run, serving `policy_version`; returns its index (the next one).
        One that leaves needs nothing here: its rollouts stop asking for admissions."""
        self.generator_versions.append(policy_version)
        self.generator_targets.append(policy_version)
        self._waiting.append(collections.deque())
        return len(self.generator_versions) - 1

    def generator_updating(self, generator_index: int, policy_version: int) -> None:
        """Generator `generator_index` was told to load `policy_version`: it swaps until it
        `generator_serves` it (or its update is abandoned)."""
        self.generator_targets[generator_index] = max(self.generator_targets[generator_index], policy_version)

    async def generator_serves(self, generator_index: int, policy_version: int) -> None:
        self.generator_versions[generator_index] = max(self.generator_versions[generator_index], policy_version)
        self.generator_targets[generator_index] = max(self.generator_targets[generator_index], policy_version)
        await self._notify()

    async def generator_update_abandoned(self, generator_index: int) -> None:
        """Its update will not finish (the generator was lost; a replacement reports what it serves
        through `generator_serves`): it no longer holds the others back."""
        self.generator_targets[generator_index] = self.generator_versions[generator_index]
        await self._notify()

    def restore(self, policy_version: int, buffered_versions: Iterable[int]) -> None:
        """State after a resume: the trainer is at `policy_version`, the buffer holds episodes
        admitted at `buffered_versions`."""
        self.next_train_version = policy_version
        self.queued_versions = collections.Counter(buffered_versions)


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A rollout waiting in `AdmissionGate.admit`."""

    arrival: int
    num_episodes: int
    admitted: asyncio.Future
    """Resolved with the start version when the gate admits it."""


def _remove(counts: collections.Counter[int], versions: Iterable[int]) -> None:
    """Take `versions` out of `counts`; a version that is not there is a bookkeeping error."""
    for version in versions:
        if counts[version] <= 0:
            raise RuntimeError(f"admission gate: no episode admitted at version {version} to remove ({dict(counts)})")
        counts[version] -= 1
        if not counts[version]:
            del counts[version]
