"""Many LoRA tenants on one frozen base: the trainer side of `forge-rl serve`.

Each tenant (a Tinker training model) owns its adapters, their gradients since its last optimizer
step and its AdamW moments. One `PolicyTrainer` with LoRA holds the base and the live adapter
tensors; a tenant's call first makes it the live one (`activate`): the outgoing tenant's adapters,
gradients and moments are moved out, the incoming tenant's moved in. Moving is a copy of the
adapters (3% of the weights at rank 16) and a handover of the gradient and moment tensors, so
gradients of two tenants never meet in one tensor and calls of different tenants may interleave
in any order.

Losses are those of the Tinker API (`forge_rl.training.tinker_losses`): sums over positions, the
gradients of successive forward_backward calls add up until `optim_step`, whose Adam
hyperparameters come with each call. No Monarch here (the actor shell is
`forge_rl.actors.service_trainer`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from forge_rl.training.tinker_losses import REQUIRED_INPUTS, config_of, elementwise_loss
from forge_rl.training.trainer import PolicyTrainer

MAX_TOKENS_PER_FORWARD = 8192
"""Token slots (rows x longest row) of one forward: a call's datums are split into chunks of at
most this many, each forward and backward on its own, so the logits ([slots, vocabulary] fp32)
stay bounded whatever the call's size."""


@dataclass
class _TenantState:
    """What a tenant owns while another is live; None entries are held by the live tensors."""

    adapters: dict[str, torch.Tensor]
    frozen: frozenset[str] = frozenset()
    """Adapter parameters the tenant does not train (layers its LoRA config leaves out): their B
    stays zero, so they add nothing to its model."""
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    moments: dict[str, dict] = field(default_factory=dict)
    num_steps: int = 0


