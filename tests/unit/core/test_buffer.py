import asyncio
import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_rl.core.batching import make_train_batch
from forge_rl.core.buffer import BufferConfig, BufferFull, ReplayBuffer, WaitingBuffer
from forge_rl.types import Episode
from tests.support.builders import make_completion, make_episode
from tests.support.helpers import wait_until_async


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
    buffer = ReplayBuffer(BufferConfig(max_policy_age=5, capacity_episodes=8, sampling="freshest", admission="drop"))
    for version in (0, 2, 1):
        buffer.put(make_episode(version, policy_version=version), trainer_version=2)
    assert [e.episode_id for e in buffer.sample(2, trainer_version=2)] == [2, 1]


@pytest.mark.parametrize("field,value", [("max_policy_age", -1), ("capacity_episodes", 0), ("capacity_tokens", 0)])
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


def mask_buffer(max_policy_age: int = 0, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(max_policy_age=max_policy_age, drop_policy="mask_tokens", **kwargs))


def swapped_episode(episode_id: int, *versions: list[int]) -> Episode:
    """An episode whose completion i has per-token versions versions[i] (weights swapped mid-decode)."""
    completions = [make_completion(policy_version=v, reward=float(i % 2)) for i, v in enumerate(versions)]
    return Episode(episode_id, "M56=", "6", [1, 5, 6], completions)


def re_encoded(episode: Episode) -> Episode:
    """`episode` as if each swap re-encoded its completions' KV (swap_kv recompute): each token
    depends only on the weights that sampled it (`Completion.kv_versions`)."""
    for completion in episode.completions:
        completion.kv_versions = list(completion.policy_versions)
    return episode


def test_token_capacity_paces_producers_before_the_episode_capacity_does():
    buffer = ReplayBuffer(BufferConfig(capacity_episodes=8, capacity_tokens=14))  # episodes hold 3 + 2 * 2
    for episode_id in range(2):
        buffer.put(make_episode(episode_id), trainer_version=0)
    assert buffer.num_tokens == 14
    assert not buffer.has_room(make_episode(2))
    with pytest.raises(BufferFull):
        buffer.put(make_episode(2), trainer_version=0)


def test_an_episode_larger_than_the_token_capacity_is_refused_naming_the_flag():
    buffer = ReplayBuffer(BufferConfig(capacity_tokens=6))
    with pytest.raises(ValueError, match=r"buffer.capacity_tokens \(6\).*--buffer.capacity-tokens"):
        buffer.put(make_episode(0), trainer_version=0)


def test_mask_tokens_keeps_the_fresh_part_of_a_sequence_whose_kv_a_swap_re_encoded_mid_decode():
    buffer = mask_buffer(max_policy_age=0)
    assert buffer.put(re_encoded(swapped_episode(0, [0, 1], [1, 1])), trainer_version=1)
    (episode,) = buffer.sample(1, trainer_version=1)
    assert [c.trainable for c in episode.completions] == [[False, True], [True, True]]
    assert (buffer.dropped.tokens, buffer.dropped.completions, buffer.dropped.episodes) == (1, 0, 0)


def test_mask_tokens_counts_a_completion_left_without_trainable_tokens_as_dropped():
    buffer = mask_buffer(max_policy_age=0)
    assert buffer.put(swapped_episode(0, [0, 0], [1, 1]), trainer_version=1)
    assert buffer.dropped.completions == 1
    assert buffer.dropped.completion_lengths == {2: 1}
    assert buffer.dropped.episodes == 0


def test_mask_tokens_drops_an_episode_with_nothing_left_to_train():
    buffer = mask_buffer(max_policy_age=1)
    assert buffer.put(swapped_episode(0, [0, 1], [1, 1]), trainer_version=1)
    assert buffer.sample(1, trainer_version=3) is None
    assert buffer.dropped.episode_ids == [0]
    assert buffer.dropped.completions == 2
    assert buffer.dropped.tokens == 4


def test_the_age_bound_is_applied_again_when_sampling():
    buffer = mask_buffer(max_policy_age=1)
    buffer.put(re_encoded(swapped_episode(0, [1, 2], [2, 2])), trainer_version=2)
    (episode,) = buffer.sample(1, trainer_version=3)
    assert episode.completions[0].trainable == [False, True]


