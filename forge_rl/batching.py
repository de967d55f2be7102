"""Turns episodes into the padded tensors of one trainer step. Plain PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge_rl.advantages import episode_advantages
from forge_rl.types import Episode


@dataclass
class TrainBatch:
    """One optimizer step's data. N = trainable completions, L = longest prompt+completion.

    Row i holds prompt + completion i, right-padded with the pad id. Position j of `loss_mask_NL`
    is True when token j was generated and may reach the loss (see `Completion.loss_mask`); the
    model predicts it from position j-1.
    """

    input_ids_NL: torch.Tensor
    """[N, L] int64 token ids."""
    loss_mask_NL: torch.Tensor
    """[N, L] bool, True on generated tokens."""
    behaviour_logprobs_NL: torch.Tensor
    """[N, L] float32 logprob the generator sampled each generated token with (0 elsewhere)."""
    policy_versions_NL: torch.Tensor
    """[N, L] int64 version that generated each token (-1 elsewhere)."""
    advantages_N: torch.Tensor
    """[N] float32 group advantage of each completion (see `forge_rl.advantages`)."""
    reference_logprobs_NL: torch.Tensor | None = None
    """[N, L] float32 logprob of each token under the frozen reference model, for the KL penalty
    (`LossConfig.kl_beta` > 0); None when no reference model runs."""
    lengths_N: torch.Tensor | None = None
    """[N] int64 real tokens (prompt + completion) of each row, the rest is padding; None means
    every row is L long. The trainer's forward layout (`forge_rl.packing`) reads it."""

    @property
    def num_generated_tokens(self) -> int:
        """Tokens that may reach the loss: real generated tokens, never padding."""
        return int(self.loss_mask_NL.sum())

    @property
    def row_lengths(self) -> list[int]:
        """Real tokens of each row (`lengths_N`, or L for every row when it is None)."""
        if self.lengths_N is None:
            return [self.input_ids_NL.shape[1]] * self.input_ids_NL.shape[0]
        return self.lengths_N.tolist()

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """Rows of data-parallel rank `rank` (contiguous blocks; N must divide evenly)."""
        rows = self.input_ids_NL.shape[0]
        if rows % world_size:
            raise ValueError(f"{rows} rows do not split evenly over {world_size} data-parallel ranks")
        per_rank = rows // world_size
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        reference = self.reference_logprobs_NL
        return TrainBatch(
            self.input_ids_NL[sl],
            self.loss_mask_NL[sl],
            self.behaviour_logprobs_NL[sl],
            self.policy_versions_NL[sl],
            self.advantages_N[sl],
            None if reference is None else reference[sl],
            None if self.lengths_N is None else self.lengths_N[sl],
        )


def make_train_batch(episodes: list[Episode], pad_id: int, normalize_advantage_std: bool = True) -> TrainBatch:
    """One row per completion. A token reaches the loss only where `Completion.loss_mask` says so:
    ERRORED completions and rows whose tokens are all untrainable keep their row (so N always
    equals the configured batch and splits evenly over data-parallel ranks) but are fully masked.

    `normalize_advantage_std` is `LossConfig.normalize_advantage_std` (False for Dr. GRPO).
    """
    rows, masks, behaviour, versions, advantages = [], [], [], [], []
    for episode in episodes:
        num_prompt = len(episode.prompt_token_ids)
        advantages.extend(episode_advantages(episode, normalize_advantage_std))
        for completion in episode.completions:
            rows.append(episode.prompt_token_ids + completion.token_ids)
            masks.append([False] * num_prompt + completion.loss_mask)
            behaviour.append([0.0] * num_prompt + completion.logprobs)
            versions.append([-1] * num_prompt + completion.policy_versions)
    if not rows:
        raise ValueError("make_train_batch got no completions")
    length = max(len(r) for r in rows)

    def pad(values: list[list], fill, dtype) -> torch.Tensor:
        return torch.tensor([v + [fill] * (length - len(v)) for v in values], dtype=dtype)

    return TrainBatch(
        input_ids_NL=pad(rows, pad_id, torch.int64),
        loss_mask_NL=pad(masks, False, torch.bool),
        behaviour_logprobs_NL=pad(behaviour, 0.0, torch.float32),
        policy_versions_NL=pad(versions, -1, torch.int64),
        advantages_N=torch.tensor(advantages, dtype=torch.float32),
        lengths_N=torch.tensor([len(r) for r in rows], dtype=torch.int64),
    )


def token_logprobs(logits_NLV: torch.Tensor, input_ids_NL: torch.Tensor) -> torch.Tensor:
    """Logprob of each token given its prefix, aligned to the token: [N, L] (position 0 gets 0)."""
    logprobs_NLV = torch.log_softmax(logits_NLV[:, :-1].float(), dim=-1)
    next_tokens = input_ids_NL[:, 1:].unsqueeze(-1)
    picked = logprobs_NLV.gather(-1, next_tokens).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)
