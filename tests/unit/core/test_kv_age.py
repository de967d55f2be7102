"""The age bound on the oldest weights a token depends on: the weights that sampled it and those
whose KV it attended to (forge_rl/core/columns.py `exact_versions`), as the buffer applies it with
`drop_policy: mask_tokens` to a partial rollout's straggler."""

import pytest

from forge_rl.core.buffer import BufferConfig, ReplayBuffer
from forge_rl.core.columns import batch_columns, exact_versions
from forge_rl.types import Completion, Episode
from tests.support.builders import make_completion


def _partial_rollouts_buffer(max_policy_age: int) -> ReplayBuffer:
    return ReplayBuffer(
        BufferConfig(max_policy_age=max_policy_age, drop_policy="mask_tokens", wait_for_stragglers=False)
    )


def _episode(*completions: Completion) -> Episode:
    for index, completion in enumerate(completions):
        completion.reward = float(index % 2)
    return Episode(0, "M56=", "6", [1, 5, 6], list(completions))


def test_a_stragglers_late_tokens_that_attend_to_kv_of_too_old_weights_are_masked_whatever_sampled_them():
    # Started at version 0, continued across two swaps that kept its KV (swap_kv reuse): tokens
    # labelled 2 and 3 attend to a prefix encoded by version 0, three versions behind the trainer.
    straggler = make_completion(policy_version=[0, 0, 2, 3])
    fresh = make_completion(policy_version=[3, 3, 3, 3])
    buffer = _partial_rollouts_buffer(max_policy_age=1)
    assert buffer.put(_episode(straggler, fresh), trainer_version=3)
    (episode,) = buffer.sample(1, trainer_version=3)
    assert [c.trainable for c in episode.completions] == [[False] * 4, [True] * 4]
    assert (buffer.dropped.completions, buffer.dropped.tokens) == (1, 4)


def test_tokens_after_a_swap_that_re_encoded_their_context_are_masked_by_their_own_version():
    # An abort resubmission (or swap_kv recompute) re-encoded the prefix with version 2: the
    # engine's record says the later tokens depend on versions 2 and 3 only.
    straggler = make_completion(policy_version=[0, 0, 2, 3])
    straggler.kv_versions = [0, 0, 2, 2]
    buffer = _partial_rollouts_buffer(max_policy_age=1)
    assert buffer.put(_episode(straggler, make_completion(policy_version=[3, 3, 3, 3])), trainer_version=3)
    (episode,) = buffer.sample(1, trainer_version=3)
    assert episode.completions[0].trainable == [False, False, True, True]


def test_a_later_turn_re_prefilled_at_a_newer_version_keeps_its_tokens():
    trajectory = Completion(
        token_ids=[10, 11, 40, 12, 13],
        logprobs=[-0.5, -0.5, 0.0, -0.5, -0.5],
        policy_versions=[0, 0, 0, 2, 3],
        generated=[True, True, False, True, True],
    )
    assert exact_versions(trajectory) == [0, 0, -1, 2, 2]
    buffer = _partial_rollouts_buffer(max_policy_age=1)
    assert buffer.put(_episode(trajectory, make_completion(policy_version=[3, 3, 3, 3])), trainer_version=3)
    (episode,) = buffer.sample(1, trainer_version=3)
    assert episode.completions[0].loss_mask == [False, False, False, True, True]


def test_the_engines_record_of_the_kv_a_token_attended_to_is_what_the_batch_carries():
    recorded = make_completion(policy_version=[0, 0, 2, 3])
    recorded.kv_versions = [0, 0, 2, 2]
    unrecorded = make_completion(policy_version=[0, 0, 2, 3])
    columns = batch_columns([Episode(0, "M56=", "6", [1], [recorded, unrecorded])])
    assert list(columns.exact_versions) == [-1, 0, 0, 2, 2, -1, 0, 0, 0, 0]


def test_a_kv_record_of_another_length_than_the_tokens_is_refused():
    with pytest.raises(ValueError, match="kv_versions"):
        Completion(token_ids=[1, 2], logprobs=[0.0, 0.0], policy_versions=[0, 0], kv_versions=[0])
