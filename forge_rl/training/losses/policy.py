"""Policy-gradient losses against the generator's recorded behaviour logprobs, as plain functions.

One entry point, `policy_loss`, configured by `LossConfig` (`--trainer.loss.*`). Shapes: N
completions (rows), L positions; `_NL` per token, `_N` per completion. Notation: pi = the trainer's
current policy (`logprobs_NL`, differentiable), b = the generator that sampled each token
(`behaviour_logprobs_NL`), A = the token's advantage (its completion's group advantage, plus process
and dense rewards: `forge_rl.core.advantages.token_advantages`), lo = 1 - eps_low, hi = 1 + eps_high,
sg = stop-gradient (detach).

The ratio
---------
r_t = pi(y_t) / b(y_t) = exp(logprobs - behaviour_logprobs), with gradient through pi. It is not
identically 1 because b is not pi: the token was decoded by weights up to `max_policy_age` versions
old, and even at the same version vLLM's kernels, precision and sampling differ from the trainer's
forward pass. A ratio taken against a detached copy of pi is identically 1 and corrects nothing
(tests/unit/training/test_losses.py fails on that bug for every loss).

Decoupled PPO (Hilton et al. 2022) anchors the trust region at a "proximal" policy and corrects
with a separate IS weight prox/b. forge_rl takes one optimizer step per batch and computes
logprobs once, so the proximal policy would be pi itself: pi/prox = 1 in value and its clip never
binds. So the clip is anchored at b, and r plays both roles: d[r A]/dtheta = r A grad log pi is the
importance-weighted policy gradient, and r is what PPO clips.

The corrections act on that same ratio, detached, and never add a second factor of r (weighting
tokens by r^2 would bias the gradient):
  tis   the IS weight w the loss applies is capped at is_cap: the per-token loss is multiplied by
        sg(min(1, is_cap / w)), so its gradient carries min(w, is_cap). w = r_t for grpo, dr_grpo
        and dapo (where PPO's clip has not zeroed the gradient), the sequence ratio s_i for gspo,
        clip(r_t, lo, hi) for cispo. With is_cap >= hi, under PPO's clip it only bites
        negative-advantage tokens with r_t > is_cap, whose gradient PPO leaves unbounded (a
        bounded cousin of dual-clip PPO).
  mis   tokens with sg(r_t) outside [1/is_cap, is_cap] get no loss.
  seq_mask_geo_mean = x: sequences with exp(mean_t log r_t) outside [1/x, x] get no loss.

What the loss divides by
------------------------
The denominators (the batch's loss tokens for token means; a row's loss tokens and the rows with
one for gspo; the rows with one, times length_normalizer, for dr_grpo) count `loss_mask_NL`, and
two kinds of mask differ there:
  data     `loss_mask_NL` itself: generated tokens (no context, no padding) of completions that are
           not ERRORED and not older than max_policy_age (`drop_policy mask_tokens` makes those
           untrainable). A token outside it is no sample of the objective and is in no denominator;
           a row left without one leaves the row counts. Masking a stale token drops that part of
           its episode, as `drop_episode` drops all of it, and a dropped episode is in no
           denominator either; an ERRORED completion has no measured reward to learn from.
  estimator  mis and seq_mask_geo_mean (like PPO's clip where it zeroes a gradient): their tokens
           add zero and stay in every denominator. They judge how far to trust a sampled token;
           dividing by the tokens kept instead would scale up the step on the rest by the share
           masked, so the further off-policy a batch, the larger its step, and weighting a
           data-parallel shard would need every rank's ratios first, where `num_loss_units` needs
           the batch's mask alone. The KL penalty follows the policy term: such a token has none.
What each mask took is logged: `buffer/dropped_tokens`, `completions/errored`,
`loss/mis_masked_fraction`, `loss/seq_masked_fraction`.

The losses (variants are rows of `VARIANTS`, not separate code):
  grpo     -min(r A, clip(r, lo, hi) A) per token, mean over the batch's tokens.
  dapo     grpo with clip-higher (eps_high 0.28 > eps_low 0.2; Yu et al. 2025), same token mean.
  dr_grpo  grpo's per-token term, masked_sum / (num_sequences * length_normalizer) (Liu et al.
           2025; num_sequences counts completions with a loss token): no 1/|y_i| length
           normalization; advantages without std normalization.
  gspo     sequence ratio s_i = exp(mean_t log r_it); per token -min(s_it A, clip(s_it, lo, hi) A)
           with s_it = sg(s_i) * pi(y_t) / sg(pi(y_t)), whose value is s_i and whose gradient is
           s_i grad log pi(y_t) ("GSPO-token", Zheng et al. 2025, equal to the sequence objective
           when A is per sequence); mean over a sequence's tokens, then over sequences.
  cispo    -sg(clip(r, lo, hi)) A log pi per token (REINFORCE with a truncated, detached IS weight;
           MiniMax-M1 2025), token mean. Its clip never zeroes a gradient, it bounds the weight.
kl_beta > 0 adds kl_beta * k3(pi || ref) per token, aggregated like the policy term, with
k3 = exp(ref - log pi) - (ref - log pi) - 1 (the GRPO paper's estimator).
"""

