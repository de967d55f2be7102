import pytest

from forge_rl.types import Completion, CompletionStatus, Episode

from .builders import make_completion, make_episode


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
    data = episode.to_dict()
    assert data["completions"][1]["status"] == "truncated"
    assert Episode.from_dict(data) == episode
