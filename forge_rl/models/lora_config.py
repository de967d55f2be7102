"""What LoRA adapts and how (`LoRAConfig`), and the checks of a config against a model's layers: no
torch here, so the controller and the CLI validate a config without importing it (the adapters
themselves: `forge_rl.models.lora`)."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_TARGETS = ("wqkv", "wo")
MLP_TARGETS = ("w1", "w2", "w3")
UNEMBED_TARGETS = ("lm_head",)
"""The final projection to the vocabulary (TorchTitan and HF both call it lm_head). Not a default
target: the Tinker API's `train_unembed` adds it. Without it, a model whose unembedding is random
(the tiny models) caps each token's probability near what that matrix's norm allows, whatever the
adapters learn upstream."""


@dataclass(frozen=True)
class LoRAConfig:
    enabled: bool = False
    """Train low-rank adapters on a frozen base instead of every weight (and sync only the adapters)."""
    rank: int = 16
    """Rank r of every adapter: A is [r, in_features], B is [out_features, r]. At most
    min(in_features, out_features) of each targeted layer (more would add nothing a full update lacks)."""
    alpha: float = 32.0
    """Scale of the adapter's output: alpha / rank (so the step size barely depends on the rank)."""
    targets: tuple[str, ...] = ATTENTION_TARGETS + MLP_TARGETS
    """Last name components of the linear layers to adapt (TorchTitan: wqkv, wo, w1, w2, w3, and
    lm_head, the unembedding, which the default leaves out)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"trainer.lora.rank ({self.rank}) must be >= 1. Set --trainer.lora.rank.")
        if not self.alpha > 0:
            raise ValueError(f"trainer.lora.alpha ({self.alpha}) must be > 0. Set --trainer.lora.alpha.")
        if not self.targets:
            raise ValueError(
                "trainer.lora.targets is empty: nothing to adapt. Set --trainer.lora.targets, e.g. "
                f"{' '.join(ATTENTION_TARGETS + MLP_TARGETS)}."
            )

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B (A x)."""
        return self.alpha / self.rank


def llama_layer_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """[out_features, in_features] of each projection a llama3/qwen3 block builds from `hf_config`
    (HF config.json), by TorchTitan name, and of the unembedding (lm_head): what `check_rank` needs
    before any model is built."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    intermediate = hf_config["intermediate_size"]
    return {
        "wqkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "wo": (hidden, heads * head_dim),
        "w1": (intermediate, hidden),
        "w2": (hidden, intermediate),
        "w3": (intermediate, hidden),
        "lm_head": (hf_config["vocab_size"], hidden),
    }


def check_targets(config: LoRAConfig, names: list[str]) -> None:
    """ValueError listing the layer names that exist when a target matches none of `names` (module
    names or their last components)."""
    kinds = sorted({name.rsplit(".", 1)[-1] for name in names})
    missing = [target for target in config.targets if target not in kinds]
    if missing:
        example = next((name for name in names if "." in name), None)
        example = f" (e.g. {example})" if example else ""
        raise ValueError(
            f"trainer.lora.targets {missing} match no linear layer of the model. Its linear layers are named "
            f"{kinds} (last name component{example}). Set --trainer.lora.targets to some of those."
        )


def check_rank(config: LoRAConfig, shapes: dict[str, tuple[int, int]]) -> None:
    """ValueError naming a layer and the largest rank that fits when trainer.lora.rank exceeds the
    smaller dimension of a targeted layer; `shapes`: layer name -> [out_features, in_features]."""
    too_small = [f"{name} [{out} x {inp}]" for name, (out, inp) in shapes.items() if config.rank > min(out, inp)]
    if too_small:
        smallest = min(min(shape) for shape in shapes.values())
        raise ValueError(
            f"trainer.lora.rank ({config.rank}) exceeds the smaller dimension of {len(too_small)} targeted "
            f"layer(s), e.g. {too_small[0]}: such an adapter is a full-rank update with extra parameters. Set "
            f"--trainer.lora.rank to at most {smallest}, or leave those layers out of --trainer.lora.targets."
        )
