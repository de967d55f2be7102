"""Low-rank adapters (LoRA) on the projections of a TorchTitan model, the base frozen.

For each targeted linear layer y = W x, LoRA trains two small matrices and serves

    y = W x + (alpha / rank) * B (A x)        A: [rank, in_features], B: [out_features, rank]

A starts Kaiming-uniform (drawn from `seed` alone, so every rank and every parallelism starts from
the same adapters) and B at zero, so an adapted model starts as exactly its base. Only A and B
train: with rank 16 on every attention and MLP projection of SmolLM2-135M they are 3.2% of the
weights (4.33M of 134.5M), which is what weight sync then moves.

The adapters live in their own module (`LoRAAdapters`), not inside the model: the model's
parameters, state_dict keys and TorchTitan state-dict adapter stay those of the base, so the HF
export of the base, and the adapters-only checkpoint (`adapter_state_dict()`), are separate by
construction. `attach` adds each adapter's output to its layer's output with a forward hook, which
runs after the layer's own TP redistribution, on what the next layer reads.

Sharding (docs/models.md, "LoRA"). Adapters are built after the model is parallelized and follow
their base layer's tensor-parallel split, as DTensors on the tp mesh:

    base layer                 W on tp       A              B              adapter output
    column parallel (wqkv,     Shard(0)      Replicate      Shard(0)       Shard(-1), as W x
      w1, w3, lm_head):
      out split
    row parallel (wo, w2):     Shard(1)      Shard(1)       Replicate      Partial, redistributed to
      in split                                                             W x's layout (SP: Shard(1))

so each rank computes exactly its share of B (A x), and DTensor's autograd reduces the gradients
that cross ranks (A's under column parallelism, B's under row parallelism are Partial after
backward; `reduce_gradients` brings them to their parameter's placement). FSDP2 does not shard the
adapters: they are replicated over data-parallel ranks (3% of the weights) and `reduce_gradients`
sums their gradients over those ranks, as FSDP2 sums the base's (no division: the trainer
normalizes its loss by the batch's token count).

Targets are the last component of a module's name: TorchTitan's llama3/qwen3 blocks call their
projections `wqkv` (q, k and v fused), `wo`, and `w1`, `w2`, `w3` (the SwiGLU MLP); the
unembedding is `lm_head` (vocabulary split under TP, as TorchTitan splits it). With tied embeddings
the hook adapts lm_head's output alone, so the input embedding stays the base's; such an adapter
cannot be merged (`merged`), the one matrix serving both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from forge_rl.models.lora_config import LoRAConfig, check_rank, check_targets

_AC_WRAPPER = "_checkpoint_wrapped_module."
"""Activation checkpointing's wrapper in module names; left out of adapter keys, so a checkpoint
does not depend on trainer.activation_checkpointing."""


def _tp_placements(weight: torch.Tensor):
    """(tp mesh, A's placement, B's placement) that split an adapter as its base weight is split
    over the tp mesh dimension (see the module docstring), or None when the weight is not."""
    if not isinstance(weight, DTensor) or "tp" not in (weight.device_mesh.mesh_dim_names or ()):
        return None
    placement = weight.placements[weight.device_mesh.mesh_dim_names.index("tp")]
    mesh = weight.device_mesh["tp"]
    if placement.is_shard(0):  # column parallel: each rank computes some output features
        return mesh, Replicate(), Shard(0)
    if placement.is_shard(1):  # row parallel: each rank holds some input features
        return mesh, Shard(1), Replicate()
    return mesh, Replicate(), Replicate()


class LoRALayer(nn.Module):
    """The adapter of one linear layer: x -> scaling * B (A x); A and B plain tensors, or DTensors
    split as their base layer is (`_tp_placements`)."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float):
        super().__init__()
        self.scaling = scaling
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        # FSDP2's bf16 MixedPrecisionPolicy feeds bf16 activations; the adapters stay fp32 masters.
        lora_A, lora_B = self.lora_A.to(x_BLD.dtype), self.lora_B.to(x_BLD.dtype)
        return (x_BLD @ lora_A.t() @ lora_B.t()) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """[out_features, in_features] scaling * B A, unsharded: what merging adds to the base
        weight. A collective under TP."""
        delta = (self.lora_B @ self.lora_A) * self.scaling
        return delta.full_tensor() if isinstance(delta, DTensor) else delta


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        name.replace(_AC_WRAPPER, ""): module for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }


