import asyncio
import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_rl.core.admission import (
    ADMISSIONS_PER_TURN,
    AdmissionGate,
    batch_may_be_sampled,
    overdue_as_due_now,
    schedule_is_feasible,
)
from tests.support.helpers import wait_until_async


def gate(generator_version=0, next_train_version=0, queued=0, new=8, per_step=16, max_age=1):
    """Whether `new` episodes may start at `generator_version` behind `queued` ones started at the
    trainer's version minus the age bound (the oldest still trainable)."""
    queued_versions = collections.Counter({next_train_version - max_age: queued})
    queued_versions[generator_version] += new
    return schedule_is_feasible(+queued_versions, next_train_version, per_step, max_age)


def test_synchronous_mode_admits_exactly_one_step_of_work_per_version():
    assert gate(queued=0, max_age=0)
    assert gate(queued=8, max_age=0)
    assert not gate(queued=16, max_age=0)  # would be trained at version 1 but generated at 0
    assert gate(generator_version=1, next_train_version=1, queued=0, max_age=0)


def test_async_mode_runs_ahead_by_max_policy_age_steps():
    assert gate(generator_version=1, next_train_version=1, queued=8, max_age=1)
    assert gate(generator_version=1, next_train_version=1, queued=16, max_age=1)
    assert not gate(generator_version=1, next_train_version=1, queued=24, max_age=1)
    assert gate(generator_version=1, next_train_version=1, queued=8, new=24, max_age=1)
    assert not gate(generator_version=1, next_train_version=1, queued=8, new=25, max_age=1)


def test_a_generator_with_old_weights_waits_for_the_swap():
    async def scenario():
        gate = make_gate(max_policy_age=1, prompts_per_step=1)
        for _ in range(2):
            await gate.settle(await gate.admit(0), 1, num_not_queued=0)
            await gate.took_batch([0], [])
        assert not gate.may_start_rollout(0)  # generated at 0, trained at 2 at the earliest
        await gate.generator_serves(0, 1)
        assert gate.may_start_rollout(0)

    run(scenario())


def test_episodes_past_their_deadline_by_the_count_are_due_now_for_admission_not_a_deadlock():
    """The buffer keeps an episode whose tokens are younger than its start; admission schedules it
    next instead of refusing everything while the trainer waits for a batch."""
    assert not schedule_is_feasible({0: 1}, next_train_version=5, prompts_per_step=2, max_policy_age=1)
    assert overdue_as_due_now({0: 1, 2: 1, 5: 1}, next_train_version=5, max_policy_age=1) == {4: 2, 5: 1}

    async def scenario():
        gate = make_gate(max_policy_age=1, prompts_per_step=2)
        gate.restore(policy_version=5, buffered_versions=[0])  # saved by a run that knew no start versions
        await gate.generator_serves(0, 5)
        assert gate.may_start_rollout(0)

    run(scenario())


def test_the_train_loop_waits_for_in_flight_episodes_this_step_is_the_last_chance_for():
    def may_sample(queued, in_flight, train_version, per_step, max_age):
        return batch_may_be_sampled(queued, in_flight, train_version, per_step, max_age)

    assert not may_sample({3: 1, 4: 1}, {3: 1}, train_version=4, per_step=1, max_age=1)
    assert may_sample({4: 2}, {4: 1}, train_version=4, per_step=1, max_age=1)
    assert not may_sample({4: 2}, {4: 1}, train_version=4, per_step=2, max_age=0)  # sync: the whole step
    assert may_sample({4: 2}, {}, train_version=4, per_step=2, max_age=0)
    # Nothing buffered yet: going now would let the first arrival (the scale benchmark: a short
    # episode of version 5 ahead of a long one of 4, whose last chance was this step) fill the batch.
    assert not may_sample({}, {}, train_version=6, per_step=1, max_age=2)
    assert not may_sample({4: 1, 5: 1}, {4: 1}, train_version=6, per_step=1, max_age=2)
    assert may_sample({4: 1, 5: 1}, {5: 1}, train_version=6, per_step=1, max_age=2)


