"""The mixture-of-experts layers of the Qwen3-MoE family (families.QWEN3_MOE) as TorchTitan modules.

TorchTitan's own MoE (torchtitan/models/common/moe.py) is used as is, with two parts swapped:

- `ReplayRouter`: TorchTitan's top-k router plus Keep Routing (`forge_rl.routing`). While a
  replay is set (`routing_replay`), tokens with a record use the recorded experts, their gate
  weights recomputed from the router's scores; the others route normally. It also keeps the
  experts it used last (`last_expert_ids_BLK`), which the trainer compares with the records.
- `ExactGroupedExperts`: TorchTitan's grouped experts compute in bf16 whatever the weights' dtype
  (its GPU kernels want it); these compute in the activations' dtype, so an fp32 trainer matches
  an fp32 vLLM generator (and under bf16 mixed precision the activations are bf16 anyway).

`ReplayingFullAC` is TorchTitan's full activation checkpointing with the replay carried into the
recomputation: the backward pass recomputes each block after the forward's `routing_replay` has
exited (possibly while another micro-batch's replay is set), so each checkpointed block captures
its routers' replay when its forward runs and sets it back while it is recomputed.

Imports TorchTitan: only the trainer processes (through families.build_model_config) import this.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, TokenChoiceTopKRouter

from forge_rl.routing import RoutingShape, replay_topk, routing_differs_NL


class ReplayRouter(TokenChoiceTopKRouter):
    """TorchTitan's token-choice top-k router that can replay recorded experts."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.replay: tuple[torch.Tensor, torch.Tensor] | None = None
        """(recorded expert ids [B, L, K], [B, L] bool: has a record) for the next forward passes."""
        self.last_expert_ids_BLK: torch.Tensor | None = None
        """The experts the last forward pass used (detached)."""
        self.num_replayed = 0
        """Tokens replayed since `take_replay_counts`."""
        self.num_overridden = 0
        """Of those, tokens whose own top-k the record replaced by another expert set."""
        self.recomputing = False
        """Activation checkpointing is recomputing this router's forward (`ReplayingFullAC`): the
        forward already counted its tokens and kept its experts."""

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        topk_scores_BLK, expert_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        if self.replay is not None:
            topk_scores_BLK, expert_ids_BLK = self._replayed(topk_scores_BLK, expert_ids_BLK, scores_BLE)
        if not self.recomputing:
            self.last_expert_ids_BLK = expert_ids_BLK.detach()
        return topk_scores_BLK, expert_ids_BLK, scores_BLE

    def _replayed(self, topk_scores_BLK, expert_ids_BLK, scores_BLE):
        """The router's outputs with the replay applied. Under tensor parallelism they are DTensors,
        Replicate over the TP ranks, or Shard(1) (this rank's slice of the positions) when EP
        sequence-shards the MoE input: the replay is applied to the local tensors, with the record
        cut the same way, and the result put back in the same layout (differentiably)."""
        replay_ids_BLK, replay_mask_BL = self.replay
        layout = None
        if isinstance(expert_ids_BLK, DTensor):
            layout = expert_ids_BLK.device_mesh, expert_ids_BLK.placements
            replay_ids_BLK, replay_mask_BL = (_local_part(t, *layout) for t in (replay_ids_BLK, replay_mask_BL))
            topk_scores_BLK, expert_ids_BLK, scores_BLE = (
                t.to_local() for t in (topk_scores_BLK, expert_ids_BLK, scores_BLE)
            )
        if replay_ids_BLK.shape != expert_ids_BLK.shape:
            raise ValueError(
                f"routing replay of shape {tuple(replay_ids_BLK.shape)} for a forward of {tuple(expert_ids_BLK.shape)} "
                "(rows, positions, top_k)"
            )
        own_ids_BLK = expert_ids_BLK
        replay_mask_BL = replay_mask_BL.to(expert_ids_BLK.device)
        topk_scores_BLK, expert_ids_BLK = replay_topk(
            scores_BLE,
            own_ids_BLK,
            topk_scores_BLK,
            replay_ids_BLK.to(own_ids_BLK.device),
            replay_mask_BL,
            self.route_norm,
            self.route_scale,
        )
        if not self.recomputing:
            with torch.no_grad():
                differs_BL = routing_differs_NL(own_ids_BLK.unsqueeze(-2), expert_ids_BLK.unsqueeze(-2))
                self.num_replayed += int(replay_mask_BL.sum())
                self.num_overridden += int((differs_BL & replay_mask_BL).sum())
        if layout is not None:
            topk_scores_BLK, expert_ids_BLK = (
                DTensor.from_local(t, *layout, run_check=False) for t in (topk_scores_BLK, expert_ids_BLK)
            )
        return topk_scores_BLK, expert_ids_BLK


