"""Advantage estimators. Plain PyTorch."""

from __future__ import annotations

import torch

# Keeps a group whose rewards are all equal at advantage 0 instead of dividing by zero.
_STD_EPS = 1e-6


def group_normalized_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    """GRPO advantages for one group of G completions of the same prompt: (r - mean) / (std + eps).

    A group whose samples all score the same carries no signal and gets all-zero advantages.
    """
    centered = rewards_G - rewards_G.mean()
    return centered / (rewards_G.std(unbiased=False) + _STD_EPS)
