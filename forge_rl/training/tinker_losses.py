"""The Tinker API's built-in losses, as its documentation defines them: each a sum over every
position of every datum (not a mean), of the target tokens' logprobs under the current weights.

    cross_entropy        -(weights * logp).sum()
    importance_sampling  -(ratio * A).sum()                               ratio = exp(logp - q)
    ppo                  -min(ratio * A, clip(ratio, low, high) * A).sum()
    cispo                -(sg(clip(ratio, low, high)) * logp * A).sum()
    dro                  -(logp * A - beta / 2 * (logp - q) ** 2).sum()

q is the sampler's logprob of the token (loss_fn_inputs "logprobs"), A the advantage
("advantages"). `loss_fn_config` sets ppo's and cispo's clip_low_threshold / clip_high_threshold
(0.8 and 1.2 unless given) and dro's beta (0.05 unless given). Padding positions never count.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

REQUIRED_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
"""Each loss's loss_fn_inputs; a datum lacking one is refused before anything runs."""
CONFIG_DEFAULTS = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}
"""The loss_fn_config keys each loss reads, with their defaults; other keys are refused."""


def config_of(loss_fn: str, loss_fn_config: Mapping[str, float] | None) -> dict[str, float]:
    """`loss_fn_config` over the loss's defaults; ValueError naming an unknown key."""
    defaults = CONFIG_DEFAULTS.get(loss_fn, {})
    given = dict(loss_fn_config or {})
    unknown = sorted(given.keys() - defaults.keys())
    if unknown:
        known = ", ".join(defaults) or "none"
        raise ValueError(f"loss_fn_config keys {unknown} are not read by the {loss_fn!r} loss (its keys: {known}).")
    return {**defaults, **{key: float(value) for key, value in given.items()}}


def elementwise_loss(
    loss_fn: str,
    logprobs_NL: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask_NL: torch.Tensor,
    config: Mapping[str, float],
) -> torch.Tensor:
    """[N, L] each position's loss (0 on padding); the batch's loss is its sum. `inputs` are
    padded [N, L] tensors by loss_fn_inputs name; `config` is `config_of`'s."""
    zero = torch.zeros_like(logprobs_NL)
    if loss_fn == "cross_entropy":
        loss_NL = -inputs["weights"] * logprobs_NL
    else:
        sampled_NL, advantages_NL = inputs["logprobs"], inputs["advantages"]
        # Padding positions hold garbage ratios; masked here before exp can overflow there.
        log_ratio_NL = torch.where(mask_NL, logprobs_NL - sampled_NL, zero)
        ratio_NL = log_ratio_NL.exp()
        if loss_fn == "importance_sampling":
            loss_NL = -ratio_NL * advantages_NL
        elif loss_fn == "ppo":
            clipped_NL = ratio_NL.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
            loss_NL = -torch.minimum(ratio_NL * advantages_NL, clipped_NL * advantages_NL)
        elif loss_fn == "cispo":
            clipped_NL = ratio_NL.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
            loss_NL = -clipped_NL * logprobs_NL * advantages_NL
        elif loss_fn == "dro":
            loss_NL = -(logprobs_NL * advantages_NL - 0.5 * config["beta"] * log_ratio_NL**2)
        else:
            raise ValueError(f"unknown loss {loss_fn!r}; the trainer computes {', '.join(REQUIRED_INPUTS)}.")
    return torch.where(mask_NL, loss_NL, zero)
