"""What a generator asks of its engine (`Engine`): vLLM's (`forge_rl.engines.vllm_engine.VLLMEngine`) and
the simulated one (`forge_rl.engines.simulated.SimulatedEngine`) both meet it, so the generator actor
calls either the same way and never asks which it holds.

What only a real model can do (segments, branches, the service's sampling and adapters) the simulated
engine refuses with `EngineCannot`, naming the setting that asked for it. `GRPOConfig` refuses
segments and branches with a simulated engine before anything starts; the error is what code that
calls the engine directly meets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forge_rl.types import Completion, SampleResult, SampleSpec

if TYPE_CHECKING:
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.envs.runner import SampledTurn


class EngineCannot(TypeError):
    """An engine was asked for what it does not do (the simulated engine: anything that needs a model)."""


class Engine(Protocol):
    policy_version: int
    """The version of the weights it serves now: the label of every token it samples from here on."""

    @property
    def config(self) -> GeneratorConfig: ...

    async def start(self, model_dir: Path, max_model_len: int) -> None:
        """Start serving the model in `model_dir` with contexts of up to `max_model_len` tokens."""
        ...

    def process_ids(self) -> list[int]:
        """The processes it started (a generator's pool watches them: they can die while it lives)."""
        ...

    async def worker_devices(self) -> list[dict]: ...

    async def forward_time(self) -> dict:
        """The model's time since the engine started ({} where there is no model)."""
        ...

    def tokens_in_flight(self) -> int:
        """Tokens its requests in flight have sampled so far: what its death would lose."""
        ...

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        eos_id: int | None,
        forced_length: int | None = None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[Completion]:
        """`n` completions of one prompt, each token stamped with the version that sampled it."""
        ...

    async def generate_turn(
        self, prefix_token_ids: list[int], max_new_tokens: int, *, eos_id: int | None
    ) -> SampledTurn:
        """One turn after exactly `prefix_token_ids` (the `generate` of `forge_rl.envs.runner`)."""
        ...

    async def generate_segment(
        self,
        prompt_token_ids: list[int],
        heads: list[list[int]] | None,
        n: int,
        eos_id: int | None,
        forced_length: int | None,
        segment_tokens: int,
    ) -> list[tuple[Completion, bool]]:
        """Up to `segment_tokens` more tokens of each head (generator.segment_tokens)."""
        ...

    async def generate_branches(
        self, prompt_token_ids: list[int], heads: list[list[int]], n: int, eos_id: int | None, forced_length: int | None
    ) -> list[tuple[list[Completion], int]]:
        """`n` continuations of each head (branch rollouts)."""
        ...

    async def sample(
        self, prompt_token_ids: list[int], spec: SampleSpec, adapter_version: int, eos_id: int | None
    ) -> SampleResult:
        """The service's sampling with the adapter of `adapter_version`."""
        ...

    async def serve_adapter(self, adapter_dir: Path, policy_version: int, adapter_of: str | None) -> None:
        """Load the adapter of `policy_version` beside those it serves."""
        ...

    async def serve_version(self, policy_version: int, open_store: Callable[[], Awaitable[Any]], exact: bool) -> dict:
        """Serve `policy_version` (`exact`), or the newest complete version after it, from the weight
        store `open_store` opens; returns the update's metrics (`forge_rl.store.loader.load_version`)."""
        ...

    async def shutdown(self) -> None: ...
