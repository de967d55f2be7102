"""Policy-gradient losses against the generator's recorded behaviour logprobs, as plain functions.

One entry point, `policy_loss`, configured by `LossConfig` (`--trainer.loss.*`). Shapes: N
completions (rows), L positions; `_NL` per token, `_N` per completion. Notation: pi = the trainer's
current policy (`logprobs_NL`, differentiable), b = the generator that sampled each token
(`behaviour_logprobs_NL`), A = the token's advantage (its completion's group advantage, plus process
and dense rewards: forge_rl/advantages.py `token_advantages`), lo = 1 - eps_low, hi = 1 + eps_high,
sg = stop-gradient (detach).

The ratio
---------
r_t = pi(y_t) / b(y_t) = exp(logprobs - behaviour_logprobs), with gradient through pi. It is not
identically 1 because b is not pi: the token was decoded by weights up to `max_policy_age` versions
old, and even at the same version vLLM's kernels, precision and sampling differ from the trainer's
forward pass. A ratio taken against a detached copy of pi is identically 1 and corrects nothing
(tests/unit/test_losses.py fails on that bug for every loss).

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
Masked tokens add zero, but normalizers still count every token (sequence) of `loss_mask_NL`, so
`num_loss_units` weights data-parallel shards exactly.

The losses (variants are rows of `_VARIANTS`, not separate code):
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

import math
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch

from forge_rl.losses.corrections import (
    Correction,
    k3_kl_NL,
    sequence_keep_mask_N,
    sequence_mean_N,
    tis_factor_NL,
    token_keep_mask_NL,
)

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]

# |log ratio| is clamped here before exp: fp32 exp overflows near 88, and inf * 0 is NaN. A token
# e^20 (~5e8) times more likely under one policy than the other carries no usable gradient anyway.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class _Variant:
    ratio: Literal["token", "sequence"]
    """Token ratio r_t, or GSPO's sequence ratio s_i."""
    objective: Literal["ppo_clip", "cispo"]
    """-min(ratio A, clip(ratio) A), or CISPO's -sg(clip(ratio)) A log pi."""
    aggregation: Literal["token_mean", "sequence_mean", "sequence_sum"]
    """Sum over tokens / tokens; mean over sequences of (token sum / tokens); of (token sum / length_normalizer)."""
    clip_eps: tuple[float, float]
    """Default (eps_low, eps_high)."""
    normalize_advantage_std: bool


_VARIANTS: dict[str, _Variant] = {
    "grpo": _Variant("token", "ppo_clip", "token_mean", (0.2, 0.2), True),
    "dapo": _Variant("token", "ppo_clip", "token_mean", (0.2, 0.28), True),
    "dr_grpo": _Variant("token", "ppo_clip", "sequence_sum", (0.2, 0.2), False),
    # GSPO's sequence ratio is a geometric mean, so it moves far less than token ratios: the paper
    # (Sec. 5.1) clips at 3e-4 / 4e-4.
    "gspo": _Variant("sequence", "ppo_clip", "sequence_mean", (3e-4, 4e-4), True),
    # No lower bound (lo = 0, as MiniMax-M1 does) and the weight capped at 4 (ScaleRL; Tinker's default).
    "cispo": _Variant("token", "cispo", "token_mean", (1.0, 3.0), True),
}


