"""Off-policy corrections against the generator's recorded behaviour logprobs. Plain PyTorch.

Every function here takes the per-token log ratio log_ratio_NL = logprobs - behaviour_logprobs,
detached (these are weights and masks, never gradient paths; `policy.py` says exactly which ratio
each correction sees and why it is not identically 1). Shapes: N completions, L positions.
"""

from __future__ import annotations

import math

import torch

from forge_rl.training.losses.config import Correction


def sequence_mean_N(values_NL: torch.Tensor, mask_NL: torch.Tensor) -> torch.Tensor:
    """[N] mean of each row's values over its masked-in positions; 0 for a row with none."""
    total_N = torch.where(mask_NL, values_NL, 0.0).sum(-1)
    return total_N / mask_NL.sum(-1).clamp(min=1)


def token_keep_mask_NL(log_ratio_NL: torch.Tensor, correction: Correction, is_cap: float) -> torch.Tensor:
    """[N, L] masked IS (mis): keep a token only if its ratio lies in [1/is_cap, is_cap], i.e.
    |log ratio| <= log(is_cap). All True for the other corrections."""
    if correction != "mis":
        return torch.ones_like(log_ratio_NL, dtype=torch.bool)
    return log_ratio_NL.abs() <= math.log(is_cap)


def sequence_keep_mask_N(
    log_ratio_NL: torch.Tensor, loss_mask_NL: torch.Tensor, seq_mask_geo_mean: float | None
) -> torch.Tensor:
    """[N] geometric-mean masking: keep a sequence only if exp(mean log ratio over its loss tokens)
    lies in [1/x, x]. Unlike a product of token ratios, the geometric mean does not grow with
    length, so one threshold fits short and long completions. All True when x is None."""
    if seq_mask_geo_mean is None:
        return torch.ones(log_ratio_NL.shape[0], dtype=torch.bool, device=log_ratio_NL.device)
    return sequence_mean_N(log_ratio_NL, loss_mask_NL).abs() <= math.log(seq_mask_geo_mean)


def tis_factor_NL(importance_weight_NL: torch.Tensor, is_cap: float) -> torch.Tensor:
    """[N, L] truncated IS: the detached factor min(1, is_cap / w) that turns a loss whose gradient
    carries the importance weight w into one whose gradient carries min(w, is_cap). Multiplying by
    min(w, is_cap) instead would weight tokens by w * min(w, is_cap), counting the ratio twice.
    w = 0 gives a factor of 1 (is_cap / 0 = inf)."""
    return (is_cap / importance_weight_NL.detach()).clamp(max=1.0)


def k3_kl_NL(log_ratio_NL: torch.Tensor) -> torch.Tensor:
    """[N, L] Schulman's k3 estimator exp(x) - 1 - x of KL(q || p) per token, for x = log(p/q) on a
    token sampled from q: unbiased and >= 0. With p = trainer, q = behaviour it is the
    trainer/generator mismatch KL."""
    return torch.exp(log_ratio_NL) - 1.0 - log_ratio_NL