from __future__ import annotations

import torch

from forge_rl.training.losses.config import VARIANTS, LossConfig
from forge_rl.training.losses.corrections import (
    k3_kl_NL,
    sequence_keep_mask_N,
    sequence_mean_N,
    tis_factor_NL,
    token_keep_mask_NL,
)

# |log ratio| is clamped here before exp: fp32 exp overflows near 88, and inf * 0 is NaN. A token
# e^20 (~5e8) times more likely under one policy than the other carries no usable gradient anyway.
_MAX_LOG_RATIO = 20.0


def num_loss_units(loss_mask_NL: torch.Tensor, config: LossConfig) -> int:
    """What `policy_loss` averages over: tokens for token-mean losses, sequences with at least one
    loss token for gspo and dr_grpo. A data-parallel shard's loss times (its units / the batch's
    units), summed over shards, is the loss of the whole batch."""
    if VARIANTS[config.name].aggregation == "token_mean":
        return int(loss_mask_NL.sum())
    return int((loss_mask_NL.sum(-1) > 0).sum())


def policy_loss(
    logprobs_NL: torch.Tensor,
    behaviour_logprobs_NL: torch.Tensor,
    advantages_NL: torch.Tensor,
    loss_mask_NL: torch.Tensor,
    config: LossConfig,
    reference_logprobs_NL: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The configured loss (see the module docstring), differentiable through `logprobs_NL`, and
    detached metrics: token means over `loss_mask_NL` (so shards combine weighted by their token
    share), except names holding "/max_", which combine by max. `advantages_NL` is per token, [N, L]
    (a per-completion advantage as [N, 1] broadcasts)."""
    if config.kl_beta > 0 and reference_logprobs_NL is None:
        raise ValueError(
            f"trainer.loss.kl_beta ({config.kl_beta}) > 0 needs reference_logprobs_NL from a reference "
            "model, and none was given. Set --trainer.loss.kl-beta 0, or run the reference model."
        )
    # Masked-out positions carry arbitrary values (even NaN, and NaN * 0 is NaN): select, don't
    # multiply, so nothing there can reach the loss or overflow exp.
    raw_log_ratio_NL = torch.where(loss_mask_NL, logprobs_NL - behaviour_logprobs_NL, 0.0)
    log_ratio_NL = raw_log_ratio_NL.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    token_keep_NL = token_keep_mask_NL(log_ratio_NL.detach(), config.correction, config.is_cap)
    seq_keep_N1 = sequence_keep_mask_N(log_ratio_NL.detach(), loss_mask_NL, config.seq_mask_geo_mean).unsqueeze(-1)
    keep_NL = loss_mask_NL & token_keep_NL & seq_keep_N1

    ratio_NL = _ratio_NL(log_ratio_NL, keep_NL, VARIANTS[config.name].ratio)
    per_token_NL, weight_NL, clipped_low_NL, clipped_high_NL = _objective(
        ratio_NL, torch.where(keep_NL, logprobs_NL, 0.0), advantages_NL, config
    )
    stats_NL = {
        "loss/mean_ratio": log_ratio_NL.exp(),
        "loss/clip_fraction_low": clipped_low_NL & keep_NL,
        "loss/clip_fraction_high": clipped_high_NL & keep_NL,
        "loss/mismatch_kl": k3_kl_NL(log_ratio_NL),
    }
    if config.correction == "tis":
        per_token_NL = per_token_NL * tis_factor_NL(weight_NL, config.is_cap)
        stats_NL["loss/tis_truncated_fraction"] = keep_NL & (weight_NL > config.is_cap)
    if config.correction == "mis":
        stats_NL["loss/mis_masked_fraction"] = ~token_keep_NL
    if config.seq_mask_geo_mean is not None:
        stats_NL["loss/seq_masked_fraction"] = ~seq_keep_N1.expand_as(loss_mask_NL)
    if config.kl_beta > 0:
        ref_log_ratio_NL = torch.where(loss_mask_NL, reference_logprobs_NL - logprobs_NL, 0.0)
        ref_kl_NL = k3_kl_NL(ref_log_ratio_NL.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        per_token_NL = per_token_NL + config.kl_beta * ref_kl_NL
        stats_NL["loss/ref_kl"] = ref_kl_NL

    loss = _aggregate(torch.where(keep_NL, per_token_NL, 0.0), loss_mask_NL, config)
    metrics = {name: token_mean(values_NL, loss_mask_NL) for name, values_NL in stats_NL.items()}
    metrics["loss/max_abs_log_ratio"] = raw_log_ratio_NL.detach().abs().max().item()
    return loss, metrics


def token_mean(values_NL: torch.Tensor, loss_mask_NL: torch.Tensor) -> float:
    """Mean over the loss tokens (bool values: the fraction that is True), detached."""
    total = torch.where(loss_mask_NL, values_NL.detach().double(), 0.0).sum()
    return (total / loss_mask_NL.sum().clamp(min=1)).item()


def _ratio_NL(log_ratio_NL: torch.Tensor, keep_NL: torch.Tensor, level: str) -> torch.Tensor:
    """The ratio the objective uses, with gradient: r_t, or GSPO's s_it (value s_i, gradient
    s_i * grad log pi(y_t)), the geometric mean taken over the tokens the loss keeps."""
    if level == "token":
        return torch.exp(log_ratio_NL)
    log_seq_ratio_N1 = sequence_mean_N(log_ratio_NL.detach(), keep_NL).unsqueeze(-1)
    return torch.exp(log_seq_ratio_N1 + log_ratio_NL - log_ratio_NL.detach())


def _objective(
    ratio_NL: torch.Tensor, logprobs_NL: torch.Tensor, advantages_NL: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss, the (detached) importance weight its gradient carries, and where the clip
    acted low / high: for ppo_clip where it zeroed the gradient, for cispo where it bounded the weight."""
    low, high = 1.0 - config.eps_low, 1.0 + config.eps_high
    clipped_NL = ratio_NL.clamp(low, high)
    if VARIANTS[config.name].objective == "cispo":
        weight_NL = clipped_NL.detach()
        return -weight_NL * advantages_NL * logprobs_NL, weight_NL, ratio_NL < low, ratio_NL > high
    per_token_NL = -torch.minimum(ratio_NL * advantages_NL, clipped_NL * advantages_NL)
    clipped_low_NL = (advantages_NL < 0) & (ratio_NL < low)
    clipped_high_NL = (advantages_NL > 0) & (ratio_NL > high)
    return per_token_NL, ratio_NL.detach(), clipped_low_NL, clipped_high_NL


def _aggregate(per_token_NL: torch.Tensor, loss_mask_NL: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Reduce per-token losses (zero where not kept) to the scalar; denominators count `loss_mask_NL`."""
    aggregation = VARIANTS[config.name].aggregation
    if aggregation == "token_mean":
        return per_token_NL.sum() / loss_mask_NL.sum().clamp(min=1)
    if aggregation == "sequence_mean":
        per_sequence_N = per_token_NL.sum(-1) / loss_mask_NL.sum(-1).clamp(min=1)
    else:
        per_sequence_N = per_token_NL.sum(-1) / config.length_normalizer
    return per_sequence_N.sum() / (loss_mask_NL.sum(-1) > 0).sum().clamp(min=1)