@dataclass(frozen=True)
class LossConfig:
    name: LossName = "grpo"
    """Policy loss: grpo (token-level clipped surrogate), dr_grpo (no length or std normalization),
    dapo (clip-higher), gspo (sequence-level ratio), cispo (clipped IS weight, detached). See
    forge_rl/losses/policy.py."""
    clip_eps_low: float | None = None
    """Lower clip: ratios below 1 - clip_eps_low get no further push. None: the loss's default
    (0.2; gspo 3e-4; cispo 1.0, i.e. no lower bound)."""
    clip_eps_high: float | None = None
    """Upper clip: ratios above 1 + clip_eps_high get no further push. None: the loss's default
    (0.2; dapo 0.28; gspo 4e-4; cispo 3.0, i.e. the IS weight capped at 4)."""
    length_normalizer: int | None = None
    """dr_grpo only, and required there: the constant each sequence's token sum is divided by (Dr.
    GRPO uses the generation budget, generator.max_new_tokens). Any constant gives the same
    gradient direction; it sets the scale, like a learning rate."""
    correction: Correction = "none"
    """Off-policy correction against the behaviour logprobs: none, tis (cap the importance weight
    at is_cap) or mis (drop tokens whose ratio is outside [1/is_cap, is_cap])."""
    is_cap: float = 2.0
    """The bound C of tis and mis (> 1)."""
    seq_mask_geo_mean: float | None = None
    """When set (x > 1), drop whole sequences whose geometric-mean ratio exp(mean log ratio) is
    outside [1/x, x]; combines with any correction."""
    kl_beta: float = 0.0
    """Weight of the k3 KL penalty to a frozen reference model; 0 means no reference model runs."""
    step_discount: float = 1.0
    """Process rewards (per step or per turn): a token's advantage adds its own step's normalized
    reward and step_discount^j times that of the step j later (1: every later step, DeepSeekMath's
    GRPO; 0: its own step only). No effect on completions without step rewards. docs/scoring.md."""

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value < 10.0:
                _fail(name, value, "must be in (0, 10)")
        if self.name == "dr_grpo" and self.length_normalizer is None:
            requirement = "must be set when trainer.loss.name is 'dr_grpo' (to generator.max_new_tokens)"
            _fail("length_normalizer", None, requirement)
        if self.name != "dr_grpo" and self.length_normalizer is not None:
            requirement = f"has no effect with trainer.loss.name {self.name!r}; unset it"
            _fail("length_normalizer", self.length_normalizer, requirement)
        if self.length_normalizer is not None and self.length_normalizer < 1:
            _fail("length_normalizer", self.length_normalizer, "must be >= 1")
        if not 1.0 < self.is_cap < math.inf:
            _fail("is_cap", self.is_cap, "must be > 1 and finite")
        if self.seq_mask_geo_mean is not None and not 1.0 < self.seq_mask_geo_mean < math.inf:
            _fail("seq_mask_geo_mean", self.seq_mask_geo_mean, "must be > 1 and finite, or unset")
        if not 0.0 <= self.kl_beta < math.inf:
            _fail("kl_beta", self.kl_beta, "must be >= 0 and finite")
        if not 0.0 <= self.step_discount <= 1.0:
            _fail("step_discount", self.step_discount, "must be in [0, 1]")

    @property
    def eps_low(self) -> float:
        """clip_eps_low, or the loss's default when unset."""
        return _VARIANTS[self.name].clip_eps[0] if self.clip_eps_low is None else self.clip_eps_low

    @property
    def eps_high(self) -> float:
        """clip_eps_high, or the loss's default when unset."""
        return _VARIANTS[self.name].clip_eps[1] if self.clip_eps_high is None else self.clip_eps_high

    @property
    def normalize_advantage_std(self) -> bool:
        """Whether group advantages are divided by the group's std: all but dr_grpo."""
        return _VARIANTS[self.name].normalize_advantage_std


def _fail(field: str, value: object, constraint: str) -> NoReturn:
    flag = field.replace("_", "-")
    raise ValueError(f"trainer.loss.{field} ({value}) {constraint}. Set --trainer.loss.{flag}.")


def num_loss_units(loss_mask_NL: torch.Tensor, config: LossConfig) -> int:
    """What `policy_loss` averages over: tokens for token-mean losses, sequences with at least one
    loss token for gspo and dr_grpo. A data-parallel shard's loss times (its units / the batch's
    units), summed over shards, is the loss of the whole batch."""
    if _VARIANTS[config.name].aggregation == "token_mean":
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

    ratio_NL = _ratio_NL(log_ratio_NL, keep_NL, _VARIANTS[config.name].ratio)
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
    if _VARIANTS[config.name].objective == "cispo":
        weight_NL = clipped_NL.detach()
        return -weight_NL * advantages_NL * logprobs_NL, weight_NL, ratio_NL < low, ratio_NL > high
    per_token_NL = -torch.minimum(ratio_NL * advantages_NL, clipped_NL * advantages_NL)
    clipped_low_NL = (advantages_NL < 0) & (ratio_NL < low)
    clipped_high_NL = (advantages_NL > 0) & (ratio_NL > high)
    return per_token_NL, ratio_NL.detach(), clipped_low_NL, clipped_high_NL


def _aggregate(per_token_NL: torch.Tensor, loss_mask_NL: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Reduce per-token losses (zero where not kept) to the scalar; denominators count `loss_mask_NL`."""
    aggregation = _VARIANTS[config.name].aggregation
    if aggregation == "token_mean":
        return per_token_NL.sum() / loss_mask_NL.sum().clamp(min=1)
    if aggregation == "sequence_mean":
        per_sequence_N = per_token_NL.sum(-1) / loss_mask_NL.sum(-1).clamp(min=1)
    else:
        per_sequence_N = per_token_NL.sum(-1) / config.length_normalizer
    return per_sequence_N.sum() / (loss_mask_NL.sum(-1) > 0).sum().clamp(min=1)
