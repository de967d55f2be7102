"""Low-rank adapters (LoRA) on the projections of a TorchTitan model, the base frozen.

For each targeted linear layer y = W x, LoRA trains two small matrices and serves

    y = W x + (alpha / rank) * B (A x)        A: [rank, in_features], B: [out_features, rank]

A starts Kaiming-uniform and B at zero, so an adapted model starts as exactly its base. Only A and
B train: with rank 16 on every attention and MLP projection of SmolLM2-135M they are 3.2% of
the weights (4.33M of 134.5M), which is what weight sync then moves (issue 15, part 5).

The adapters live in their own module (`LoRAAdapters`), not inside the model: the model's
parameters, state_dict keys and TorchTitan state-dict adapter stay those of the base, so the HF
export of the base, and the adapters-only checkpoint (`adapter_state_dict()`), are separate by
construction. `attach` adds each adapter's output to its layer's output with a forward hook.

Targets are the last component of a module's name: TorchTitan's llama3/qwen3 blocks call their
projections `wqkv` (q, k and v fused), `wo`, and `w1`, `w2`, `w3` (the SwiGLU MLP). Written for
one process; sharding adapters under FSDP2/TP with their base layers is not done here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ATTENTION_TARGETS = ("wqkv", "wo")
MLP_TARGETS = ("w1", "w2", "w3")


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
    """Last name components of the linear layers to adapt (TorchTitan: wqkv, wo, w1, w2, w3)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank ({self.rank}) must be >= 1. Set --lora.rank.")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha ({self.alpha}) must be > 0. Set --lora.alpha.")
        if not self.targets:
            raise ValueError(f"lora.targets is empty: nothing to adapt. Set --lora.targets, e.g. {' '.join(ATTENTION_TARGETS + MLP_TARGETS)}.")

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B (A x)."""
        return self.alpha / self.rank


class LoRALayer(nn.Module):
    """The adapter of one linear layer: x -> scaling * B (A x)."""

    def __init__(self, in_features: int, out_features: int, rank: int, scaling: float, device=None, dtype=None):
        super().__init__()
        self.scaling = scaling
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        # As nn.Linear and PEFT initialize A; B = 0 makes the adapted model start as its base.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return (x_BLD @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """[out_features, in_features] scaling * B A: what merging adds to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def _key(module_name: str) -> str:
    """A ModuleDict key for a dotted module name (dots are not allowed in keys)."""
    return module_name.replace(".", "__")


class LoRAAdapters(nn.Module):
    """The adapters of every targeted linear layer of `model`, keyed by the layer's module name.

    Construction freezes every parameter of `model`; `attach()` makes the model's forward include
    the adapters. `parameters()` are the trainable ones; `adapter_state_dict()` is the
    adapters-only checkpoint, keyed by the model's module names.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig):
        super().__init__()
        self.config = config
        linears = _linear_layers(model)
        targeted = {name: layer for name, layer in linears.items() if name.rsplit(".", 1)[-1] in config.targets}
        missing = [t for t in config.targets if not any(n.rsplit(".", 1)[-1] == t for n in targeted)]
        if missing:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise ValueError(
                f"lora.targets {list(missing)} match no linear layer of the model. Its linear layers are named "
                f"{kinds} (last name component; e.g. {next(iter(linears), 'none')}). Set --lora.targets to some of those."
            )
        too_small = [
            f"{name} [{layer.out_features} x {layer.in_features}]"
            for name, layer in targeted.items()
            if config.rank > min(layer.in_features, layer.out_features)
        ]
        if too_small:
            smallest = min(min(layer.in_features, layer.out_features) for layer in targeted.values())
            raise ValueError(
                f"lora.rank ({config.rank}) exceeds the smaller dimension of {len(too_small)} targeted layer(s), e.g. "
                f"{too_small[0]}: such an adapter is a full-rank update with extra parameters. Set --lora.rank "
                f"to at most {smallest}, or leave those layers out of --lora.targets."
            )
        self.module_names = list(targeted)
        self.layers = nn.ModuleDict(
            {
                _key(name): LoRALayer(
                    layer.in_features, layer.out_features, config.rank, config.scaling,
                    device=layer.weight.device, dtype=layer.weight.dtype,
                )
                for name, layer in targeted.items()
            }
        )
        self._model_linears = targeted
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for param in model.parameters():
            param.requires_grad_(False)

    def attach(self) -> None:
        """From now on each targeted layer outputs W x + scaling * B (A x). Idempotent."""
        if self._hooks:
            return
        for name, layer in self._model_linears.items():
            adapter = self.layers[_key(name)]
            self._hooks.append(layer.register_forward_hook(lambda _m, args, out, a=adapter: out + a(args[0])))

    def detach(self) -> None:
        """The model computes with its base weights alone again (the adapters are kept)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def merged_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` (copies) computed with every targeted weight W replaced by
        W + scaling * B A: the merged checkpoint, in the model's own names. The model's weights
        are restored bit for bit afterwards. The merge goes through the weights themselves, not
        state_dict keys, because TorchTitan's state_dict splits the fused wqkv into wq/wk/wv."""
        originals = {name: layer.weight.detach().clone() for name, layer in self._model_linears.items()}
        try:
            with torch.no_grad():
                for name, layer in self._model_linears.items():
                    layer.weight.add_(self.layers[_key(name)].delta_weight().to(layer.weight.dtype))
                return {name: value.detach().clone() for name, value in model.state_dict().items()}
        finally:
            with torch.no_grad():
                for name, layer in self._model_linears.items():
                    layer.weight.copy_(originals[name])

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters-only checkpoint: "<module name>.lora_A" / ".lora_B" (e.g.
        "layers.0.attention.wo.lora_A") -> tensor."""
        return {
            f"{name}.{part}": getattr(self.layers[_key(name)], part).detach()
            for name in self.module_names
            for part in ("lora_A", "lora_B")
        }

    def load_adapters(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an `adapter_state_dict()` checkpoint; ValueError naming every mismatch when it does
        not fit these adapters (other layers, another rank, another base model)."""
        expected = {name: tuple(t.shape) for name, t in self.adapter_state_dict().items()}
        given = {name: tuple(t.shape) for name, t in state_dict.items()}
        problems = [f"missing {name}" for name in sorted(expected.keys() - given.keys())]
        problems += [f"unexpected {name}" for name in sorted(given.keys() - expected.keys())]
        problems += [
            f"{name} has shape {list(given[name])}, these adapters {list(shape)}"
            for name, shape in sorted(expected.items())
            if name in given and given[name] != shape
        ]
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise ValueError(
                f"the adapter checkpoint does not fit this model's adapters (rank {self.config.rank}, targets "
                f"{list(self.config.targets)}): {shown}. Load it with the lora.rank and lora.targets it was trained "
                "with, on the base model it was trained from."
            )
        with torch.no_grad():
            for key, tensor in state_dict.items():
                name, part = key.rsplit(".", 1)
                getattr(self.layers[_key(name)], part).copy_(tensor)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
