"""Keep Routing (routing replay): the expert routing a MoE policy used when it sampled each token,
recorded by the generator, carried with the episode, and enforced in the trainer's forward.

Why: a mixture-of-experts layer picks its top-k experts per token from the router's scores, and
the trainer recomputing those scores (other kernels, other numerics, and in asynchronous RL other
weights) often picks different experts than the generator did. The trainer then differentiates a
different function from the one that sampled, and importance ratios get noisy. Replaying the
recorded experts makes the trainer's routing the sampler's; the gate weights are still recomputed
by the trainer's router (softmax over all experts, then renormalized over the recorded set, as
TorchTitan's router does over its own top-k), so the router keeps its gradient.

Which routing belongs to a generated token. The distribution a token is sampled from comes out of
the forward pass at the position before it; that pass's routing (every MoE layer, at that
position) is the token's record. So for a completion token at sequence position p the record
describes position p-1: the last prompt token's routing (computed in the prefill) for the first
generated token, and the previous generated token's (a decode step) for the others. The other
positions (the prompt but its last token, a trajectory's context) have no record and route
normally: they are the same tokens on both sides, so only numerics (not
sampling) can split their routing, and a record of every prompt token would cost as much again.

Layout: `RoutingRecord.expert_ids_GXK` is [G, X, K] for the G generated tokens of a completion (in
order, context tokens of a trajectory skipped), X MoE layers, K experts per token (top-k), as the
smallest integer type that holds the expert count (uint8 up to 256 experts, int16 beyond): X * K
bytes per token for Qwen3-30B-A3B's 48 layers x top-8 of 128 experts is 384 bytes, against 8 bytes
for its token id, logprob and version together. In a `TrainBatch` the records sit at their tokens'
positions (`routed_experts_NLXK`, `routed_NL`) like behaviour logprobs; the forward shifts them one
position back (`forge_rl.training.packing.layout_token_logprobs`).

Worked example (2 MoE layers, top-2 of 8 experts, prompt of 3 tokens, completion of 2):

    Completion(token_ids=[9, 2], ..., routed_experts=RoutingRecord(expert_ids_GXK=tensor(
        [[[1, 5], [0, 7]],      # token 9: layer 0 used experts {1, 5} at prompt position 2, layer 1 {0, 7}
         [[3, 5], [7, 2]]],     # token 2 (EOS): the routing at position 3 (token 9's)
        dtype=torch.uint8)))

No TorchTitan and no vLLM here, and torch only inside functions (`forge_rl.types` imports this
module, and environments import types without torch): the trainer's router (`forge_rl.models.moe`) and the generator's
capture hook (`forge_rl.engines.routing_capture`) call into it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type holding expert ids 0..num_experts-1."""
    import torch

    if 1 <= num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"num_experts ({num_experts}) must be in 1..32768 to record routing as uint8/int16")


@dataclass(frozen=True)
class RoutingRecord:
    """The experts each generated token of a completion was routed to at sampling time."""

    expert_ids_GXK: torch.Tensor
    """[G, X, K] expert ids (uint8 or int16, see `expert_id_dtype`): generated token, MoE layer,
    rank among the token's top-k (the order within K carries no meaning)."""

    def __post_init__(self) -> None:
        import torch

        ids = self.expert_ids_GXK
        if ids.dim() != 3 or ids.dtype not in (torch.uint8, torch.int16):
            raise ValueError(
                f"RoutingRecord.expert_ids_GXK must be a [tokens, layers, top_k] uint8 or int16 tensor, "
                f"got shape {tuple(ids.shape)} dtype {ids.dtype}"
            )

    @property
    def num_tokens(self) -> int:
        return self.expert_ids_GXK.shape[0]

    @property
    def num_layers(self) -> int:
        return self.expert_ids_GXK.shape[1]

    @property
    def top_k(self) -> int:
        return self.expert_ids_GXK.shape[2]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.top_k * self.expert_ids_GXK.element_size()

    def to_dict(self) -> dict:
        """JSON-ready form (checkpoints hold episodes as JSON): shape, dtype, base64 bytes."""
        ids = self.expert_ids_GXK.contiguous()
        return {
            "shape": list(ids.shape),
            "dtype": str(ids.dtype).removeprefix("torch."),
            "data": base64.b64encode(ids.numpy().tobytes()).decode("ascii"),
        }

    @classmethod
    def from_dict(cls, data: dict) -> RoutingRecord:
        import torch

        raw = bytearray(base64.b64decode(data["data"]))
        dtype = getattr(torch, data["dtype"])
        ids = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return cls(ids.reshape(data["shape"]))

    @classmethod
    def concat(cls, records: list[RoutingRecord]) -> RoutingRecord:
        """The records of consecutive pieces (turns, or a request resumed after an abort) as one."""
        import torch

        return cls(torch.cat([r.expert_ids_GXK for r in records]))


