import pytest

import asyncio

from forge_rl.admission import AdmissionGate, batch_may_be_sampled, rollout_may_start


def gate(generator_version=0, next_train_version=0, queued=0, new=8, per_step=16, max_age=1):
    return rollout_may_start(generator_version, next_train_version, queued, new, per_step, max_age)


def test_synchronous_mode_admits_exactly_one_step_of_work_per_version():
    assert gate(queued=0, max_age=0)
    assert gate(queued=8, max_age=0)
    assert not gate(queued=16, max_age=0)  # would be trained at version 1 but generated at 0
    assert gate(generator_version=1, next_train_version=1, queued=0, max_age=0)


def test_async_mode_runs_ahead_by_max_policy_age_steps():
    assert gate(queued=16, max_age=1)
    assert gate(queued=24, max_age=1)
    assert not gate(queued=32, max_age=1)


def test_a_generator_with_old_weights_waits_for_the_swap():
    assert not gate(generator_version=0, next_train_version=2, queued=0, max_age=1)
    assert gate(generator_version=1, next_train_version=2, queued=0, max_age=1)


def test_the_train_loop_waits_for_in_flight_episodes_this_step_is_the_last_chance_for():
    assert not batch_may_be_sampled({3: 1}, train_version=4, max_policy_age=1)
    assert batch_may_be_sampled({4: 2, 3: 0}, train_version=4, max_policy_age=1)
    assert not batch_may_be_sampled({4: 1}, train_version=4, max_policy_age=0)  # sync: the whole step


def run(scenario):
    """Runs a gate scenario; a wait that never ends fails the test instead of hanging the suite."""
    asyncio.run(asyncio.wait_for(scenario, 10))


def make_gate(admission="pause", max_policy_age=0, episodes_per_step=2, max_episodes_queued=64, num_generators=1):
    return AdmissionGate(num_generators, episodes_per_step, max_policy_age, max_episodes_queued, admission)


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
            gate.num_episodes_queued, gate.in_flight_versions[0] = 2, 1
        else:
            await gate.admit(0)
        assert gate.may_start_rollout(0) is not gated
        assert gate.may_sample_batch() is not gated

    run(scenario())


def test_the_gate_never_admits_more_episodes_than_the_buffer_holds():
    """An admitted episode must always find room in the buffer: one that waits in `put` while the
    trainer waits for it (it is still in flight) deadlocks the run."""

    async def scenario():
        gate = make_gate(max_policy_age=3, episodes_per_step=2, max_episodes_queued=3)
        for _ in range(3):
            await gate.admit(0)
        assert not gate.may_start_rollout(0)  # the age bound would allow 8; the buffer holds 3
        waiter = asyncio.ensure_future(gate.admit(0))
        await asyncio.sleep(0)  # lets the waiter reach its wait (no time passes)
        assert not waiter.done()
        await gate.settle(0, 3, num_not_queued=0)
        await gate.took_batch(2, num_evicted=0)
        assert await asyncio.wait_for(waiter, 5) == 0

    run(scenario())


@pytest.mark.parametrize("admission", ["pause", "drop"])
def test_the_capacity_bound_holds_in_both_admission_modes(admission):
    gate = make_gate(admission, max_policy_age=10, max_episodes_queued=2)
    gate.num_episodes_queued = 2
    assert not gate.may_start_rollout(0)


def test_a_gate_whose_bound_is_below_one_step_is_refused():
    with pytest.raises(ValueError, match="below one step"):
        make_gate(episodes_per_step=4, max_episodes_queued=3)


def test_a_generator_serving_a_newer_version_is_admitted_again():
    async def scenario():
        gate = make_gate(max_policy_age=0, episodes_per_step=1)
        start = await gate.admit(0)
        await gate.settle(start, 1, num_not_queued=0)
        await gate.took_batch(1, num_evicted=0)  # trained version 0; the next batch trains at 1
        assert not gate.may_start_rollout(0)  # generated at 0, trained at 1: too old for age 0
        await gate.generator_serves(0, 1)
        assert gate.may_start_rollout(0)
        await gate.generator_serves(0, 0)  # an older report never moves a generator back
        assert gate.generator_versions == [1]

    run(scenario())
