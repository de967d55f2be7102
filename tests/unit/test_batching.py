import pytest
import torch

from forge_rl.batching import make_train_batch, token_logprobs
from forge_rl.types import CompletionStatus

from .builders import make_episode


def test_rows_are_prompt_plus_completion_with_the_loss_on_generated_tokens_only():
    episode = make_episode(prompt_token_ids=(1, 5, 6), rewards=(1.0, 0.0), num_tokens=2)
    episode.completions[1].token_ids = [30]  # a shorter completion gets right-padded
    episode.completions[1].logprobs = [-0.5]
    episode.completions[1].policy_versions = [0]
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
