"""What the service asks of the meshes: the four primitives of a user's own loop (forward_backward,
optim_step, save weights for the sampler, sample) and what surrounds them, in forge_rl's own terms.

The HTTP face (`forge_rl.service.server`) turns the Tinker API's requests into these calls and
their results back into its responses; the meshes (`forge_rl.service.meshes`: the TorchTitan
trainer, the vLLM generators and the weight store) answer them. Neither side knows the other's
details: the wire format stays in the face, Monarch and the actors in the meshes.

A refused request raises `RequestRefused` (the client's fault: it names the field, the value and the
fix; the face answers 4xx, or fails the future with the "user" category); anything else the
backend raises is a server failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from forge_rl.training.tinker_losses import REQUIRED_INPUTS
from forge_rl.types import SampledSequence, SampleResult, SampleSpec, TopK

__all__ = [
    "LOSS_FUNCTIONS",
    "AdamStep",
    "ForwardBackwardResult",
    "LoraSpec",
    "RequestRefused",
    "SampleResult",
    "SampleSpec",
    "SampledSequence",
    "SavedWeights",
    "ServiceBackend",
    "TopK",
    "TrainingDatum",
]

LOSS_FUNCTIONS = tuple(REQUIRED_INPUTS)
"""The Tinker losses the trainer computes (`forge_rl.training.tinker_losses`); the SDK's others
("gspo", "stable_reinforce", "custom") are refused by name."""


class RequestRefused(ValueError):
    """A request the service cannot carry out as sent: its message names the field, the value and
    the fix. `status` is the HTTP status the face answers with when it refuses it at once."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoraSpec:
    """A training model: a LoRA adapter of its own over the served base."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class TrainingDatum:
    """One sequence of a forward or forward_backward call."""

    tokens: list[int]
    """The model input, token ids."""
    inputs: dict[str, np.ndarray]
    """The loss's inputs by name (target_tokens int64, weights, logprobs, advantages float32, ...),
    dense, each as long as `tokens`."""


@dataclass(frozen=True)
class ForwardBackwardResult:
    outputs: list[dict[str, np.ndarray]]
    """Per datum: "logprobs" (float32, the target tokens' logprobs under the weights before the
    step) and "elementwise_loss" (float32, each position's weighted loss)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Tinker's names: "loss:sum" and the loss's own."""


@dataclass(frozen=True)
class AdamStep:
    """One optimizer step's hyperparameters (Tinker's AdamParams)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """0: no clipping."""


@dataclass(frozen=True)
class SavedWeights:
    path: str
    """The tinker:// path the client passes back (to sample, to load)."""
    policy_version: int
    """The weight store's version behind it."""


class ServiceBackend(Protocol):
    """The meshes behind `forge-rl serve`. Every call may run concurrently with others; calls on
    one training model are carried out in the order they were made."""

    base_model: str
    """The served base model's name, as clients give it (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct")."""
    max_context_length: int
    tokenizer_id: str
    """What clients load the base model's tokenizer from (the SDK's get_tokenizer passes it to
    transformers' AutoTokenizer): a hub name, or the served model's directory."""

    async def create_model(self, lora: LoraSpec) -> str:
        """A new training model; returns its id."""
        ...

    async def forward_backward(
        self,
        model_id: str,
        data: list[TrainingDatum],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        backward: bool,
    ) -> ForwardBackwardResult:
        """The loss `loss_fn` on `data`; `backward`: its gradients are added to the model's (until
        the next optim_step)."""
        ...

    async def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        """One Adam step on the gradients added since the last; they are then cleared."""
        ...

    async def save_for_sampler(
        self, model_id: str, name: str | None, kind: Literal["snapshot", "inflight"]
    ) -> SavedWeights:
        """The model's current weights as a version in the weight store that generators can serve."""
        ...

    async def sample(self, model_path: str | None, spec: SampleSpec) -> SampleResult:
        """`spec.num_samples` continuations of `spec.prompt` by the weights saved at `model_path`
        (None: the base model)."""
        ...

    async def save_state(self, model_id: str, name: str) -> SavedWeights:
        """Weights and optimizer state, to resume from (`load_state`)."""
        ...

    async def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None: ...

    def model_info(self, model_id: str) -> LoraSpec:
        """The training model's LoRA spec; RequestRefused (404) for an unknown id."""
        ...

    async def unload_model(self, model_id: str) -> None: ...
