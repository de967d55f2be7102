import math

import pytest
import torch

from forge_rl.core.batching import kept_sets, make_train_batch, token_logprobs
from forge_rl.types import Completion, CompletionStatus
from tests.support.builders import completion_advantages, make_completion, make_episode


def test_rows_are_prompt_plus_completion_with_the_loss_on_generated_tokens_only():
    episode = make_episode(prompt_token_ids=(1, 5, 6), rewards=(1.0, 0.0), num_tokens=2)
    # a shorter completion gets right-padded
    episode.completions[1] = Completion(token_ids=[30], logprobs=[-0.5], policy_versions=[0], reward=0.0)
    batch = make_train_batch([episode], pad_id=0)
    assert batch.input_ids_NL.tolist() == [[1, 5, 6, 10, 11], [1, 5, 6, 30, 0]]
    assert batch.loss_mask_NL.tolist() == [[False, False, False, True, True], [False, False, False, True, False]]
    assert completion_advantages(batch) == pytest.approx([1.0, -1.0], abs=1e-5)


def test_errored_completions_keep_their_row_fully_masked_with_zero_advantage():
    episode = make_episode(rewards=(1.0, 0.0, 0.5))
    episode.completions[2].status = CompletionStatus.ERRORED
    batch = make_train_batch([episode], pad_id=0)
    assert batch.input_ids_NL.shape[0] == 3
    assert not batch.loss_mask_NL[2].any()
    assert completion_advantages(batch) == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)


def test_each_generated_token_carries_the_oldest_version_of_its_turn_so_far():
    """The weights behind a token: a swap mid-turn leaves the rest of the turn on KV of the older
    version; the next turn's prefix is encoded afresh by the version that samples it."""
    episode = make_episode(prompt_token_ids=(1,), rewards=(1.0, 0.0), num_tokens=4)
    episode.completions[0].policy_versions = [3, 3, 4, 4]  # one turn, a keep-mode swap after 2 tokens
    episode.completions[1] = Completion(  # two turns, the swap between them
        token_ids=[7, 8, 9, 10],
        logprobs=[-0.1, 0.0, -0.3, -0.2],
        policy_versions=[3, 3, 4, 4],
        generated=[True, False, True, True],
        reward=0.0,
    )
    assert make_train_batch([episode], pad_id=0).exact_version_NL.tolist() == [[-1, 3, 3, 3, 3], [-1, 3, -1, 4, 4]]


def test_shards_split_rows_evenly_across_data_parallel_ranks():
    batch = make_train_batch([make_episode(i) for i in range(2)], pad_id=0)
    shards = [batch.shard(rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([s.input_ids_NL for s in shards]), batch.input_ids_NL)


def test_rows_that_do_not_split_evenly_are_filled_up_with_rows_that_reach_no_loss():
    # A multi-agent group holds as many rows as it had agents: here 3, over 2 ranks.
    episode = make_episode(rewards=(1.0, 0.0, 0.5), num_tokens=2)
    episode.completions[1] = Completion(token_ids=[30], logprobs=[-0.5], policy_versions=[0], reward=0.0)
    batch = make_train_batch([episode], pad_id=0)
    shards = [batch.shard(rank, 2) for rank in range(2)]
    assert [s.input_ids_NL.shape[0] for s in shards] == [2, 2]
    assert torch.equal(torch.cat([s.input_ids_NL for s in shards])[:3], batch.input_ids_NL)
    filler = shards[1]
    assert filler.input_ids_NL[1].tolist() == batch.input_ids_NL[1].tolist()  # a copy of the shortest row
    assert not filler.loss_mask_NL[1].any()
    assert sum(s.num_generated_tokens for s in shards) == batch.num_generated_tokens


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
    assert completion_advantages(batch) == pytest.approx([1.0, -1.0], abs=1e-5)


def test_dr_grpo_advantages_are_centered_but_not_divided_by_the_group_std():
    episode = make_episode(rewards=(1.0, 0.0, 0.0, 0.0))
    normalized = completion_advantages(make_train_batch([episode], pad_id=0))
    centered = completion_advantages(make_train_batch([episode], pad_id=0, normalize_advantage_std=False))
    assert centered == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert normalized[0] == pytest.approx(0.75 / 0.4330127, rel=1e-5)


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
    kept = [[kept_ids(batch.support_NLK[n, j]) for j in range(num_prompt + 2)] for n in range(2)]
    assert kept[0] == [[]] * num_prompt + [[5, 7], [9]]
    assert kept[1] == [[]] * (num_prompt + 2)
    shard = batch.shard(1, 2)
    assert torch.equal(shard.support_NLK, batch.support_NLK[1:]) and shard.temperature_N.shape == (1,)


def kept_ids(support_K: torch.Tensor) -> list[int]:
    """The kept ids of one position, in either encoding of `kept_sets`."""
    if support_K.dtype == torch.uint8:
        return [v for v in range(8 * len(support_K)) if support_K[v // 8] >> (v % 8) & 1]
    return [v for v in support_K.tolist() if v >= 0]


VOCAB = 4096


def top_p_like_supports(num_positions: int, large: int) -> list[list[int]]:
    """Kept sets as top-p leaves them: mostly a few ids, and one position unsure over `large`."""
    generator = torch.Generator().manual_seed(0)
    sizes = [large] + [int(k) for k in torch.randint(1, 4, (num_positions - 1,), generator=generator)]
    return [sorted(torch.randperm(VOCAB, generator=generator)[:k].tolist()) for k in sizes]


def test_large_kept_sets_cost_a_bitmask_of_vocabulary_over_8_bytes_per_token_not_the_largest_set():
    supports = top_p_like_supports(64, large=3000)
    support_NLK = kept_sets([supports], length=64)

    assert support_NLK.dtype == torch.uint8 and support_NLK.shape == (1, 64, VOCAB // 8)  # 512 B, not 3000 ids
    assert [kept_ids(support_NLK[0, j]) for j in range(64)] == supports


def test_small_kept_sets_stay_int32_ids():
    supports = [[3, 4000], [17], []]
    support_NLK = kept_sets([supports], length=3)
    assert support_NLK.dtype == torch.int32 and support_NLK.shape == (1, 3, 2)
    assert [kept_ids(support_NLK[0, j]) for j in range(3)] == supports


def test_both_encodings_renormalize_exactly_as_the_written_out_formula():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, VOCAB, requires_grad=True)
    supports = top_p_like_supports(6, large=3000)
    supports[2] = []  # nothing filtered here: the whole vocabulary
    ids = torch.tensor([[supports[j - 1][0] if j and supports[j - 1] else 7 for j in range(6)]])
    shifted = [[]] + supports[:-1]  # the kept set of token j was recorded at position j
    bitmask, id_lists = kept_sets([shifted], 6), kept_sets([[s[:3] for s in shifted]], 6)
    assert (bitmask.dtype, id_lists.dtype) == (torch.uint8, torch.int32)
    for support_NLK, kept_per_position in ((bitmask, shifted), (id_lists, [s[:3] for s in shifted])):
        logprobs = token_logprobs(logits, ids, None, support_NLK)
        for j in range(1, 6):
            expected = _reference_logprob(
                logits[0, j - 1].detach(), ids[0, j].item(), 1.0, kept_per_position[j] or None
            )
            assert logprobs[0, j].item() == pytest.approx(expected, abs=1e-4)
    token_logprobs(logits, ids, None, bitmask).sum().backward()
    assert torch.isfinite(logits.grad).all()