def _local_part(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's part of `full` (the same on every rank) under `placements` over `mesh`: Shard(d)
    keeps the rank's chunk of dim d (torch.chunk's split, as DTensor's), Replicate all of it."""
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            chunks = torch.chunk(full, mesh.size(mesh_dim), dim=placement.dim)
            full = chunks[mesh.get_local_rank(mesh_dim)]
        elif not placement.is_replicate():
            raise ValueError(f"routing replay cannot follow a router output placed as {placement}")
    return full


class ExactGroupedExperts(GroupedExperts):
    """TorchTitan's grouped SwiGLU experts, computed in the activations' dtype instead of bf16."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        # Under FSDP2/TP/EP the weights are DTensors; the grouped matmul takes this rank's shard.
        w1_EFD, w2_EDF, w3_EFD = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        dtype = x_RD.dtype
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1_EFD.to(dtype).transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3_EFD.to(dtype).transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=w2_EDF.to(dtype).transpose(-2, -1), offs=offsets_E)


def _num_experts(hf_config: dict) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    return hf_config.get("num_experts") or hf_config["num_local_experts"]


def routing_shape(hf_config: dict) -> RoutingShape:
    """The routing record a Qwen3-MoE config.json's model produces (every layer is MoE)."""
    return RoutingShape(
        num_layers=hf_config["num_hidden_layers"],
        top_k=hf_config["num_experts_per_tok"],
        num_experts=_num_experts(hf_config),
    )


def moe_config(hf_config: dict) -> MoE.Config:
    """One layer's MoE config from a Qwen3-MoE config.json: HF's Qwen3MoeSparseMoeBlock is softmax
    over the router logits, top-k, renormalized over the k when norm_topk_prob; no shared expert
    and no load-balancing bias (HF has none: the bias would be a weight the checkpoint lacks)."""
    dim, num_experts, top_k = hf_config["hidden_size"], _num_experts(hf_config), hf_config["num_experts_per_tok"]
    routed = make_routed_experts_config(
        dim=dim,
        hidden_dim=hf_config["moe_intermediate_size"],
        num_experts=num_experts,
        top_k=top_k,
        param_init={},
        comm_backend="standard",
    )
    routed.inner_experts = ExactGroupedExperts.Config(
        **{name: getattr(routed.inner_experts, name) for name in ("dim", "hidden_dim", "num_experts", "param_init")}
    )
    router = ReplayRouter.Config(
        num_experts=num_experts,
        gate=Linear.Config(in_features=dim, out_features=num_experts, bias=False, param_init={}),
        top_k=top_k,
        score_func="softmax",
        route_norm=bool(hf_config.get("norm_topk_prob", False)),
    )
    return make_moe_config(num_experts=num_experts, router=router, routed_experts=routed, load_balance_coeff=None)


def replay_routers(model) -> list[ReplayRouter]:
    """The model's routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, ReplayRouter)]


@contextlib.contextmanager
def routing_replay(model, expert_ids_BLXK: torch.Tensor, replay_mask_BL: torch.Tensor) -> Iterator[None]:
    """Forward passes inside replay the recorded experts ([B, L, X, K], X = the model's MoE layers in
    order) where `replay_mask_BL` is True. Under activation checkpointing the recomputation in the
    backward pass runs after this has exited: `ReplayingFullAC` carries the replay there."""
    routers = replay_routers(model)
    if expert_ids_BLXK.shape[2] != len(routers):
        raise ValueError(f"routing replay for {expert_ids_BLXK.shape[2]} MoE layers on a model with {len(routers)}")
    for layer, router in enumerate(routers):
        router.replay = (expert_ids_BLXK[:, :, layer], replay_mask_BL)
    try:
        yield
    finally:
        for router in routers:
            router.replay = None


class ReplayingFullAC(FullAC):
    """TorchTitan's full activation checkpointing (each transformer block recomputed in the
    backward pass), with each block's routers given back, for the recomputation, the replay they
    had in its forward pass (module docstring). Without replay it is FullAC."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        pass

    def _wrap_block(self, module: torch.nn.Module, *, base_fqn: str | None = None) -> torch.nn.Module:
        return checkpoint_wrapper(
            module,
            preserve_rng_state=self.config.preserve_rng_state,
            determinism_check=self.config.determinism_check,
            early_stop=False,
            debug=self.config.debug,
            context_fn=functools.partial(_replay_contexts, replay_routers(module)),
        )


def _replay_contexts(
    routers: Sequence[ReplayRouter],
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's context_fn, called as the block's forward starts: (nothing around
    the forward, the recomputation with the replay the routers hold now)."""
    return contextlib.nullcontext(), _recomputing(routers, [router.replay for router in routers])


@contextlib.contextmanager
def _recomputing(routers: Sequence[ReplayRouter], replays: list) -> Iterator[None]:
    before = [(router.replay, router.recomputing) for router in routers]
    for router, replay in zip(routers, replays):
        router.replay, router.recomputing = replay, True
    try:
        yield
    finally:
        for router, (replay, recomputing) in zip(routers, before):
            router.replay, router.recomputing = replay, recomputing


def take_replay_counts(model) -> tuple[int, int]:
    """(token-layer pairs replayed, of which the router alone would have chosen other experts)
    since the last call, over every MoE layer; the counters restart at 0."""
    routers = replay_routers(model)
    counts = sum(r.num_replayed for r in routers), sum(r.num_overridden for r in routers)
    for router in routers:
        router.num_replayed = router.num_overridden = 0
    return counts


def last_routing(model) -> torch.Tensor:
    """[B, L, X, K] the experts every MoE layer used in the model's last forward pass."""
    return torch.stack([router.last_expert_ids_BLK for router in replay_routers(model)], dim=2)
