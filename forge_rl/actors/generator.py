"""Generator shell: one vLLM engine per actor, many requests in flight, weight swaps in between.

`generate` and `update_weights` are concurrent endpoints: a swap pauses the engine at a decode-step
boundary (vLLM's pause in "keep" mode), reloads the newest snapshot and resumes, so requests in
flight continue and their later tokens carry the new policy version.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import psutil
from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.engines.vllm_engine import GeneratorConfig, VLLMEngine
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode


class GeneratorActor(Actor):
    def __init__(self, config: GeneratorConfig, model_dir: str, max_model_len: int):
        self.engine = VLLMEngine(config)
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.tokenizer = PromptTokenizer(self.model_dir)
        # One swap at a time; a swap for an older version than the loaded one is a no-op.
        self.swap_lock = asyncio.Lock()
        self.num_generated_tokens = 0
        self.busy_s = 0.0

    @endpoint
    async def start(self) -> dict:
        started = time.perf_counter()
        await self.engine.start(self.model_dir, self.max_model_len)
        # vLLM's engine-core and worker processes: the pool watches them too, since the engine can
        # die while this actor lives on.
        engine_pids = [p.pid for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
        return {"engine_start_s": time.perf_counter() - started, "pid": os.getpid(), "engine_pids": engine_pids}

    @concurrent_endpoint
    async def generate(self, episodes: list[Episode], group_size: int) -> list[Episode]:
        started = time.perf_counter()
        groups = await asyncio.gather(
            *(
                self.engine.generate(e.prompt_token_ids, group_size, self.tokenizer.eos_id, e.forced_length)
                for e in episodes
            )
        )
        for episode, completions in zip(episodes, groups):
            for completion in completions:
                completion.text = self.tokenizer.decode(completion.token_ids)
                self.num_generated_tokens += completion.num_tokens
            episode.completions = completions
        self.busy_s += time.perf_counter() - started
        return episodes

    @concurrent_endpoint
    async def update_weights(self, policy_version: int, weights_dir: str) -> dict:
        """Loads `weights_dir` as `policy_version` unless a newer version is already served."""
        async with self.swap_lock:
            if policy_version <= self.engine.policy_version:
                return {"policy_version": self.engine.policy_version, "stall_s": 0.0, "load_s": 0.0}
            started = time.perf_counter()
            stall_s = await self.engine.load_weights(Path(weights_dir), policy_version)
            return {
                "policy_version": policy_version,
                "stall_s": stall_s,
                "load_s": time.perf_counter() - started,
            }

    @endpoint
    async def stats(self) -> dict:
        return {
            "policy_version": self.engine.policy_version,
            "generated_tokens": self.num_generated_tokens,
            "busy_s": self.busy_s,
        }

    @endpoint
    async def shutdown(self) -> None:
        await self.engine.shutdown()
