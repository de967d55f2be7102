"""Turns episodes into the padded tensors of one trainer step. Plain PyTorch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from forge_rl.core.columns import BatchColumns, batch_columns
from forge_rl.routing import batch_routing
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
    advantages_NL: torch.Tensor
    """[N, L] float32 advantage of each generated token (0 elsewhere): the completion's group
    advantage, plus its process and dense rewards when it has any (`forge_rl.core.advantages.token_advantages`)."""
    generator_N: torch.Tensor | None = None
    """[N] int64 index of the generator that sampled each completion (-1: unknown)."""
    exact_version_NL: torch.Tensor | None = None
    """[N, L] int64: at each generated token, the oldest policy version whose weights computed it
    or any KV it attended to (-1 elsewhere), as `forge_rl.core.columns.exact_versions`. Where it equals the trainer's
    version, the trainer holds every weight that sampled the token: the two logprobs differ by
    numerics alone (the fresh mismatch, `forge_rl.observability.health`)."""
    temperature_N: torch.Tensor | None = None
    """[N] float32 temperature each completion was sampled at; None means 1. The trainer divides
    its logits by it so that its logprobs describe the distribution the generator sampled from."""
    support_NLK: torch.Tensor | None = None
    """At each generated token, the ids top-k/top-p kept when it was sampled, in whichever of two
    encodings is smaller for the batch (`kept_sets`): int32 ids padded with -1 (K = the largest
    kept set), or a uint8 bitmask (id v is bit v % 8 of byte v // 8; K = bytes up to the largest id).
    Empty (all -1, all 0) where nothing was filtered; None when no completion of the batch was
    filtered. See `token_logprobs`."""
    reference_logprobs_NL: torch.Tensor | None = None
    """[N, L] float32 logprob of each token under the frozen reference model, for the KL penalty
    (`LossConfig.kl_beta` > 0); None when no reference model runs."""
    lengths_N: torch.Tensor | None = None
    """[N] int64 real tokens (prompt + completion) of each row, the rest is padding; None means
    every row is L long. The trainer's forward layout (`forge_rl.training.packing`) reads it."""
    routed_experts_NLXK: torch.Tensor | None = None
    """[N, L, X, K] uint8/int16 Keep Routing records (`forge_rl.routing`): at each generated token,
    the experts of each of the X MoE layers its sampling pass used (0 where `routed_NL` is False);
    None when no completion of the batch has a record."""
    routed_NL: torch.Tensor | None = None
    """[N, L] bool, True where `routed_experts_NLXK` holds a record (None with it)."""

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

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rows of data-parallel rank `rank` (contiguous blocks). A batch whose rows do not split
        evenly (a multi-agent group holds as many rows as it had agents) is first filled up with
        fully masked rows (`with_masked_rows`), which reach no loss and no token count."""
        batch = self.with_masked_rows(-self.input_ids_NL.shape[0] % world_size)
        per_rank = batch.input_ids_NL.shape[0] // world_size
        rank_rows = slice(rank * per_rank, (rank + 1) * per_rank)
        # Every field is a tensor (or None) whose first dimension is the row.
        return TrainBatch(
            **{
                f.name: None if (value := getattr(batch, f.name)) is None else value[rank_rows]
                for f in dataclasses.fields(batch)
            }
        )

    def with_masked_rows(self, count: int) -> TrainBatch:
        """This batch and `count` more rows: copies of its shortest row (the least compute) with
        nothing in the loss."""
        if count == 0:
            return self
        shortest = min(range(len(self.row_lengths)), key=self.row_lengths.__getitem__)
        extra = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                copies = value[shortest : shortest + 1].repeat_interleave(count, dim=0)
                extra[f.name] = torch.cat([value, torch.zeros_like(copies) if f.name == "loss_mask_NL" else copies])
            else:
                extra[f.name] = None
        return TrainBatch(**extra)


def make_train_batch(
    episodes: list[Episode],
    pad_id: int,
    normalize_advantage_std: bool = True,
    step_discount: float = 1.0,
    local_weight: float = 1.0,
) -> TrainBatch:
    """One row per completion (`forge_rl.core.columns.batch_columns`, which says what reaches the loss),
    padded (`pad_columns`): both halves in this process. A run's trainer gets its batches as
    columns built in the rollouts' process and pads them only."""
    return pad_columns(batch_columns(episodes, normalize_advantage_std, step_discount, local_weight), pad_id)


def pad_columns(columns: BatchColumns, pad_id: int) -> TrainBatch:
    """The TrainBatch of `columns`: each flat column becomes [N, L] (L the longest row), rows
    right-padded with `pad_id`, False, 0 or -1. Tensors straight from the columns' buffers
    (`torch.frombuffer`), so no Python walk over the tokens here."""
    lengths_N = torch.frombuffer(columns.lengths, dtype=torch.int64).clone()
    rows, length = columns.num_rows, int(lengths_N.max())
    real_NL = torch.arange(length).unsqueeze(0) < lengths_N.unsqueeze(1)

    def pad(flat, fill, dtype: torch.dtype) -> torch.Tensor:
        padded = torch.full((rows, length), fill, dtype=dtype)
        if len(flat):  # frombuffer refuses an empty buffer
            padded[real_NL] = torch.frombuffer(flat, dtype=dtype)
        return padded

    row_lengths = columns.lengths.tolist()
    support_NLK = None
    if columns.supports is not None:
        support_NLK = kept_sets([[[]] * n if s is None else s for s, n in zip(columns.supports, row_lengths)], length)
    routing = None
    if columns.routings is not None:
        assert columns.generated is not None  # set with routings (BatchColumns.generated)
        routing = batch_routing(
            columns.routings, [[False] * n if g is None else g for g, n in zip(columns.generated, row_lengths)], length
        )

    return TrainBatch(
        input_ids_NL=pad(columns.token_ids, pad_id, torch.int64),
        loss_mask_NL=pad(columns.loss_mask, False, torch.bool),
        behaviour_logprobs_NL=pad(columns.behaviour_logprobs, 0.0, torch.float32),
        advantages_NL=pad(columns.advantages, 0.0, torch.float32),
        generator_N=torch.frombuffer(columns.generators, dtype=torch.int64).clone(),
        exact_version_NL=pad(columns.exact_versions, -1, torch.int64),
        temperature_N=torch.frombuffer(columns.temperatures, dtype=torch.float32).clone(),
        support_NLK=support_NLK,
        reference_logprobs_NL=None
        if columns.reference_logprobs is None
        else pad(columns.reference_logprobs, 0.0, torch.float32),
        lengths_N=lengths_N,
        routed_experts_NLXK=None if routing is None else routing[0],
        routed_NL=None if routing is None else routing[1],
    )


def kept_sets(supports: list[list[list[int]]], length: int) -> torch.Tensor | None:
    """[N, L, K] kept sets of `supports` (per row, per position, the kept ids; [] where nothing was
    filtered), as int32 ids padded with -1 or as a uint8 bitmask, whichever takes fewer bytes; None
    when no position has a kept set.

    Why two: a dense id list costs 4 bytes times the batch's largest kept set at every position,
    and top-p alone keeps thousands of ids where the model is unsure (one such token sizes the
    whole batch), while the bitmask costs vocabulary / 8 bytes per position whatever the set.
    Small sets (top-k, peaked distributions) are cheaper as ids.
    """
    width = max((len(ids) for row in supports for ids in row), default=0)
    if width == 0:
        return None
    num_bytes = max(max(ids) for row in supports for ids in row if ids) // 8 + 1
    if num_bytes >= 4 * width:
        support_NLK = torch.full((len(supports), length, width), -1, dtype=torch.int32)
        for n, row in enumerate(supports):
            for position, ids in enumerate(row):
                if ids:
                    support_NLK[n, position, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return support_NLK
    bits_NLK = torch.zeros((len(supports), length, num_bytes), dtype=torch.uint8)
    bit_values = 1 << torch.arange(8, dtype=torch.int32)
    for n, row in enumerate(supports):
        kept_LV = torch.zeros((length, num_bytes * 8), dtype=torch.bool)  # one row at a time
        for position, ids in enumerate(row):
            if ids:
                kept_LV[position, ids] = True
        bits_NLK[n] = (kept_LV.view(length, num_bytes, 8) * bit_values).sum(-1).to(torch.uint8)
    return bits_NLK


def empty_kept_set(support_NLK: torch.Tensor) -> int:
    """The fill of a position with no kept set in `support_NLK`'s encoding (see `kept_sets`)."""
    return 0 if support_NLK.dtype == torch.uint8 else -1


def _unpack_kept(bits_NLK: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L, V] bool from a `kept_sets` bitmask (ids past its last byte are not kept)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits_NLK.device)
    kept_NLV = ((bits_NLK.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)
    if kept_NLV.shape[-1] >= vocab_size:
        return kept_NLV[..., :vocab_size]
    return torch.nn.functional.pad(kept_NLV, (0, vocab_size - kept_NLV.shape[-1]), value=False)


_NOT_KEPT = -1e30


def token_logprobs(
    logits_NLV: torch.Tensor,
    input_ids_NL: torch.Tensor,
    temperature_NL: torch.Tensor | None = None,
    support_NLK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logprob of each token given its prefix, aligned to the token: [N, L] (position 0 gets 0).

    Row r's position t predicts its token t + 1 (`predicted_logprobs` on the shifted rows);
    `temperature_NL` is per token (its sequence's temperature; rows may pack several sequences).
    """
    logprobs_NL = predicted_logprobs(
        logits_NLV[:, :-1],
        input_ids_NL[:, 1:],
        None if temperature_NL is None else temperature_NL[:, 1:],
        None if support_NLK is None else support_NLK[:, 1:],
    )
    return torch.nn.functional.pad(logprobs_NL, (1, 0), value=0.0)


def predicted_logprobs(
    logits_XV: torch.Tensor,
    targets_X: torch.Tensor,
    temperature_X: torch.Tensor | None = None,
    support_XK: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logprob of `targets_X` under the distributions whose logits are `logits_XV` (any
    leading shape X: the rows' positions, or the prediction slots of a prefix tree).

    The distribution the generator sampled from: softmax(logits / temperature), restricted to the
    target's kept set where `support_XK` has one (top-k/top-p) and renormalized over it. Without
    the restriction every filtered token would look less likely to the trainer than it was to the
    generator (by the mass top-p cut off), and every importance ratio would be biased below 1.
    """
    scaled_XV = logits_XV.float()
    if temperature_X is not None:
        scaled_XV = scaled_XV / temperature_X[..., None].to(scaled_XV.device)
    picked_X = scaled_XV.gather(-1, targets_X.to(scaled_XV.device).unsqueeze(-1)).squeeze(-1)
    log_normalizer_X = torch.logsumexp(scaled_XV, dim=-1)
    if support_XK is not None:
        support_XK = support_XK.to(scaled_XV.device)
        # A large finite fill, not -inf: a position with no kept set would get logsumexp(-inf...)
        # = -inf, whose gradient is NaN, and torch.where passes NaN * 0 = NaN to the unused branch.
        if support_XK.dtype == torch.uint8:  # bitmask (see `kept_sets`)
            kept_XV = _unpack_kept(support_XK, scaled_XV.shape[-1])
            filtered_X = kept_XV.any(-1)
            kept_logits = scaled_XV.masked_fill(~kept_XV, _NOT_KEPT)
        else:  # ids padded with -1
            kept_XK = support_XK >= 0
            filtered_X = kept_XK.any(-1)
            kept_logits = scaled_XV.gather(-1, support_XK.long().clamp(min=0)).masked_fill(~kept_XK, _NOT_KEPT)
        log_normalizer_X = torch.where(filtered_X, torch.logsumexp(kept_logits, dim=-1), log_normalizer_X)
    return picked_X - log_normalizer_X


@torch.no_grad()
def token_entropy(logits_NLV: torch.Tensor, temperature_NL: torch.Tensor | None = None) -> torch.Tensor:
    """[N, L] entropy (nats) of the policy's next-token distribution softmax(logits / temperature)
    over the whole vocabulary, aligned like `token_logprobs` (position 0 gets 0). A metric, never a
    loss: computed without gradient. Entropy collapsing toward 0 early is the usual sign of a run
    that stopped exploring."""
    entropy_NL = predicted_entropy(logits_NLV[:, :-1], None if temperature_NL is None else temperature_NL[:, 1:])
    return torch.nn.functional.pad(entropy_NL, (1, 0), value=0.0)


@torch.no_grad()
def predicted_entropy(logits_XV: torch.Tensor, temperature_X: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) over the whole vocabulary, any leading shape X."""
    scaled_XV = logits_XV.float()
    if temperature_X is not None:
        scaled_XV = scaled_XV / temperature_X[..., None].to(scaled_XV.device)
    log_p_XV = torch.log_softmax(scaled_XV, dim=-1)
    return -(log_p_XV.exp() * log_p_XV).sum(-1)
