"""The policy loss's settings (`LossConfig`) and each loss's defaults (`VARIANTS`): no torch here, so
the controller and the CLI validate a config without importing it (the losses: policy.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NoReturn

Correction = Literal["none", "tis", "mis"]
"""Off-policy correction against the behaviour logprobs (corrections.py)."""

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]


@dataclass(frozen=True)
class Variant:
    ratio: Literal["token", "sequence"]
    """Token ratio r_t, or GSPO's sequence ratio s_i."""
    objective: Literal["ppo_clip", "cispo"]
    """-min(ratio A, clip(ratio) A), or CISPO's -sg(clip(ratio)) A log pi."""
    aggregation: Literal["token_mean", "sequence_mean", "sequence_sum"]
    """Sum over tokens / tokens; mean over sequences of (token sum / tokens); of (token sum / length_normalizer)."""
    clip_eps: tuple[float, float]
    """Default (eps_low, eps_high)."""
    normalize_advantage_std: bool


VARIANTS: dict[str, Variant] = {
    "grpo": Variant("token", "ppo_clip", "token_mean", (0.2, 0.2), True),
    "dapo": Variant("token", "ppo_clip", "token_mean", (0.2, 0.28), True),
    "dr_grpo": Variant("token", "ppo_clip", "sequence_sum", (0.2, 0.2), False),
    # GSPO's sequence ratio is a geometric mean, so it moves far less than token ratios: the paper
    # (Sec. 5.1) clips at 3e-4 / 4e-4.
    "gspo": Variant("sequence", "ppo_clip", "sequence_mean", (3e-4, 4e-4), True),
    # No lower bound (lo = 0, as MiniMax-M1 does) and the weight capped at 4 (ScaleRL; Tinker's default).
    "cispo": Variant("token", "cispo", "token_mean", (1.0, 3.0), True),
}


@dataclass(frozen=True)
class LossConfig:
    name: LossName = "grpo"
    """Policy loss: grpo (token-level clipped surrogate), dr_grpo (no length or std normalization),
    dapo (clip-higher), gspo (sequence-level ratio), cispo (clipped IS weight, detached). See
    `forge_rl.training.losses.policy`."""
    clip_eps_low: float | None = None
    """Lower clip: ratios below 1 - clip_eps_low get no further push. None: the loss's default
    (0.2; gspo 3e-4; cispo 1.0, i.e. no lower bound)."""
    clip_eps_high: float | None = None
    """Upper clip: ratios above 1 + clip_eps_high get no further push. None: the loss's default
    (0.2; dapo 0.28; gspo 4e-4; cispo 3.0, i.e. the IS weight capped at 4)."""
    length_normalizer: int | None = None
    """dr_grpo only, and required there: the constant each sequence's token sum is divided by, the
    generation budget of one completion (Dr. GRPO's MAX_TOKENS): generator.max_new_tokens, or with an
    environment the most tokens a trajectory can generate, min(environment.limits.max_turns x
    max_tokens_per_turn, max_total_tokens) (`GRPOConfig.max_completion_tokens`, which the config
    checks it against). Any constant gives the same gradient direction; it sets the scale, like a
    learning rate."""
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
    local_advantage_weight: float = 1.0
    """Branch rollouts (branch.rule): the weight of a token's local advantage, its segment's value
    against the fork it continues, beside the group advantage (0: the group's alone).
    docs/branches.md."""

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value < 10.0:
                _fail(name, value, "must be in (0, 10)")
        if self.name == "dr_grpo" and self.length_normalizer is None:
            requirement = (
                "must be set when trainer.loss.name is 'dr_grpo' (to generator.max_new_tokens, or with an "
                "environment to the most tokens a trajectory can generate)"
            )
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
        return VARIANTS[self.name].clip_eps[0] if self.clip_eps_low is None else self.clip_eps_low

    @property
    def eps_high(self) -> float:
        """clip_eps_high, or the loss's default when unset."""
        return VARIANTS[self.name].clip_eps[1] if self.clip_eps_high is None else self.clip_eps_high

    @property
    def normalize_advantage_std(self) -> bool:
        """Whether group advantages are divided by the group's std: all but dr_grpo."""
        return VARIANTS[self.name].normalize_advantage_std


def _fail(field: str, value: object, constraint: str) -> NoReturn:
    flag = field.replace("_", "-")
    raise ValueError(f"trainer.loss.{field} ({value}) {constraint}. Set --trainer.loss.{flag}.")
