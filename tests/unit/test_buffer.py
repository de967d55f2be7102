import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_rl.buffer import BufferConfig, BufferFull, ReplayBuffer

from .builders import make_episode


def test_sample_returns_none_until_a_full_batch_is_fresh():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, capacity_episodes=8))
    buffer.put(make_episode(0), trainer_version=0)
    assert buffer.sample(2, trainer_version=0) is None
    buffer.put(make_episode(1), trainer_version=0)
    assert [e.episode_id for e in buffer.sample(2, trainer_version=0)] == [0, 1]


def test_put_drops_and_counts_episodes_already_too_old():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, capacity_episodes=8))
    assert buffer.put(make_episode(0, policy_version=3), trainer_version=5) is False
    assert len(buffer) == 0
    assert buffer.dropped.episodes == 1
    assert buffer.dropped.completions == 2
    assert buffer.dropped.episode_ids == [0]


def test_sample_evicts_episodes_made_stale_by_newer_trainer_versions():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, capacity_episodes=8))
    buffer.put(make_episode(0, policy_version=0), trainer_version=0)
    buffer.put(make_episode(1, policy_version=1), trainer_version=1)
    batch = buffer.sample(1, trainer_version=2)
    assert [e.episode_id for e in batch] == [1]
    assert buffer.dropped.episode_ids == [0]


def test_staleness_uses_the_oldest_token_of_a_sequence_swapped_mid_decode():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=0, capacity_episodes=8))
    episode = make_episode(0)
    episode.completions[0].policy_versions = [0, 1]
    assert buffer.put(episode, trainer_version=1) is False


def test_put_on_a_full_buffer_raises_so_the_shell_can_apply_backpressure():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, capacity_episodes=1))
    buffer.put(make_episode(0), trainer_version=0)
    with pytest.raises(BufferFull):
        buffer.put(make_episode(1), trainer_version=0)


def test_freshest_sampling_takes_the_newest_groups_first():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=5, capacity_episodes=8, sampling="freshest"))
    for version in (0, 2, 1):
        buffer.put(make_episode(version, policy_version=version), trainer_version=2)
    assert [e.episode_id for e in buffer.sample(2, trainer_version=2)] == [2, 1]


@pytest.mark.parametrize("field,value", [("max_policy_age", -1), ("capacity_episodes", 0)])
def test_invalid_buffer_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"buffer.{field}"):
        BufferConfig(**{field: value})


operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3)),  # generated this many versions behind
        st.tuples(st.just("sample"), st.integers(1, 3)),
        st.tuples(st.just("advance"), st.integers(1, 2)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=operations, max_policy_age=st.integers(0, 3), capacity=st.integers(1, 6))
def test_no_sampled_episode_exceeds_max_policy_age_and_capacity_holds(ops, max_policy_age, capacity):
    buffer = ReplayBuffer(BufferConfig(max_policy_age=max_policy_age, capacity_episodes=capacity))
    trainer_version, next_id = 0, 0
    for op, arg in ops:
        if op == "put" and buffer.num_free_slots > 0:
            buffer.put(make_episode(next_id, policy_version=max(trainer_version - arg, 0)), trainer_version)
            next_id += 1
        elif op == "sample":
            for episode in buffer.sample(arg, trainer_version) or []:
                assert trainer_version - episode.oldest_policy_version <= max_policy_age
        elif op == "advance":
            trainer_version += arg
        assert len(buffer) <= capacity
