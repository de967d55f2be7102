"""Generator shell: one vLLM engine per actor, many requests in flight, weight swaps in between.

`generate` and `update_weights` are concurrent endpoints: an update waits for the version in the
weight store, stages it in the engine while decoding continues, then swaps at a decode-step
boundary (vLLM's pause in "keep" mode), so requests in flight continue and their later tokens
carry the new policy version (`forge_rl.store.loader`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.engines.adapters import BASE_MODEL, AdapterNotResident, AdapterServing
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.engine import Engine
from forge_rl.engines.simulated import SimulatedEngine
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.envs.runner import SampledTurn
from forge_rl.plumbing.cpu_affinity import pin_this_process, yield_this_process
from forge_rl.plumbing.native_heap import trim_native_heap_if_due
from forge_rl.plumbing.port_calls import PortServed
from forge_rl.plumbing.preemption import wait_for_preemption_notice
from forge_rl.store.index import ADAPTER_OF, version_key
from forge_rl.store.loader import LOAD_S, STALL_S
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Completion, Episode, SampleResult, SampleSpec

if TYPE_CHECKING:
    # Imported where used: the store's client imports torch (a process with it is resident several
    # times larger than with Monarch alone), which a simulated generator never needs; that
    # difference is what lets 128 simulated generators fit in one machine's memory (`forge-rl bench scale`).
    from forge_rl.store.actors import StoreIndexActor
    from forge_rl.store.client import WeightStore


class GeneratorActor(PortServed, Actor):
    def __init__(
        self,
        config: GeneratorConfig,
        model_dir: str,
        max_model_len: int,
        store_index: StoreIndexActor | None,
        store_client_id: str,
        cuda_devices: tuple[int, ...] | None = None,
        adapters: AdapterServing | None = None,
        cpus: tuple[int, ...] | None = None,
        store_root: str | None = None,
    ):
        # `store_client_id`: this actor's name as a weight-store reader, given by its owner (the
        # pool), which drops its leases if it dies holding some. `cuda_devices`: this generator's
        # block of its host's GPUs (`forge_rl.plumbing.placement`); the engine's processes see only those.
        # Ignored on CPU. generator.engine sim: a simulated engine in this process (no model, no
        # weights: `store_index` is None). `adapters`: serve versions as LoRA adapters (trainer.lora).
        # `cpus`: the cores of this process and of the engine processes it starts
        # (launch.placement.generator_cpus), pinned before the engine exists so they inherit them.
        # `store_root`: the weight store its versions are loaded from (None: a simulated engine).
        # A simulated generator stands in for an engine on a host of its own: it yields this
        # machine's cores to the control plane it is measured against (SimEngineConfig.idle_priority).
        self.cpus = pin_this_process(cpus)
        if config.yields_the_cores:
            yield_this_process()
        self.engine: Engine = (
            SimulatedEngine(config) if config.engine == "sim" else VLLMEngine(config, cuda_devices, adapters)
        )
        self.store_index = store_index
        self.store_root = None if store_root is None else Path(store_root)
        self.store_client_id = store_client_id
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.tokenizer = PromptTokenizer(self.model_dir)
        # One swap at a time; a swap for an older version than the loaded one is a no-op. A
        # pinned generate call holds it too, so no swap starts under it.
        self.swap_lock = asyncio.Lock()
        self._version_served: asyncio.Condition | None = None
        """Notified after each weight update (`generate_pinned` waits on it for its version)."""
        self.store: WeightStore | None = None

    @endpoint
    async def start(self) -> dict:
        started = time.perf_counter()
        await self.engine.start(self.model_dir, self.max_model_len)
        # vLLM's engine-core and worker processes: the pool watches them too, since the engine can
        # die while this actor lives on.
        return {
            "engine_start_s": time.perf_counter() - started,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "engine_pids": self.engine.process_ids(),
            "devices": await self.engine.worker_devices(),
            "cpus": self.cpus,
        }

    @concurrent_endpoint
    async def forward_time(self) -> dict:
        """The engine's model time since it started ({} for a simulated engine)."""
        return await self.engine.forward_time()

    @concurrent_endpoint
    async def preemption_notice(self) -> dict | None:
        """Returns once this process's host got a preemption notice (its worker's SIGTERM:
        `forge_rl.plumbing.preemption`), with the grace left; None at once off a worker."""
        return await wait_for_preemption_notice()

    @concurrent_endpoint
    async def tokens_in_flight(self) -> int:
        """Tokens its requests in flight have sampled so far (`VLLMEngine.tokens_in_flight`): what
        its death would lose (`forge-rl bench faults`)."""
        return self.engine.tokens_in_flight()

    @concurrent_endpoint
    async def generate(self, episodes: list[Episode], group_size: int) -> list[Episode]:
        groups = await asyncio.gather(
            *(
                self.engine.generate(e.prompt_token_ids, group_size, self.tokenizer.eos_id, e.forced_length)
                for e in episodes
            )
        )
        return self._with_completions(episodes, groups, self.engine.config.temperature)

    @concurrent_endpoint
    async def generate_segment(
        self,
        prompt_token_ids: list[int],
        forced_length: int | None,
        heads: list[list[int]] | None,
        group_size: int,
        segment_tokens: int,
    ) -> list[tuple[Completion, bool]]:
        """One segment of a group (`VLLMEngine.generate_segment`): each piece with whether its
        completion is finished; a finished one's text is its whole completion's (head and piece)."""
        return await self._segment(prompt_token_ids, forced_length, heads, group_size, segment_tokens)

    async def _segment(
        self,
        prompt_token_ids: list[int],
        forced_length: int | None,
        heads: list[list[int]] | None,
        group_size: int,
        segment_tokens: int,
    ) -> list[tuple[Completion, bool]]:
        pieces = await self.engine.generate_segment(
            prompt_token_ids, heads, group_size, self.tokenizer.eos_id, forced_length, segment_tokens
        )
        for i, (piece, finished) in enumerate(pieces):
            if finished:
                piece.text = self.tokenizer.decode((heads[i] if heads else []) + piece.token_ids)
        return pieces

    @concurrent_endpoint
    async def generate_branches(
        self, prompt_token_ids: list[int], forced_length: int | None, heads: list[list[int]], n: int
    ) -> list[tuple[list[Completion], int]]:
        """`n` continuations of each head (`VLLMEngine.generate_branches`), each with its whole
        sequence's text (head and continuation), and per head its prefix-cache hits."""
        branched = await self.engine.generate_branches(prompt_token_ids, heads, n, self.tokenizer.eos_id, forced_length)
        for head, (pieces, _) in zip(heads, branched):
            for piece in pieces:
                piece.text = self.tokenizer.decode(head + piece.token_ids)
        return branched

    @concurrent_endpoint
    async def generate_pinned(
        self,
        policy_version: int,
        episodes: list[Episode],
        group_size: int,
        temperature: float,
        max_new_tokens: int,
        max_in_flight: int,
    ) -> list[Episode] | None:
        """`generate` with `temperature` and `max_new_tokens`, while this generator serves exactly
        `policy_version`: it waits until the generator serves it, and no weight update starts
        until the call ends (they wait behind it; the run's requests keep decoding, on this
        version). At most `max_in_flight` of the episodes decode at once, beside the run's own
        requests. None if the generator serves a newer version already: the call cannot be made.
        An evaluation beside training on the run's generators (`forge_rl.run.evaluation`)."""
        async with self.version_served:
            await self.version_served.wait_for(lambda: self.engine.policy_version >= policy_version)
        async with self.swap_lock:
            if self.engine.policy_version != policy_version:
                return None
            in_flight = asyncio.Semaphore(max_in_flight)

            async def sampled(episode: Episode) -> list:
                async with in_flight:
                    return await self.engine.generate(
                        episode.prompt_token_ids,
                        group_size,
                        self.tokenizer.eos_id,
                        temperature=temperature,
                        max_new_tokens=max_new_tokens,
                    )

            groups = await asyncio.gather(*(sampled(e) for e in episodes))
        return self._with_completions(episodes, groups, temperature)

    def _with_completions(self, episodes: list[Episode], groups: list[list], temperature: float) -> list[Episode]:
        """`episodes` with each one's sampled group as its completions, their text decoded."""
        for episode, completions in zip(episodes, groups):
            for completion in completions:
                completion.text = self.tokenizer.decode(completion.token_ids)
            episode.completions = completions
            episode.temperature = temperature
        return episodes

    @property
    def version_served(self) -> asyncio.Condition:
        if self._version_served is None:  # bound to the actor's running loop on first use
            self._version_served = asyncio.Condition()
        return self._version_served

    @concurrent_endpoint
    async def sample(self, prompt_token_ids: list[int], spec: SampleSpec, policy_version: int | None) -> SampleResult:
        """The service's sampling (`forge_rl.service.meshes`): `VLLMEngine.sample` with the
        adapter of `policy_version` (None: the base), which this generator loads from its weight
        store first if it does not hold it, beside the adapters it serves."""
        version = BASE_MODEL if policy_version is None else policy_version
        while True:
            try:
                return await self.engine.sample(prompt_token_ids, spec, version, self.tokenizer.eos_id)
            except AdapterNotResident:
                if policy_version is None:
                    raise  # the base model is always resident: only an adapter version is loaded
                await self._serve_adapter(version)

    async def _serve_adapter(self, policy_version: int) -> None:
        async with self.swap_lock:
            store = await self._weight_store()
            async with store.lease(version_key(policy_version)) as snapshot:  # vLLM reads it in add_lora
                await self.engine.serve_adapter(Path(snapshot.path), policy_version, snapshot.info.get(ADAPTER_OF))

    @concurrent_endpoint
    async def generate_turn(self, prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        """One turn of an environment episode after exactly `prefix_token_ids` (the rollout loop's
        `generate` for `forge_rl.envs.runner`); raises ContextExhausted when the context is full."""
        return await self.engine.generate_turn(prefix_token_ids, max_new_tokens, eos_id=self.tokenizer.eos_id)

    @concurrent_endpoint
    async def update_weights(self, policy_version: int, exact: bool = False) -> dict:
        """Serve `policy_version`, or the newest complete version after it, from this generator's
        weight store; `exact`: that version itself (an evaluation's generator, `load_version`).

        The version may still be being written: the store says when it is complete, and keeps it
        until loaded. Prefetch and staging run while the engine decodes; the swap itself happens
        per `GeneratorConfig.swap_mode`. Returns the update's metrics (`forge_rl.store.loader`).
        """
        trim_native_heap_if_due()  # once a minute at most, at a weight update
        async with self.swap_lock:
            if policy_version <= self.engine.policy_version:
                return {"policy_version": self.engine.policy_version, STALL_S: 0.0, LOAD_S: 0.0}
            loaded = await self.engine.serve_version(policy_version, self._weight_store, exact)
        async with self.version_served:
            self.version_served.notify_all()
        return loaded

    async def _weight_store(self) -> WeightStore:
        from forge_rl.store.client import WeightStore

        if self.store_root is None:
            raise RuntimeError("this generator was started without a weight store (a simulated engine loads none)")
        if self.store is None:
            self.store = WeightStore(
                self.store_index, self.store_root, self.store_client_id, extra_files_dir=self.model_dir
            )
        return self.store

    @endpoint
    async def shutdown(self) -> None:
        await self._stop_engine_and_store()

    async def __cleanup__(self, exc: Exception | None) -> None:
        # Also when the actor is stopped without `shutdown`: its pool retiring it as hung. Else
        # vLLM's AsyncLLM.__del__ stops the engine at interpreter exit and prints a traceback.
        await self._stop_engine_and_store()

    async def _stop_engine_and_store(self) -> None:
        await self.engine.shutdown()
        if self.store is not None:  # leases of an update cut short, fetched copies
            await self.store.close()
            self.store = None