def _key(module_name: str) -> str:
    """A ModuleDict key for a dotted module name (dots are not allowed in keys)."""
    return module_name.replace(".", "__")


def _add_adapter(adapter: LoRALayer, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook body: the layer's output plus its adapter's, in the output's layout (under
    row-parallel TP the adapter's output is a Partial sum; the layer's has been reduced already)."""
    delta = adapter(inputs[0])
    if isinstance(out, DTensor):
        delta = delta.redistribute(out.device_mesh, out.placements)
    return out + delta


class LoRAAdapters(nn.Module):
    """The adapters of every targeted linear layer of `model`, keyed by the layer's module name.

    Construction freezes every parameter of `model`; `attach()` makes the model's forward include
    the adapters. `parameters()` are the trainable ones; `adapter_state_dict()` is the
    adapters-only checkpoint, keyed by the model's module names. Build it after the model is
    parallelized: each adapter is split as its layer's weight is (module docstring).
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, seed: int = 0):
        super().__init__()
        self.config = config
        linears = _linear_layers(model)
        check_targets(config, list(linears))
        targeted = {name: layer for name, layer in linears.items() if name.rsplit(".", 1)[-1] in config.targets}
        check_rank(config, {name: (layer.out_features, layer.in_features) for name, layer in targeted.items()})
        self.module_names = list(targeted)
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleDict({_key(name): self._build(layer, generator) for name, layer in targeted.items()})
        self._model_linears = targeted
        self._tied = [name for name in targeted if name == "lm_head" and getattr(model, "enable_weight_tying", False)]
        """Targeted layers whose weight is also the input embedding's (TorchTitan's weight tying)."""
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for param in model.parameters():
            param.requires_grad_(False)

    def _build(self, layer: nn.Linear, generator: torch.Generator) -> LoRALayer:
        """One layer's adapter: A drawn on CPU from `generator` (the same on every rank), B zero,
        then split like the layer's weight."""
        lora_A = torch.empty(self.config.rank, layer.in_features)
        # As nn.Linear and PEFT initialize A; B = 0 makes the adapted model start as its base.
        nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
        lora_B = torch.zeros(layer.out_features, self.config.rank)
        weight = layer.weight
        lora_A, lora_B = (t.to(device=weight.device, dtype=weight.dtype) for t in (lora_A, lora_B))
        split = _tp_placements(weight)
        if split is not None:
            mesh, placement_A, placement_B = split
            # src_data_rank=None: every rank holds the same full tensors, so each keeps its piece.
            lora_A = distribute_tensor(lora_A, mesh, [placement_A], src_data_rank=None)
            lora_B = distribute_tensor(lora_B, mesh, [placement_B], src_data_rank=None)
        return LoRALayer(lora_A, lora_B, self.config.scaling)

    def initial_state(self, seed: int) -> dict[str, torch.Tensor]:
        """Adapters as a fresh `LoRAAdapters` with `seed` would start (A drawn from it, B zero),
        split as these are, keyed as `named_adapter_parameters`: another tenant's start
        (`forge_rl.training.tenants`)."""
        generator = torch.Generator().manual_seed(seed)
        state = {}
        for name in self.module_names:
            fresh = self._build(self._model_linears[name], generator)
            state[f"{name}.lora_A"], state[f"{name}.lora_B"] = fresh.lora_A.detach(), fresh.lora_B.detach()
        return state

    def attach(self) -> None:
        """From now on each targeted layer outputs W x + scaling * B (A x). Idempotent."""
        if self._hooks:
            return
        for name, layer in self._model_linears.items():
            adapter = self.layers[_key(name)]
            self._hooks.append(layer.register_forward_hook(lambda _m, args, out, a=adapter: _add_adapter(a, args, out)))

    def detach(self) -> None:
        """The model computes with its base weights alone again (the adapters are kept)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def reduce_gradients(self, dp_group: dist.ProcessGroup | None) -> None:
        """After backward: bring each gradient to its parameter's placement (a Partial sum over the
        tp ranks becomes the sum), then sum the gradients over the data-parallel ranks, which hold
        replicas. The gradients of all adapters travel in one buffer."""
        grads = []
        for param in self.parameters():
            if param.grad is None:
                continue
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            grads.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)
        if dp_group is None or dist.get_world_size(dp_group) == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @contextmanager
    def merged(self) -> Iterator[None]:
        """Within the block, each targeted weight W is W + scaling * B A and the hooks are off, so
        the model computes (and its state_dict holds) the merged model; W is restored bit for bit
        afterwards. A collective under TP/FSDP2 (every rank enters it), and FSDP2 modules must be
        resharded (`titan.reshard`), so that the registered weights are the shards. The merge goes
        through the weights themselves, not state_dict keys, because TorchTitan's state_dict
        splits the fused wqkv into wq/wk/wv. ValueError for an adapter on a tied lm_head."""
        if self._tied:
            raise ValueError(
                f"the adapter on {self._tied[0]} cannot be merged into its weight: the model ties it to "
                "tok_embeddings (tie_word_embeddings true), so the merge would change the input embedding too, "
                "and the HF export holds one matrix for both. Serve the adapters unmerged "
                "(adapter_state_dict(), as a PEFT adapter directory: forge_rl.models.peft_format), or leave "
                "lm_head out of --trainer.lora.targets."
            )
        hooked = bool(self._hooks)
        self.detach()
        originals = {}
        try:
            with torch.no_grad():
                for name, layer in self._model_linears.items():
                    weight = layer.weight
                    delta = self.layers[_key(name)].delta_weight().to(weight.dtype)
                    if isinstance(weight, DTensor):
                        delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
                        delta, weight = delta.to_local(), weight.to_local()
                    originals[name] = weight.clone()
                    weight.add_(delta)
            yield
        finally:
            with torch.no_grad():
                for name, original in originals.items():
                    weight = self._model_linears[name].weight
                    (weight.to_local() if isinstance(weight, DTensor) else weight).copy_(original)
            if hooked:
                self.attach()

    def named_adapter_parameters(self) -> dict[str, nn.Parameter]:
        """ "<module name>.lora_A" / ".lora_B" -> the live (possibly sharded) parameter."""
        return {
            f"{name}.{part}": getattr(self.layers[_key(name)], part)
            for name in self.module_names
            for part in ("lora_A", "lora_B")
        }

    def adapter_state_dict(self, dtype: torch.dtype | None = None, keep: bool = True) -> dict[str, torch.Tensor]:
        """The adapters-only checkpoint: "<module name>.lora_A" / ".lora_B" (e.g.
        "layers.0.attention.wo.lora_A") -> a full (unsharded) CPU copy, in `dtype` (default: the
        parameter's). Gathers TP shards, so every rank calls it; `keep=False` joins the gathers and
        returns {}."""
        state = {}
        for key, param in self.named_adapter_parameters().items():
            value = param.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()  # a collective: every rank, in the same order
            if keep:
                state[key] = value.to(device="cpu", dtype=dtype or value.dtype, copy=True)
        return state

    def check_fits(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """ValueError naming every mismatch when a checkpoint with these (key -> full shape)
        entries does not fit these adapters (other layers, another rank, another base model)."""
        expected = {key: tuple(param.shape) for key, param in self.named_adapter_parameters().items()}
        given = {key: tuple(shape) for key, shape in shapes.items()}
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
                f"{list(self.config.targets)}): {shown}. Load it with the --trainer.lora.rank and "
                "--trainer.lora.targets it was trained with, on the base model it was trained from."
            )

    def load_adapters(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an `adapter_state_dict()` checkpoint (full tensors; each rank keeps its shards);
        ValueError from `check_fits` when it does not fit."""
        self.check_fits({key: tuple(t.shape) for key, t in state_dict.items()})
        params = self.named_adapter_parameters()
        with torch.no_grad():
            for key, tensor in state_dict.items():
                param = params[key]
                tensor = tensor.to(device=param.device, dtype=param.dtype)
                if isinstance(param, DTensor):
                    tensor = distribute_tensor(tensor, param.device_mesh, param.placements, src_data_rank=None)
                param.copy_(tensor)

    def num_parameters(self) -> int:
        """Adapter parameters of the whole model (full shapes, not this rank's shards)."""
        return sum(p.numel() for p in self.parameters())