@dataclass(frozen=True)
class RoutingShape:
    """What a model's routing record must look like."""

    num_layers: int
    """MoE layers, in model order."""
    top_k: int
    """Experts per token in each layer."""
    num_experts: int
    """Routed experts per layer; recorded ids lie in 0..num_experts-1."""

    def check(self, expert_ids_XK_last: torch.Tensor, where: str) -> None:
        """ValueError naming the mismatch unless `expert_ids` ([..., X, K]) fits this model."""
        layers, top_k = expert_ids_XK_last.shape[-2:]
        if (layers, top_k) != (self.num_layers, self.top_k):
            raise ValueError(
                f"{where}: the routing record has {layers} MoE layers x top-{top_k} experts per token, but the "
                f"model has {self.num_layers} MoE layers x top-{self.top_k}. The record was sampled by another "
                "model (check generator and trainer load the same checkpoint), or switch Keep Routing off "
                "(--trainer.no-keep-routing)."
            )
        if expert_ids_XK_last.numel() and int(expert_ids_XK_last.max()) >= self.num_experts:
            raise ValueError(
                f"{where}: the routing record names expert {int(expert_ids_XK_last.max())}, but the model has "
                f"{self.num_experts} experts per layer (ids 0..{self.num_experts - 1})."
            )
        if expert_ids_XK_last.numel() and int(expert_ids_XK_last.min()) < 0:
            raise ValueError(
                f"{where}: the routing record holds a negative expert id ({int(expert_ids_XK_last.min())})."
            )


def batch_routing(
    records: list[RoutingRecord | None], generated: list[list[bool]], length: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([N, L, X, K] expert ids, [N, L] bool "has a record") of a batch's rows; None when no row has
    a record. Row n's record fills its generated positions in order (`generated[n]`, [L_n] over
    the row's tokens, prompt included); a row without a record routes normally everywhere."""
    import torch

    present = [r for r in records if r is not None]
    if not present:
        return None
    shapes = {(r.num_layers, r.top_k, r.expert_ids_GXK.dtype) for r in present}
    if len(shapes) > 1:
        raise ValueError(f"routing records of one batch disagree in (layers, top_k, dtype): {sorted(map(str, shapes))}")
    num_layers, top_k, dtype = shapes.pop()
    ids_NLXK = torch.zeros((len(records), length, num_layers, top_k), dtype=dtype)
    routed_NL = torch.zeros((len(records), length), dtype=torch.bool)
    for n, (record, mask) in enumerate(zip(records, generated)):
        if record is None:
            continue
        positions = torch.tensor(mask, dtype=torch.bool).nonzero().flatten()
        if len(positions) != record.num_tokens:
            raise ValueError(
                f"row {n}: routing record of {record.num_tokens} tokens for {len(positions)} generated tokens"
            )
        ids_NLXK[n, positions] = record.expert_ids_GXK
        routed_NL[n, positions] = True
    return ids_NLXK, routed_NL


def replay_topk(
    scores_BLE: torch.Tensor,
    expert_ids_BLK: torch.Tensor,
    topk_scores_BLK: torch.Tensor,
    replay_ids_BLK: torch.Tensor,
    replay_mask_BL: torch.Tensor,
    route_norm: bool,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights [B, L, K], expert ids [B, L, K]) with the recorded experts where
    `replay_mask_BL` is True and the router's own choice elsewhere.

    `scores_BLE` are the router's scores over all experts (softmax or sigmoid of the gate); the gate
    weights of replayed tokens are those scores at the recorded experts, normalized over them when
    `route_norm` (for softmax scores that is the softmax over the recorded experts' logits), times
    `route_scale`: the same formula the router applies to its own top-k, so a token whose recorded
    experts are the router's own gets exactly the router's weights.
    """
    import torch

    mask_BL1 = replay_mask_BL.unsqueeze(-1)
    ids_BLK = torch.where(mask_BL1, replay_ids_BLK.long(), expert_ids_BLK)
    picked_BLK = scores_BLE.gather(-1, ids_BLK)
    if route_norm:
        picked_BLK = picked_BLK / (picked_BLK.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.where(mask_BL1, picked_BLK * route_scale, topk_scores_BLK), ids_BLK


def routing_differs_NL(a_NLXK: torch.Tensor, b_NLXK: torch.Tensor) -> torch.Tensor:
    """[N, L] True where the two routings choose a different expert set in any layer (order within
    the top-k ignored)."""
    return (a_NLXK.long().sort(-1).values != b_NLXK.long().sort(-1).values).flatten(-2).any(-1)


def keep_routing_metrics(batch) -> dict[str, float]:
    """Batch-wide Keep Routing coverage of a `TrainBatch`: completions with generated tokens but no
    record (they fell back to the trainer's own routing) and the fraction of generated tokens with one."""
    generated_N = batch.loss_mask_NL.any(-1)
    if batch.routed_NL is None:
        return {
            "keep_routing/completions_without_record": float(generated_N.sum()),
            "keep_routing/routed_token_fraction": 0.0,
        }
    recorded_N = batch.routed_NL.any(-1)
    routed = (batch.routed_NL & batch.loss_mask_NL).sum()
    return {
        "keep_routing/completions_without_record": float((generated_N & ~recorded_N).sum()),
        "keep_routing/routed_token_fraction": float(routed) / max(float(batch.loss_mask_NL.sum()), 1.0),
    }
