import math

import pytest
import torch

from forge_rl.batching import make_train_batch, token_logprobs
from forge_rl.types import Completion, CompletionStatus

from .builders import make_completion, make_episode


def test_rows_are_prompt_plus_completion_with_the_loss_on_generated_tokens_only():
    episode = make_episode(prompt_token_ids=(1, 5, 6), rewards=(1.0, 0.0), num_tokens=2)
    # a shorter completion gets right-padded
    episode.completions[1] = Completion(token_ids=[30], logprobs=[-0.5], policy_versions=[0], reward=0.0)
    batch = make_train_batch([episode], pad_id=0)
    assert batch.input_ids_NL.tolist() == [[1, 5, 6, 10, 11], [1, 5, 6, 30, 0]]
    assert batch.loss_mask_NL.tolist() == [[False, False, False, True, True], [False, False, False, True, False]]
    assert batch.advantages_N.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_errored_completions_keep_their_row_fully_masked_with_zero_advantage():
    episode = make_episode(rewards=(1.0, 0.0, 0.5))
    episode.completions[2].status = CompletionStatus.ERRORED
    batch = make_train_batch([episode], pad_id=0)
    assert batch.input_ids_NL.shape[0] == 3
    assert not batch.loss_mask_NL[2].any()
    assert batch.advantages_N.tolist()[2] == 0.0
    assert batch.advantages_N[:2].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_shards_split_rows_evenly_across_data_parallel_ranks():
    batch = make_train_batch([make_episode(i) for i in range(2)], pad_id=0)
    shards = [batch.shard(rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([s.input_ids_NL for s in shards]), batch.input_ids_NL)


def test_token_logprobs_align_each_token_with_the_prediction_from_its_prefix():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0  # position 0 predicts token 2
    logprobs = token_logprobs(logits, torch.tensor([[1, 2, 3]]))
    assert logprobs[0, 0].item() == 0.0
    assert logprobs[0, 1].item() > -1e-3
    assert logprobs[0, 2].item() == torch.log_softmax(torch.zeros(4), 0)[3].item()


def test_untrainable_tokens_keep_their_place_but_get_no_loss():
    episode = make_episode(rewards=(1.0, 0.0), num_tokens=3)
    episode.completions[0] = make_completion(3, policy_version=[0, 1, 1], reward=1.0)
    episode.completions[0].trainable = [False, True, True]
    batch = make_train_batch([episode], pad_id=0)
    assert batch.loss_mask_NL[0].tolist() == [False, False, False, False, True, True]
    assert batch.input_ids_NL[0, 3].item() == episode.completions[0].token_ids[0]  # in place, only masked
    assert batch.advantages_N.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_dr_grpo_advantages_are_centered_but_not_divided_by_the_group_std():
    episode = make_episode(rewards=(1.0, 0.0, 0.0, 0.0))
    normalized = make_train_batch([episode], pad_id=0).advantages_N
    centered = make_train_batch([episode], pad_id=0, normalize_advantage_std=False).advantages_N
    assert centered.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert normalized[0].item() == pytest.approx(0.75 / 0.4330127, rel=1e-5)


def test_shards_carry_their_rows_of_the_reference_logprobs():
    batch = make_train_batch([make_episode(i) for i in range(2)], pad_id=0)
    batch.reference_logprobs_NL = torch.arange(batch.input_ids_NL.numel(), dtype=torch.float32).view_as(
        batch.behaviour_logprobs_NL
    )
    shard = batch.shard(1, 2)
    assert torch.equal(shard.reference_logprobs_NL, batch.reference_logprobs_NL[2:])
    assert batch.shard(0, 2).reference_logprobs_NL.shape[0] == 2


def _reference_logprob(logits_V: torch.Tensor, token: int, temperature: float, kept: list[int] | None) -> float:
    """log p(token) under softmax(logits / temperature) restricted to `kept`, written out by hand."""
    scaled = [x / temperature for x in logits_V.tolist()]
    support = kept if kept is not None else range(len(scaled))
    return scaled[token] - math.log(sum(math.exp(scaled[v]) for v in support))


def test_token_logprobs_divide_by_temperature_and_renormalize_over_the_kept_set():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6)
    ids = torch.tensor([[0, 3, 1, 5], [2, 2, 4, 0]])
    temperature = torch.tensor([0.7, 1.3])
    support = torch.full((2, 4, 3), -1)
    support[0, 2] = torch.tensor([1, 4, 2])  # token 1 drawn from {1, 4, 2}
    support[1, 3, :2] = torch.tensor([0, 5])  # token 0 drawn from {0, 5}; other positions: whole vocab
    logprobs = token_logprobs(logits, ids, temperature[:, None].expand(2, 4), support)
    for n in range(2):
        for j in range(1, 4):
            kept = [v for v in support[n, j].tolist() if v >= 0] or None
            expected = _reference_logprob(logits[n, j - 1], ids[n, j].item(), temperature[n].item(), kept)
            assert logprobs[n, j].item() == pytest.approx(expected, abs=1e-5)


def test_renormalized_logprobs_have_finite_gradients_where_nothing_was_filtered():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    support = torch.full((1, 3, 2), -1)
    support[0, 1] = torch.tensor([4, 1])
    token_logprobs(logits, torch.tensor([[0, 1, 3]]), None, support).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_batches_carry_temperature_and_kept_sets_aligned_to_their_tokens():
    episode = make_episode(rewards=(1.0, 0.0), num_tokens=2)
    episode.temperature = 0.8
    episode.completions[0].sampling_support = [[5, 7], [9]]
    batch = make_train_batch([episode], pad_id=0)
    num_prompt = len(episode.prompt_token_ids)
    assert batch.temperature_N.tolist() == pytest.approx([0.8, 0.8])
    assert batch.support_NLK.shape == (2, num_prompt + 2, 2)
    assert batch.support_NLK[0, num_prompt].tolist() == [5, 7]
    assert batch.support_NLK[0, num_prompt + 1].tolist() == [9, -1]
    assert (batch.support_NLK[1] == -1).all() and (batch.support_NLK[0, :num_prompt] == -1).all()
    shard = batch.shard(1, 2)
    assert torch.equal(shard.support_NLK, batch.support_NLK[1:]) and shard.temperature_N.shape == (1,)