def test_length_distributions_of_dropped_and_trained_completions_are_kept_apart():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=0))
    buffer.put(make_episode(0, policy_version=0, num_tokens=9), trainer_version=1)  # dropped
    buffer.put(make_episode(1, policy_version=1, num_tokens=2), trainer_version=1)
    buffer.sample(1, trainer_version=1)
    assert buffer.dropped.completion_lengths == {9: 2}
    assert buffer.trained.completion_lengths == {2: 2}
    assert buffer.trained.tokens == 4 and buffer.trained.episode_ids is None  # the accounting keeps which
    metrics = buffer.dropped.length_metrics("buffer/dropped_")
    assert metrics["buffer/dropped_completion_len_mean"] == 9.0
    assert metrics["buffer/dropped_completion_len_max"] == 9.0


def test_state_dict_round_trips_exactly_and_is_plain_json():
    buffer = mask_buffer(max_policy_age=1, sampling="freshest", admission="drop")
    buffer.put(swapped_episode(0, [0, 1], [1, 1]), trainer_version=1)
    buffer.put(swapped_episode(1, [1, 2], [2, 2]), trainer_version=2)
    buffer.put(swapped_episode(2, [2, 2], [2, 2]), trainer_version=2)
    buffer.put(swapped_episode(3, [1, 1], [1, 2]), trainer_version=2)
    buffer.sample(1, trainer_version=2)
    state = buffer.state_dict()
    restored = mask_buffer(max_policy_age=1, sampling="freshest", admission="drop")
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert restored.sample(2, trainer_version=3) == buffer.sample(2, trainer_version=3)


def test_restoring_more_than_the_capacity_is_refused():
    buffer = ReplayBuffer(BufferConfig(capacity_episodes=2))
    buffer.put(make_episode(0), trainer_version=0)
    buffer.put(make_episode(1), trainer_version=0)
    with pytest.raises(ValueError, match=r"buffer.capacity_episodes \(1\) is below the 2 episodes"):
        ReplayBuffer(BufferConfig(capacity_episodes=1)).load_state_dict(buffer.state_dict())


completion_specs = st.lists(
    # (length, token index where the weights were swapped, versions the swap moved them ahead)
    st.tuples(st.integers(1, 5), st.integers(0, 4), st.integers(0, 3)),
    min_size=1,
    max_size=3,
)
puts = st.tuples(st.just("put"), st.tuples(st.integers(0, 4), completion_specs))  # started this far behind
interleavings = st.lists(
    # puts twice as often as the rest, so that batches fill and the buffer reaches its capacities
    st.one_of(
        puts, puts, st.tuples(st.just("sample"), st.integers(1, 2)), st.tuples(st.just("advance"), st.integers(1, 2))
    ),
    min_size=5,
    max_size=50,
)


def rollout(episode_id: int, trainer_version: int, lag: int, specs: list[tuple[int, int, int]]) -> Episode:
    """Completions started `lag` versions behind; tokens from `swap` on were decoded `bump` versions later."""
    start = max(trainer_version - lag, 0)
    completions = [
        make_completion(policy_version=[min(start + bump * (t >= swap), trainer_version) for t in range(length)])
        for length, swap, bump in specs
    ]
    return Episode(episode_id, "M56=", "6", [1, 5], completions)


@settings(max_examples=300, deadline=None)
@given(
    ops=interleavings,
    max_policy_age=st.integers(0, 3),
    capacity_episodes=st.integers(1, 6),
    capacity_tokens=st.one_of(st.none(), st.integers(17, 60)),  # 17: the largest episode (2 + 3 * 5)
    drop_policy=st.sampled_from(["drop_episode", "mask_tokens"]),
    sampling=st.sampled_from(["fifo", "freshest"]),
    snapshot_fraction=st.floats(0.0, 1.0),
)
def test_no_over_age_token_reaches_a_batch_capacity_holds_and_restored_state_behaves_the_same(
    ops, max_policy_age, capacity_episodes, capacity_tokens, drop_policy, sampling, snapshot_fraction
):
    snapshot_at = int(snapshot_fraction * len(ops))
    config = BufferConfig(
        max_policy_age=max_policy_age,
        capacity_episodes=capacity_episodes,
        capacity_tokens=capacity_tokens,
        drop_policy=drop_policy,
        sampling=sampling,
        admission="drop" if sampling == "freshest" else "pause",  # the buffer itself ignores it
    )
    buffers = [ReplayBuffer(config)]
    trainer_version, handed_out_tokens = 0, 0
    for step, (op, arg) in enumerate(ops):
        if step == snapshot_at:  # from here on a restored copy must do exactly what the original does
            restored = ReplayBuffer(config)
            restored.load_state_dict(buffers[0].state_dict())
            assert restored.state_dict() == buffers[0].state_dict()
            buffers.append(restored)
        if op == "put":
            episode = rollout(step, trainer_version, *arg)
            outcomes = [_put_if_room(buffer, copy.deepcopy(episode), trainer_version) for buffer in buffers]
            assert len(set(outcomes)) == 1
        elif op == "sample":
            batches = [buffer.sample(arg, trainer_version) for buffer in buffers]
            assert all(batch == batches[0] for batch in batches)
            if batches[0]:
                batch = make_train_batch(batches[0], pad_id=0)
                trained_versions = [
                    version
                    for episode in batches[0]
                    for completion in episode.completions
                    for version, trained in zip(completion.policy_versions, completion.loss_mask)
                    if trained
                ]
                assert all(trainer_version - version <= max_policy_age for version in trained_versions)
                handed_out_tokens += batch.num_generated_tokens
        elif op == "advance":
            trainer_version += arg
        for buffer in buffers:
            assert len(buffer) <= capacity_episodes
            assert capacity_tokens is None or buffer.num_tokens <= capacity_tokens
    assert buffers[0].trained.tokens == handed_out_tokens
    assert all(buffer.state_dict() == buffers[0].state_dict() for buffer in buffers)