def test_short_episodes_that_finished_first_do_not_take_the_steps_long_ones_need():
    """The scale benchmark's over-age drops under admission=pause (`forge-rl bench scale`): one step of
    one episode, age 2. Episodes 0 and 1 (long) and 2 (short) start at version 0; 2 is trained at
    0; 3 (short) starts at 1. Trained at 1, 3 would leave 0 and 1 both needing step 2, one of them
    dropped; the gate instead holds step 1 until 0 has arrived."""

    async def scenario():
        gate = make_gate(max_policy_age=2, prompts_per_step=1)
        assert [await gate.admit(0) for _ in range(3)] == [0, 0, 0]
        assert not gate.may_start_rollout(0)  # a 4th at version 0 would be trained at 3
        await gate.settle(0, 1, num_not_queued=0)  # episode 2 arrives
        assert gate.may_sample_batch()
        await gate.took_batch([0], [])
        await gate.generator_serves(0, 1)
        assert await gate.admit(0) == 1  # episode 3
        await gate.settle(1, 1, num_not_queued=0)  # episode 3 arrives before 0 and 1
        assert not gate.may_sample_batch()
        await gate.settle(0, 1, num_not_queued=0)  # episode 0 arrives; the buffer serves it first
        assert gate.may_sample_batch()
        await gate.took_batch([0], [])
        assert not gate.may_sample_batch()  # step 2 is episode 1's last chance
        await gate.settle(0, 1, num_not_queued=0)
        assert gate.may_sample_batch()

    run(scenario())


@pytest.mark.parametrize("wait_for_stragglers", [True, False])
def test_partial_rollouts_let_a_full_batch_go_while_a_straggler_misses_its_last_step(wait_for_stragglers):
    """One episode a step, age 1. Episode 0 (long) and 1 start at version 0; 1 is trained at 0; 2
    starts at 1 and arrives before 0, whose last chance is step 1. Waiting for stragglers, step 1
    waits for episode 0; with partial rollouts it trains episode 2, and episode 0 arrives overdue
    (the buffer masks its over-age tokens) and is counted as due now: admission goes on."""

    async def scenario():
        gate = make_gate(max_policy_age=1, prompts_per_step=1, wait_for_stragglers=wait_for_stragglers)
        assert [await gate.admit(0) for _ in range(2)] == [0, 0]
        await gate.settle(0, 1, num_not_queued=0)  # episode 1 arrives
        await gate.took_batch([0], [])
        await gate.generator_serves(0, 1)
        assert await gate.admit(0) == 1  # episode 2
        await gate.settle(1, 1, num_not_queued=0)  # episode 2 arrives before 0
        assert gate.may_sample_batch() is not wait_for_stragglers
        if wait_for_stragglers:
            return
        await gate.took_batch([1], [])
        assert gate.in_flight_versions == {0: 1}  # episode 0, past its deadline by the count
        assert not gate.may_sample_batch()  # nothing buffered: a batch waits for a full one
        await gate.generator_serves(0, 2)
        assert gate.may_start_rollout(0)  # episode 0 counts as due now, not as infeasible
        await gate.settle(0, 1, num_not_queued=0)
        assert gate.may_sample_batch()

    run(scenario())


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_generators=st.integers(1, 3),
    prompts_per_step=st.integers(1, 3),
    max_policy_age=st.integers(0, 3),
    wait_for_stragglers=st.booleans(),
)
def test_no_admitted_episode_is_ever_trained_past_the_age_bound_and_the_run_never_stalls(
    data, num_generators, prompts_per_step, max_policy_age, wait_for_stragglers
):
    """Any order of admissions, arrivals (out of order), weight updates (generators lagging) and
    steps: every batch, served earliest-admitted first as the buffer does, trains only episodes
    within the age bound (waiting for stragglers; with partial rollouts the buffer masks what a
    straggler holds past it instead), and some event can always happen. As in the train loop, a
    step the gate lets go takes its batch from the buffer afterwards: if the buffer holds less than
    a batch, the next arrivals complete it, whatever their versions."""
    max_queued = prompts_per_step * (max_policy_age + 2)

    async def scenario():
        gate = make_gate(
            max_policy_age=max_policy_age,
            prompts_per_step=prompts_per_step,
            max_episodes_queued=max_queued,
            num_generators=num_generators,
            wait_for_stragglers=wait_for_stragglers,
        )
        in_flight: list[int] = []  # start versions
        buffered: list[int] = []  # start versions, in arrival order
        waiting_step = False  # the gate let a step go; the buffer is waiting for a full batch

        async def take_batch() -> None:
            batch = sorted(buffered)[:prompts_per_step]  # stable: earliest admitted first
            for version in batch:
                buffered.remove(version)
                assert gate.next_train_version - version <= max_policy_age or not wait_for_stragglers
            await gate.took_batch(batch, [])

        for _ in range(40):
            starts = [g for g in range(num_generators) if gate.may_start_rollout(g)]
            lagging = [g for g in range(num_generators) if gate.generator_versions[g] < gate.next_train_version]
            events = (["start"] if starts else []) + (["arrive"] if in_flight else [])
            events += (["step"] if not waiting_step and gate.may_sample_batch() else []) + (
                ["update"] if lagging else []
            )
            assert events, f"stalled: {gate.queued_versions=} {gate.in_flight_versions=} {buffered=}"
            event = data.draw(st.sampled_from(events))
            if event == "start":
                in_flight.append(await gate.admit(data.draw(st.sampled_from(starts))))
            elif event == "arrive":
                version = in_flight.pop(data.draw(st.integers(0, len(in_flight) - 1)))
                buffered.append(version)
                await gate.settle(version, 1, num_not_queued=0)
            elif event == "step":
                waiting_step = True
            else:
                generator = data.draw(st.sampled_from(lagging))
                await gate.generator_serves(
                    generator, data.draw(st.integers(gate.generator_versions[generator] + 1, gate.next_train_version))
                )
            if waiting_step and len(buffered) >= prompts_per_step:
                waiting_step = False
                await take_batch()

    run(scenario())


