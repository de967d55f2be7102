import collections

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from forge_rl.training.reference import attach_reference_logprobs, completion_logprobs
from forge_rl.types import Completion, CompletionStatus, Episode, join_pieces
from tests.support.builders import make_completion, make_episode


def test_every_token_is_trainable_unless_marked_otherwise():
    completion = make_completion(3)
    assert completion.trainable == [True, True, True]
    assert completion.num_trainable_tokens == 3


def test_errored_completions_have_no_loss_tokens_whatever_their_trainable_flags():
    completion = make_completion(2, status=CompletionStatus.ERRORED)
    assert completion.loss_mask == [False, False]


def test_per_token_fields_must_agree_in_length():
    with pytest.raises(ValueError, match="'trainable': 1"):
        Completion(token_ids=[1, 2], logprobs=[-0.1, -0.2], policy_versions=[0, 0], trainable=[True])


def test_episodes_round_trip_through_plain_dicts():
    episode = make_episode(7, rewards=(1.0, 0.0))
    episode.completions[1] = Completion(
        [4, 2], [-0.3, -0.1], [3, 4], "x", 0.5, CompletionStatus.TRUNCATED, trainable=[False, True]
    )
    episode.completions.append(
        Completion(  # a two-turn trajectory: context, turn, observation, turn
            [1, 5, 2, 6, 7, 2],
            [0.0, -0.2, -0.1, 0.0, -0.4, -0.3],
            [3, 3, 3, 3, 4, 4],
            generated=[False, True, True, False, True, True],
            num_turns=2,
            turn_rewards=[None, 1.0],
            env_latencies_s=[0.01, 0.02],
            end_reason="done",
        )
    )
    data = episode.to_dict()
    assert data["completions"][1]["status"] == "truncated"
    assert Episode.from_dict(data) == episode


def test_context_tokens_of_a_trajectory_reach_no_loss_and_do_not_age_it():
    completion = Completion(
        [1, 5, 2, 6, 7, 2],
        [0.0, -0.2, -0.1, 0.0, -0.4, -0.3],
        [0, 3, 3, 3, 4, 4],
        generated=[False, True, True, False, True, True],
        trainable=[True, True, False, True, True, True],
    )
    assert completion.loss_mask == [False, True, False, False, True, True]
    assert completion.oldest_policy_version == 3  # the context token stamped 0 does not count
    assert completion.num_generated_tokens == 4 and completion.num_tokens == 6
    with pytest.raises(ValueError, match="'generated': 2"):
        Completion([1, 2, 3], [0.0, -0.1, -0.2], [0, 0, 0], generated=[False, True])


def test_reference_logprobs_are_attached_per_completion_without_the_prompt():
    episodes = [make_episode(0, num_tokens=2), make_episode(1, num_tokens=2)]
    num_prompt = len(episodes[0].prompt_token_ids)
    rows = sum(len(e.completions) for e in episodes)
    logprobs_NL = torch.arange(rows * (num_prompt + 2), dtype=torch.float32).reshape(rows, -1)
    attach_reference_logprobs(episodes, completion_logprobs(episodes, logprobs_NL))
    assert (
        episodes[1].completions[0].reference_logprobs == logprobs_NL[len(episodes[0].completions), num_prompt:].tolist()
    )
    with pytest.raises(ValueError, match="rows of logprobs"):
        completion_logprobs(episodes[:1], logprobs_NL)


def test_per_token_fields_must_match_the_completion_length():
    with pytest.raises(ValueError, match="sampling_support"):
        Completion([1, 2], [-0.1, -0.2], [0, 0], sampling_support=[[1]])


@given(
    st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=30),
    st.booleans(),
    st.sampled_from(list(CompletionStatus)),
)
def test_the_fast_token_counts_equal_their_definitions_over_the_loss_mask(tokens, with_generated, status):
    """num_trainable_tokens, trained_tokens_by_version and oldest_policy_version skip the per-token
    walk when they can; they must count exactly what the loss mask and the generated mask say."""
    versions = [v for v, _, _ in tokens]
    completion = Completion(
        token_ids=list(range(len(tokens))),
        logprobs=[0.0] * len(tokens),
        policy_versions=versions,
        trainable=[t for _, t, _ in tokens],
        generated=[g for _, _, g in tokens] if with_generated else None,
        status=status,
    )
    mask = completion.loss_mask
    assert completion.num_trainable_tokens == sum(mask)
    expected = collections.Counter(v for v, trains in zip(versions, mask) if trains)
    assert completion.trained_tokens_by_version() == dict(expected)
    sampled = [v for v, g in zip(versions, completion.generated_mask) if g]
    assert completion.oldest_policy_version == min(sampled, default=0)


def test_pieces_join_in_order_and_an_empty_head_is_the_tail_itself():
    head = Completion([4, 5], [-0.1, -0.2], [1, 1], sampling_support=[[4], [5, 6]], kv_versions=[1, 1])
    tail = Completion(
        [6, 2],
        [-0.3, -0.4],
        [3, 3],
        text="whole",
        status=CompletionStatus.TRUNCATED,
        sampling_support=[[6], [2]],
        kv_versions=[3, 3],
    )
    joined = join_pieces(head, tail)
    assert (joined.token_ids, joined.logprobs, joined.policy_versions) == (
        [4, 5, 6, 2],
        [-0.1, -0.2, -0.3, -0.4],
        [1, 1, 3, 3],
    )
    assert joined.sampling_support == [[4], [5, 6], [6], [2]] and joined.kv_versions == [1, 1, 3, 3]
    assert (joined.text, joined.status) == ("whole", CompletionStatus.TRUNCATED)
    assert join_pieces(Completion([], [], []), tail) is tail
