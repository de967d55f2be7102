"""Causal attention that may be restricted to documents: TorchTitan's SDPA with an optional mask.

TorchTitan 0.3.0 attends within packed documents only through FlexAttention (compiled; no
backward on CPU) or varlen attention (no CPU kernel), and its `ScaledDotProductAttention` refuses
masks. This inner attention takes, as `attention_masks`, either None (plain causal attention,
exactly TorchTitan's SDPA) or a boolean [B, 1, L, L] mask from `forge_rl.training.packing.document_mask`
(True where query q may attend to key k: same document and k <= q), and hands it to
`F.scaled_dot_product_attention`, which has a CPU kernel and backward for boolean masks.

Imported only when a model is built (it subclasses TorchTitan's Module, and importing TorchTitan
is slow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.protocols.module import Module


class DocumentCausalSDPA(Module):
    """Shapes: B batch rows, L positions, N heads, H head dim (TorchTitan's legend)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        q_BNLH, k_BNLH, v_BNLH = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        if attention_masks is None:
            out_BNLH = F.scaled_dot_product_attention(
                q_BNLH, k_BNLH, v_BNLH, scale=scale, is_causal=True, enable_gqa=enable_gqa
            )
        else:
            mask_B1LL = attention_masks.to(q_BNLH.device)
            out_BNLH = F.scaled_dot_product_attention(
                q_BNLH, k_BNLH, v_BNLH, attn_mask=mask_B1LL, scale=scale, enable_gqa=enable_gqa
            )
        return out_BNLH.transpose(1, 2)