def run(scenario):
    """Runs a gate scenario; a wait that never ends fails the test instead of hanging the suite."""
    asyncio.run(asyncio.wait_for(scenario, 10))


def num_waiting(gate: AdmissionGate) -> int:
    """Rollouts waiting in `admit` now (cancelled ones not yet taken off their queue included)."""
    return sum(len(queue) for queue in gate._waiting)


def make_gate(
    admission="pause",
    max_policy_age=0,
    prompts_per_step=2,
    max_episodes_queued=64,
    num_generators=1,
    wait_for_stragglers=True,
):
    return AdmissionGate(
        num_generators, prompts_per_step, max_policy_age, max_episodes_queued, admission, wait_for_stragglers
    )


@pytest.mark.parametrize("admission,gated", [("pause", True), ("drop", False)])
def test_admission_mode_decides_whether_rollouts_wait_for_the_age_bound(admission, gated):
    async def scenario():
        gate = make_gate(admission)
        # One step's episodes (2) are already queued at version 0, and one more, started at version 0,
        # is still generating while the trainer is about to train version 0.
        for _ in range(2):
            start = await gate.admit(0)
            await gate.settle(start, 1, num_not_queued=0)
        if admission == "pause":
            gate.queued_versions[0], gate.in_flight_versions[0] = 3, 1
        else:
            await gate.admit(0)
        assert gate.may_start_rollout(0) is not gated
        assert gate.may_sample_batch() is not gated

    run(scenario())


def test_the_gate_never_admits_more_episodes_than_the_buffer_holds():
    """An admitted episode must always find room in the buffer: one that waits in `put` while the
    trainer waits for it (it is still in flight) deadlocks the run."""

    async def scenario():
        gate = make_gate(max_policy_age=3, prompts_per_step=2, max_episodes_queued=3)
        for _ in range(3):
            await gate.admit(0)
        assert not gate.may_start_rollout(0)  # the age bound would allow 8; the buffer holds 3
        waiter = asyncio.ensure_future(gate.admit(0))
        await asyncio.sleep(0)  # lets the waiter reach its wait (no time passes)
        assert not waiter.done()
        await gate.settle(0, 3, num_not_queued=0)
        await gate.took_batch([0, 0], [])
        assert await asyncio.wait_for(waiter, 5) == 0

    run(scenario())


