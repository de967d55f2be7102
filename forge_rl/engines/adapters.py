"""Policy versions served as LoRA adapters on a vLLM engine: the settings (`AdapterServing`), the
version that names the base model alone, the failures, and the figures of one adapter load."""

from __future__ import annotations

from dataclasses import dataclass

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for max_lora_rank (vllm/config/lora.py, MaxLoRARanks)."""


@dataclass(frozen=True)
class AdapterServing:
    """How an engine serves a policy trained with LoRA: the base model stays, each policy version
    is an adapter (docs/weight_store.md, "Adapter versions"). Derived by the run from
    trainer.lora and buffer.max_policy_age (`GRPOConfig.adapter_serving`), not a flag.

    Each version is a new vLLM adapter (name "forge-policy-<v>", id v + 1), never reloaded in
    place; a request keeps the adapter it was submitted with, so its tokens are exact samples of
    that version and are stamped with it. `resident` adapters stay loaded (vLLM gets one slot
    more, so the next loads at once): past them the oldest is unloaded, and a request still on it
    (one that outlived the age bound: partial rollouts, admission drop) is aborted and continues
    on the newest adapter, as an abort-mode swap continues a request on new weights.
    """

    rank: int
    """LoRA rank of the adapters (vLLM's max_lora_rank is the smallest value it accepts >= it)."""
    resident: int
    """Adapters kept loaded: max_policy_age + 1, so every version a request in flight may still
    use (the staleness bound) keeps its adapter."""
    base_model: str
    """The base model directory the engine serves; an adapter version of another base is refused."""

    def __post_init__(self) -> None:
        if self.resident < 1:
            raise ValueError(f"AdapterServing.resident ({self.resident}) must be >= 1 (buffer.max_policy_age + 1).")
        if self.rank > _VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"trainer.lora.rank ({self.rank}) exceeds vLLM's largest max_lora_rank ({_VLLM_LORA_RANKS[-1]}). "
                f"Set --trainer.lora.rank to at most {_VLLM_LORA_RANKS[-1]}."
            )

    @property
    def max_lora_rank(self) -> int:
        return next(r for r in _VLLM_LORA_RANKS if r >= self.rank)


class AdapterMismatch(ValueError):
    """An adapter version that does not fit the base model an engine serves."""


class AdapterNotResident(LookupError):
    """`VLLMEngine.sample` was asked for an adapter version the engine does not hold now."""

    def __init__(self, policy_version: int) -> None:
        super().__init__(f"adapter version {policy_version} is not loaded in this engine")
        self.policy_version = policy_version


BASE_MODEL = -1
"""`VLLMEngine.sample`'s adapter version for the base model alone."""


@dataclass(frozen=True)
class AdapterLoadStats:
    """One adapter version made servable (`VLLMEngine.load_adapter`). Seconds."""

    policy_version: int
    wait_s: float
    """Waiting for the previous load's unload of the oldest adapter, if still pending (its
    engine-core call, and moving the requests still on it to the newest adapter)."""
    load_s: float
    """vLLM's add_lora, a call into the engine core answered between two decode steps: an upper
    bound of the decode stall (it includes the round trip to the engine-core process)."""
    unloaded: list[int]
    """Versions whose adapters the previous load's unload removed (waited for here)."""
    resident: list[int]
    """Versions whose adapters are loaded now."""
