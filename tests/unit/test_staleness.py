import pytest

from forge_rl.staleness import rollout_may_start


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
    from forge_rl.staleness import batch_may_be_sampled

    assert not batch_may_be_sampled({3: 1}, train_version=4, max_policy_age=1)
    assert batch_may_be_sampled({4: 2, 3: 0}, train_version=4, max_policy_age=1)
    assert not batch_may_be_sampled({4: 1}, train_version=4, max_policy_age=0)  # sync: the whole step


@pytest.mark.parametrize("admission,gated", [("pause", True), ("drop", False)])
def test_admission_mode_decides_whether_rollouts_wait_for_the_age_bound(admission, gated):
    from apps.grpo.main import PipelineState
    from forge_rl.buffer import BufferConfig
    from forge_rl.config import GRPOConfig

    config = GRPOConfig(train_batch_size=8, group_size=4, buffer=BufferConfig(max_policy_age=0, admission=admission))
    # One step's episodes (2) are already queued at version 0, and one more, started at version 0,
    # is still generating while the trainer is about to train version 0.
    state = PipelineState(config, generator_versions=[0], num_episodes_queued=2)
    state.in_flight_versions[0] = 1
    assert state.may_start_rollout(0) is not gated
    assert state.may_sample_batch() is not gated
