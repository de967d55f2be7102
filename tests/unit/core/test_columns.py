"""A batch as columns (forge_rl/core/columns.py) and padded from them (forge_rl/core/batching.py `pad_columns`):
what the rollouts send the trainer, and what the trainer makes of it."""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_rl.core.advantages import token_advantages
from forge_rl.core.batching import make_train_batch, pad_columns
from forge_rl.core.columns import batch_columns, exact_versions
from forge_rl.types import Completion, CompletionStatus, Episode


def episode(index: int, prompt: list[int], completions: list[Completion]) -> Episode:
    return Episode(index, "p", "a", prompt, completions, generator_index=index % 2, temperature=0.5 + index)


def test_rows_of_different_lengths_are_flat_in_the_columns_and_right_padded_in_the_batch():
    short = Completion([7], [-0.25], [2], reward=1.0)
    long = Completion([8, 9, 10], [-0.5, -0.75, -1.0], [2, 2, 3], reward=0.0, trainable=[True, False, True])
    columns = batch_columns([episode(0, [1, 2], [short, long]), episode(1, [3], [long, short])])

    assert list(columns.lengths) == [3, 5, 4, 2]
    assert list(columns.token_ids) == [1, 2, 7, 1, 2, 8, 9, 10, 3, 8, 9, 10, 3, 7]
    assert list(columns.loss_mask) == [0, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]
    assert list(columns.exact_versions) == [-1, -1, 2, -1, -1, 2, 2, 2, -1, 2, 2, 2, -1, 2]
    assert list(columns.generators) == [0, 0, 1, 1] and list(columns.temperatures) == [0.5, 0.5, 1.5, 1.5]
    assert columns.num_tokens == 14 and columns.num_trained_tokens == 6

    batch = pad_columns(columns, pad_id=0)
    assert batch.input_ids_NL.tolist() == [[1, 2, 7, 0, 0], [1, 2, 8, 9, 10], [3, 8, 9, 10, 0], [3, 7, 0, 0, 0]]
    assert batch.behaviour_logprobs_NL[1].tolist() == [0.0, 0.0, -0.5, -0.75, -1.0]
    assert batch.exact_version_NL[3].tolist() == [-1, 2, -1, -1, -1]
    assert batch.lengths_N.tolist() == [3, 5, 4, 2]
    assert batch.num_generated_tokens == columns.num_trained_tokens


def test_columns_cross_a_pickle_as_buffers_and_pad_to_the_same_batch():
    completions = [
        Completion([5, 6], [-0.5, -0.5], [1, 1], reward=float(i % 2), reference_logprobs=[-0.1 * i, -0.2])
        for i in range(4)
    ]
    completions[1].status = CompletionStatus.ERRORED
    completions[2].sampling_support = [[5, 9], [6]]
    columns = batch_columns([episode(0, [1, 2, 3], completions)])

    crossed = pickle.loads(pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL))

    assert crossed == columns
    here, there = pad_columns(columns, pad_id=0), pad_columns(crossed, pad_id=0)
    for name in ("input_ids_NL", "loss_mask_NL", "advantages_NL", "support_NLK", "reference_logprobs_NL"):
        assert torch.equal(getattr(here, name), getattr(there, name)), name
    assert here.loss_mask_NL[1].tolist() == [False] * 5  # the ERRORED row keeps its place, masked


def reference_exact_versions(versions: list[int], generated: list[bool]) -> list[int]:
    """The definition, walked token by token: the oldest version of the turn so far, -1 on context."""
    out, oldest = [], None
    for version, sampled in zip(versions, generated):
        oldest = None if not sampled else version if oldest is None else min(oldest, version)
        out.append(-1 if oldest is None else oldest)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=0, max_size=12), st.booleans())
def test_exact_versions_whether_walked_or_taken_whole_follow_the_definition(tokens, all_generated):
    versions = [v for v, _ in tokens]
    generated = [True] * len(tokens) if all_generated else [g for _, g in tokens]
    completion = Completion(
        list(range(len(tokens))), [0.0] * len(tokens), versions, generated=None if all_generated else generated
    )
    assert exact_versions(completion) == reference_exact_versions(versions, generated)
    if tokens:  # the batch's column, which takes a one-turn completion whole when it can
        columns = batch_columns([episode(0, [], [completion])])
        assert list(columns.exact_versions) == reference_exact_versions(versions, generated)


def test_a_completions_advantage_column_is_its_token_advantages_with_and_without_step_rewards():
    plain = [Completion([5, 6], [-0.5] * 2, [1, 1], reward=float(i % 2)) for i in range(3)]
    plain[2].status = CompletionStatus.ERRORED
    stepped = [
        Completion([5, 6, 7], [-0.5] * 3, [1] * 3, reward=float(i), step_ends=[1, 3], step_rewards=[0.5 * i, 1.0 - i])
        for i in range(2)
    ]
    for completions in (plain, stepped):
        group = episode(0, [1], completions)
        for normalize_std in (True, False):
            # Each row: the one-token prompt's 0, then the completion's per-token advantages.
            expected = [
                value for per_token in token_advantages(group, normalize_std, 0.5) for value in [0.0, *per_token]
            ]
            got = list(batch_columns([group], normalize_std, 0.5).advantages)
            assert got == pytest.approx(expected, abs=1e-6)


def test_make_train_batch_is_the_columns_padded():
    episodes = [
        episode(i, [1, 2][: i + 1], [Completion([5, 6, 7][: i + 1], [-0.5] * (i + 1), [i] * (i + 1), reward=1.0)])
        for i in range(2)
    ]
    direct, via_columns = make_train_batch(episodes, pad_id=3), pad_columns(batch_columns(episodes), pad_id=3)
    assert torch.equal(direct.input_ids_NL, via_columns.input_ids_NL)
    assert direct.input_ids_NL.tolist() == [[1, 5, 3, 3], [1, 2, 5, 6]]
