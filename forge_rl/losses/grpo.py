"""The GRPO clipped surrogate against the generator's recorded behaviour logprobs.

Shapes: N completions (rows), L positions. `_NL` tensors are per token; `_N` per completion.

The ratio is exp(logprobs - behaviour_logprobs), where behaviour_logprobs are what the generator
sampled with (possibly an older policy version). A ratio taken against a detached copy of the
trainer's own logprobs is identically 1 and corrects nothing; `tests/unit/test_losses.py` guards
against that bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOLossConfig:
    clip_eps_low: float = 0.2
    """Lower clip of the policy ratio: ratios below 1 - clip_eps_low get no further push."""
    clip_eps_high: float = 0.2
    """Upper clip: ratios above 1 + clip_eps_high get no further push (DAPO's clip-higher raises it)."""

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)
            if not 0.0 < value < 10.0:
                raise ValueError(
                    f"trainer.loss.{name} ({value}) must be in (0, 10). "
                    f"Set --trainer.loss.{name.replace('_', '-')}."
                )


def grpo_loss(
    logprobs_NL: torch.Tensor,
    behaviour_logprobs_NL: torch.Tensor,
    advantages_N: torch.Tensor,
    loss_mask_NL: torch.Tensor,
    config: GRPOLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level mean of the clipped surrogate over generated tokens.

    Returns the scalar loss (differentiable through `logprobs_NL`) and detached metrics.
    """
    mask = loss_mask_NL.to(logprobs_NL.dtype)
    # Masked-out positions carry arbitrary values (even NaN, and NaN * 0 is NaN): select, don't
    # multiply, so nothing there can reach the loss or overflow exp.
    log_ratio_NL = torch.where(loss_mask_NL, logprobs_NL - behaviour_logprobs_NL, 0.0)
    ratio_NL = torch.exp(log_ratio_NL)
    advantages_NL = advantages_N.unsqueeze(-1)
    unclipped = ratio_NL * advantages_NL
    clipped = ratio_NL.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * advantages_NL
    per_token_loss_NL = -torch.minimum(unclipped, clipped)
    num_tokens = mask.sum().clamp(min=1.0)
    loss = (per_token_loss_NL * mask).sum() / num_tokens
    with torch.no_grad():
        clipped_frac = ((clipped < unclipped).to(mask.dtype) * mask).sum() / num_tokens
        mean_ratio = (ratio_NL * mask).sum() / num_tokens
        # k3 estimator of KL(behaviour || current) from tokens sampled by the behaviour policy:
        # r - 1 - log r with r = current / behaviour; unbiased and >= 0.
        mismatch_kl = ((ratio_NL - 1 - log_ratio_NL) * mask).sum() / num_tokens
        max_abs_log_ratio = log_ratio_NL.abs().max()
    metrics = {
        "loss/clip_fraction": clipped_frac.item(),
        "loss/mean_ratio": mean_ratio.item(),
        "loss/mismatch_kl": mismatch_kl.item(),
        "loss/max_abs_log_ratio": max_abs_log_ratio.item(),
    }
    return loss, metrics