def _put_if_room(buffer: ReplayBuffer, episode: Episode, trainer_version: int) -> str:
    """Put as the actor shell would; `has_room` must predict whether it fits, and a full buffer
    must refuse (BufferFull), never grow."""
    room = buffer.has_room(episode)
    try:
        return "kept" if buffer.put(episode, trainer_version) else "dropped"
    except BufferFull:
        assert not room
        return "full"


def test_fifo_serves_the_stalest_version_first_so_a_late_finisher_cannot_expire():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1, capacity_episodes=8))
    buffer.put(make_episode(1, policy_version=1), trainer_version=1)
    buffer.put(make_episode(2, policy_version=1), trainer_version=1)
    buffer.put(make_episode(0, policy_version=0), trainer_version=1)  # started first, finished last
    assert [e.episode_id for e in buffer.sample(2, trainer_version=1)] == [0, 1]


def test_an_episode_dropped_at_put_while_sample_waits_is_reported_once():
    """WaitingBuffer: `put` reports the drop to its caller; `sample` must not report it again as an
    eviction, or the rollouts subtract it twice and the admission gate admits too much."""

    async def scenario():
        buffer = WaitingBuffer(BufferConfig(max_policy_age=0))
        sample = asyncio.ensure_future(buffer.sample(1, 2))  # waits: the buffer is empty
        # `sample` sets the version staleness is measured against on entry, then waits.
        await wait_until_async(lambda: buffer.trainer_version == 2, "sample to set the trainer's version")
        assert not sample.done()
        assert await buffer.put([make_episode(episode_id=0, policy_version=0)]) == 1  # two versions behind
        assert await buffer.put([make_episode(episode_id=1, policy_version=2)]) == 0
        batch, evicted_versions, waited_s = await asyncio.wait_for(sample, 60)
        assert [episode.episode_id for episode in batch] == [1]
        assert evicted_versions == []
        assert waited_s > 0  # it waited for episode 1

    asyncio.run(scenario())


def test_an_episode_too_old_for_the_next_batch_is_refused_at_put_not_held_until_sample_evicts_it():
    """Once a batch is taken at version v, the next one trains at v + 1: `put` judges episodes
    there, so one that only version v could still train is counted as dropped at once instead of
    taking a slot until the next `sample` evicts it."""

    async def scenario():
        buffer = WaitingBuffer(BufferConfig(max_policy_age=0))
        await buffer.put([make_episode(episode_id=0, policy_version=0)])
        await buffer.sample(1, 0)
        assert await buffer.put([make_episode(episode_id=1, policy_version=0)]) == 1
        assert len(buffer.buffer) == 0 and buffer.buffer.dropped.episode_ids == [1]
        assert await buffer.put([make_episode(episode_id=2, policy_version=1)]) == 0

    asyncio.run(scenario())


def test_after_a_skipped_step_put_judges_at_the_version_the_next_batch_still_trains_at():
    """A skipped step publishes nothing: the next batch trains at the skipped one's version, so an
    episode of that version is still kept."""

    async def scenario():
        buffer = WaitingBuffer(BufferConfig(max_policy_age=0))
        await buffer.put([make_episode(episode_id=0, policy_version=0)])
        await buffer.sample(1, 0)
        buffer.step_skipped()
        assert await buffer.put([make_episode(episode_id=1, policy_version=0)]) == 0
        batch, evicted_versions, _ = await buffer.sample(1, 0)
        assert [e.episode_id for e in batch] == [1] and evicted_versions == []

    asyncio.run(scenario())