class TenantTrainer:
    """The adapters of every tenant over one `PolicyTrainer`'s base (its config must enable LoRA).
    Every method is a collective under data or tensor parallelism: call it on every rank, with
    the same arguments, in the same order."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        if trainer.lora is None:
            raise ValueError("the service trains LoRA tenants on a frozen base: trainer.lora.enabled must be true.")
        self.trainer = trainer
        self.lora = trainer.lora
        self._params = self.lora.named_adapter_parameters()
        self._tenants: dict[str, _TenantState] = {}
        self._live: str | None = None

    @property
    def rank(self) -> int:
        return self.lora.config.rank

    def add_tenant(self, tenant: str, seed: int, frozen_targets: tuple[str, ...] = ()) -> None:
        """A new tenant whose adapters start as LoRA's do (A from `seed`, B zero): as the base.
        `frozen_targets`: layer names (trainer.lora.targets entries) whose adapters this tenant
        does not train (the Tinker API's train_attn / train_mlp / train_unembed set to false)."""
        if tenant in self._tenants:
            raise ValueError(f"tenant {tenant!r} exists already")
        unknown = sorted(set(frozen_targets) - set(self.lora.config.targets))
        if unknown:
            raise ValueError(
                f"frozen targets {unknown} are not adapted here (trainer.lora.targets {list(self.lora.config.targets)})"
            )
        frozen = frozenset(name for name in self._params if name.rsplit(".", 2)[-2] in frozen_targets)
        self._tenants[tenant] = _TenantState(adapters=self.lora.initial_state(seed), frozen=frozen)

    def remove_tenant(self, tenant: str) -> None:
        self._state(tenant)
        if self._live == tenant:
            self._clear_live()
            self._live = None
        del self._tenants[tenant]

    def forward_backward(
        self,
        tenant: str,
        data: Sequence[tuple[Sequence[int], Mapping[str, np.ndarray]]],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None,
        backward: bool,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """The loss `loss_fn` on `data` (each datum: its input tokens and its loss_fn_inputs); with
        `backward` its gradients are added to the tenant's. Returns each datum's "logprobs" and
        "elementwise_loss" and the metrics ("loss:sum"). ValueError naming a datum that lacks an
        input, or inputs of the wrong length, before anything runs."""
        config = config_of(loss_fn, loss_fn_config)
        _check_data(data, loss_fn)
        self.activate(tenant)
        started = time.perf_counter()
        trainer = self.trainer
        dp_rank, dp_size = trainer._dp_rank, trainer._dp_size
        # Datums go round-robin over data-parallel ranks; each rank's loss is a sum, and the
        # adapters' gradients are summed over those ranks (LoRAAdapters.reduce_gradients).
        mine = list(range(dp_rank, len(data), dp_size))
        outputs: dict[int, dict[str, np.ndarray]] = {}
        loss_sum = 0.0
        for chunk in _chunks(mine, [len(data[i][0]) for i in mine]):
            chunk_loss, chunk_outputs = self._forward_chunk([data[i] for i in chunk], loss_fn, config, backward)
            loss_sum += chunk_loss
            outputs.update(zip(chunk, chunk_outputs))
        if backward:
            self.lora.reduce_gradients(trainer._dp_group)
        if trainer._dp_group is not None and dp_size > 1:
            gathered: list = [None] * dp_size
            dist.all_gather_object(gathered, (loss_sum, outputs), group=trainer._dp_group)
            loss_sum = sum(part[0] for part in gathered)
            for part in gathered:
                outputs.update(part[1])
        # Tinker names each metric with how chunks of one call combine ("name:reduction").
        metrics = {"loss:sum": loss_sum, "forward_backward_s:sum": time.perf_counter() - started}
        return [outputs[i] for i in range(len(data))], metrics

    def _forward_chunk(
        self, data: list[tuple[Sequence[int], Mapping[str, np.ndarray]]], loss_fn: str, config: dict, backward: bool
    ) -> tuple[float, list[dict[str, np.ndarray]]]:
        trainer = self.trainer
        lengths = [len(tokens) for tokens, _ in data]
        width = max(lengths)
        ids_NL = torch.zeros(len(data), width, dtype=torch.long)
        for row, (tokens, _) in enumerate(data):
            ids_NL[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
        mask_NL = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(trainer.device)
        names = REQUIRED_INPUTS[loss_fn]
        inputs = {name: _padded([inputs[name] for _, inputs in data], width).to(trainer.device) for name in names}
        targets_NL = inputs.pop("target_tokens").long()
        with torch.set_grad_enabled(backward):
            logits_NLV = trainer._logits(ids_NL)
            logprobs_NL = torch.log_softmax(logits_NLV, dim=-1).gather(-1, targets_NL.unsqueeze(-1)).squeeze(-1)
            del logits_NLV
            loss_NL = elementwise_loss(loss_fn, logprobs_NL, {**inputs, "target_tokens": targets_NL}, mask_NL, config)
            loss = loss_NL.sum()
            if backward:
                loss.backward()
        logprobs, losses = logprobs_NL.detach().cpu().numpy(), loss_NL.detach().cpu().numpy()
        outputs = [
            {
                "logprobs": logprobs[row, :length].astype(np.float32),
                "elementwise_loss": losses[row, :length].astype(np.float32),
            }
            for row, length in enumerate(lengths)
        ]
        return float(loss.item()), outputs

    def optim_step(
        self,
        tenant: str,
        learning_rate: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip_norm: float,
    ) -> dict[str, float]:
        """One AdamW step of the tenant's adapters on the gradients added since its last, with
        these hyperparameters; the gradients are then cleared. `grad_clip_norm` 0: no clipping. A
        non-finite gradient norm skips the step (nothing moves; `step_skipped` 1)."""
        from torchtitan.distributed.utils import clip_grad_norm_

        self.activate(tenant)
        started = time.perf_counter()
        optimizer = self.trainer.optimizer
        for group in optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        for name in self._tenants[tenant].frozen:  # no gradient: AdamW leaves them where they are
            self._params[name].grad = None
        params = list(self._params.values())
        params = [p for p in params if p.grad is not None]
        if not params:
            return {"grad_norm": 0.0, "step_skipped": 0.0, "optim_step_s": 0.0}
        max_norm = grad_clip_norm if grad_clip_norm > 0 else math.inf
        norm = float(clip_grad_norm_(params, max_norm, foreach=True).item())
        skipped = not math.isfinite(norm)
        if not skipped:
            optimizer.step()
            self._tenants[tenant].num_steps += 1
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "step_skipped": float(skipped), "optim_step_s": time.perf_counter() - started}

    def adapter_state_dict(self, tenant: str, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
        """The tenant's adapters, full CPU copies (`LoRAAdapters.adapter_state_dict`)."""
        self.activate(tenant)
        return self.lora.adapter_state_dict(dtype, keep)

    def num_steps(self, tenant: str) -> int:
        return self._state(tenant).num_steps

    def reset_optimizer(self, tenant: str) -> None:
        """Drop the tenant's AdamW moments (a load of weights without the optimizer state)."""
        self.activate(tenant)
        for param in self._params.values():
            self.trainer.optimizer.state.pop(param, None)

    def _state(self, tenant: str) -> _TenantState:
        try:
            return self._tenants[tenant]
        except KeyError:
            raise ValueError(f"unknown tenant {tenant!r}; the trainer holds {sorted(self._tenants)}") from None

    def activate(self, tenant: str) -> None:
        """Make `tenant` live: every call does first; the trainer's own checkpoint calls then save
        or load its state."""
        incoming = self._state(tenant)
        if self._live == tenant:
            return
        if self._live is not None:
            outgoing = self._tenants[self._live]
            with torch.no_grad():
                outgoing.adapters = {name: p.detach().clone() for name, p in self._params.items()}
            outgoing.grads = {name: p.grad for name, p in self._params.items()}
            outgoing.moments = {name: self.trainer.optimizer.state.pop(p, {}) for name, p in self._params.items()}
        self._clear_live()
        with torch.no_grad():
            for name, param in self._params.items():
                param.copy_(incoming.adapters[name])
        for name, param in self._params.items():
            param.grad = incoming.grads.get(name)
            if incoming.moments.get(name):
                self.trainer.optimizer.state[param] = incoming.moments[name]
        # The live tensors hold them now: no second copy.
        incoming.adapters, incoming.grads, incoming.moments = {}, {}, {}
        self._live = tenant

    def _clear_live(self) -> None:
        for param in self._params.values():
            param.grad = None
            self.trainer.optimizer.state.pop(param, None)


def _check_data(data: Sequence[tuple[Sequence[int], Mapping[str, np.ndarray]]], loss_fn: str) -> None:
    if loss_fn not in REQUIRED_INPUTS:
        raise ValueError(f"unknown loss {loss_fn!r}; the trainer computes {', '.join(REQUIRED_INPUTS)}.")
    if not data:
        raise ValueError("forward_backward got no datums: pass at least one.")
    for index, (tokens, inputs) in enumerate(data):
        missing = [name for name in REQUIRED_INPUTS[loss_fn] if name not in inputs]
        if missing:
            raise ValueError(
                f"datum {index} lacks loss_fn_inputs {missing}, which the {loss_fn!r} loss needs "
                f"({', '.join(REQUIRED_INPUTS[loss_fn])}); it has {sorted(inputs)}."
            )
        if not tokens:
            raise ValueError(f"datum {index} has an empty model_input: give it at least one token.")
        for name in REQUIRED_INPUTS[loss_fn]:
            if np.asarray(inputs[name]).reshape(-1).shape[0] != len(tokens):
                raise ValueError(
                    f"datum {index}: loss_fn_inputs[{name!r}] has {np.asarray(inputs[name]).size} entries but the "
                    f"model_input has {len(tokens)} tokens; each input needs one entry per input token "
                    "(position i holds what token i predicts)."
                )


def _chunks(indexes: list[int], lengths: list[int]) -> list[list[int]]:
    """`indexes` in order, in runs whose rows x longest row stays within MAX_TOKENS_PER_FORWARD."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in zip(indexes, lengths):
        if current and (len(current) + 1) * max(longest, length) > MAX_TOKENS_PER_FORWARD:
            chunks.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        chunks.append(current)
    return chunks


def _padded(rows: list[np.ndarray], width: int) -> torch.Tensor:
    dtype = torch.long if np.asarray(rows[0]).dtype.kind in "iu" else torch.float32
    out = torch.zeros(len(rows), width, dtype=dtype)
    for row, values in enumerate(rows):
        values = torch.as_tensor(np.array(values).reshape(-1), dtype=dtype)  # a copy: wire arrays are read-only
        out[row, : values.shape[0]] = values
    return out