@pytest.mark.parametrize("admission", ["pause", "drop"])
def test_the_capacity_bound_holds_in_both_admission_modes(admission):
    gate = make_gate(admission, max_policy_age=10, max_episodes_queued=2)
    gate.queued_versions[0] = 2
    assert not gate.may_start_rollout(0)


def test_a_gate_whose_bound_is_below_one_step_is_refused():
    with pytest.raises(ValueError, match="below one step"):
        make_gate(prompts_per_step=4, max_episodes_queued=3)


def test_a_generator_serving_a_newer_version_is_admitted_again():
    async def scenario():
        gate = make_gate(max_policy_age=0, prompts_per_step=1)
        start = await gate.admit(0)
        await gate.settle(start, 1, num_not_queued=0)
        await gate.took_batch([0], [])  # trained version 0; the next batch trains at 1
        assert not gate.may_start_rollout(0)  # generated at 0, trained at 1: too old for age 0
        await gate.generator_serves(0, 1)
        assert gate.may_start_rollout(0)
        await gate.generator_serves(0, 0)  # an older report never moves a generator back
        assert gate.generator_versions == [1]

    run(scenario())


def test_a_change_spreads_its_admissions_over_the_generators_and_wakes_no_other_waiter():
    """Three generators, two rollouts waiting on each, room for two more episodes: a change admits
    the first waiter of the two generators whose first waiters arrived first (1, then 2), not
    generator 1's pair, and checks no more than it admits plus once per version that may not
    start, not every waiting rollout."""

    async def scenario():
        gate = make_gate(max_policy_age=3, prompts_per_step=2, max_episodes_queued=3, num_generators=3)
        for _ in range(3):
            await gate.admit(0)
        waiters = {}
        for index in (1, 2, 0):  # arrival order: generator 1's pair, then 2's, then 0's
            for k in range(2):
                waiters[index, k] = asyncio.ensure_future(gate.admit(index))
                await wait_until_async(lambda: num_waiting(gate) == len(waiters), "the rollout waiting")
        checks = []
        may_start = gate.may_start_rollout
        gate.may_start_rollout = lambda index, n=1: checks.append(index) or may_start(index, n)
        await gate.settle(0, 2, num_not_queued=2)  # two episodes filtered: room for two
        await wait_until_async(lambda: waiters[1, 0].done() and waiters[2, 0].done(), "one rollout each admitted")
        assert {key for key, waiter in waiters.items() if waiter.done()} == {(1, 0), (2, 0)}
        assert checks == [1, 2, 0]  # one each, then one look at version 0 for all the rest
        for waiter in waiters.values():
            if not waiter.done():
                waiter.cancel()
        await asyncio.gather(*waiters.values(), return_exceptions=True)
        assert gate.num_episodes_queued == 3  # the cancelled waiters took nothing

    run(scenario())


def test_admissions_go_first_to_the_generator_with_the_most_rollouts_waiting():
    """Generator 0's rollouts arrived first, but generator 1 has more of its rollouts waiting (fewer
    decoding): the room for three episodes goes to 1, 1, then 0, the least loaded each time."""

    async def scenario():
        gate = make_gate(max_policy_age=3, prompts_per_step=2, max_episodes_queued=3, num_generators=2)
        for _ in range(3):
            await gate.admit(0)
        order = []

        async def waiting(index):
            await gate.admit(index)
            order.append(index)

        tasks = []
        for index, count in ((0, 2), (1, 4)):
            for _ in range(count):
                tasks.append(asyncio.ensure_future(waiting(index)))
                await wait_until_async(lambda: num_waiting(gate) == len(tasks), "the rollout waiting")
        await gate.settle(0, 3, num_not_queued=3)  # room for three
        await wait_until_async(lambda: len(order) == 3, "three admitted")
        assert order == [1, 1, 0]  # 4 vs 2 waiting, then 3 vs 2, then 2 vs 2: the earlier first waiter
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(scenario())


def test_rollouts_stopped_while_others_settle_leave_nothing_counted():
    """A stop cancels every rollout at once: those in flight give their admissions back, and a
    waiter cancelled before its turn (its future cancelled with it) must not be admitted by the
    changes the others' returns make; the gate then counts nothing queued or in flight."""

    async def scenario():
        gate = make_gate(max_policy_age=0, prompts_per_step=2, max_episodes_queued=2, num_generators=2)

        async def rollout(index):
            start = await gate.admit(index)
            try:
                await asyncio.Event().wait()  # generating until the stop
            finally:
                await gate.settle(start, 1, num_not_queued=1)

        tasks = [asyncio.ensure_future(rollout(index)) for index in (0, 1, 0, 1)]
        await wait_until_async(lambda: num_waiting(gate) == 2, "two admitted (the capacity), two waiting")
        assert gate.num_episodes_queued == 2
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.num_episodes_queued == 0 and not gate.in_flight_versions

    run(scenario())


def test_an_admission_pass_admits_at_most_a_bounded_number_of_rollouts_per_event_loop_turn():
    """40 rollouts become admissible at once (their generator swaps): the gate admits
    ADMISSIONS_PER_TURN of them per event-loop turn, so the rest of the loop's work (the train
    loop's take_batch, replies) runs between, instead of behind all 40 generate calls."""

    async def scenario():
        gate = make_gate(max_policy_age=0, prompts_per_step=64, max_episodes_queued=64)
        await gate.settle(await gate.admit(0), 1, num_not_queued=0)
        await gate.took_batch([0], [])  # the next batch trains at 1: version 0 is too old now
        waiters = [asyncio.ensure_future(gate.admit(0)) for _ in range(40)]
        await wait_until_async(lambda: num_waiting(gate) == 40, "40 rollouts waiting")
        assert gate.num_episodes_queued == 0
        await gate.generator_serves(0, 1)
        queued = []
        for _ in range(4):
            # One event-loop turn, the unit the bound is stated in: the admission pass is a
            # callback of its own, and each turn runs it once (asyncio's ready queue is FIFO).
            await asyncio.sleep(0)
            queued.append(gate.num_episodes_queued)
        assert queued == [ADMISSIONS_PER_TURN, 2 * ADMISSIONS_PER_TURN, 40, 40]
        assert await asyncio.gather(*waiters) == [1] * 40

    run(scenario())


@pytest.mark.parametrize("swap_ends_by", ["serving", "abandoned"])
def test_a_generator_still_swapping_holds_back_the_more_loaded_ones_until_it_serves(swap_ends_by):
    """Generator 1 is still loading the version generator 0 already serves, and is refused at its
    old one: generator 0, with no more rollouts waiting than 1, gets one admission ahead of it, not
    the four slots the step freed. Once 1 serves (or its update is abandoned: it was lost), the
    hold ends."""

    async def scenario():
        gate = make_gate(max_policy_age=0, prompts_per_step=4, max_episodes_queued=8, num_generators=2)
        await gate.took_batch([], [])  # the next batch trains at version 1: version 0 is too old
        await gate.generator_serves(0, 1)
        gate.generator_updating(1, 1)
        admitted = {0: [], 1: []}

        async def waiting(index):
            admitted[index].append(await gate.admit(index))

        tasks = []
        for index in (1, 1, 0, 0):  # the first admission pass runs once all four wait
            tasks.append(asyncio.ensure_future(waiting(index)))
        await wait_until_async(lambda: len(admitted[0]) == 1, "generator 0 admitted once")
        # No admission pass pending: nothing more is admitted until the next change.
        await wait_until_async(lambda: gate._admission_pass is None, "the admission passes done")
        assert admitted == {0: [1], 1: []}  # held: 0 has one waiting, 1 (swapping) has two
        if swap_ends_by == "serving":
            await gate.generator_serves(1, 1)
            await wait_until_async(lambda: len(admitted[0]) + len(admitted[1]) == 4, "all four admitted")
            assert admitted == {0: [1, 1], 1: [1, 1]}
        else:
            await gate.generator_update_abandoned(1)
            await wait_until_async(lambda: len(admitted[0]) == 2, "generator 0's second admitted")
            assert admitted == {0: [1, 1], 1: []}  # 1 still serves version 0: too old
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(scenario())
