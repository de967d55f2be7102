"""The rollouts' actor: the run's data plane (`forge_rl.pipeline.rollouts`) in a process of its own.

The rollout loops, the admission gate, the replay buffer and the prompts live here, one event loop
for all of them; the controller's train loop calls `step_done` once per step (and `batch_taken` for a
step slower than its timeout, or at a stop), and each trainer rank `batch_for_trainer`. Its own process, not the controller's: the rollouts' calls
(one per prompt to the generator pool, one to the scoring stage, one per generator and version to
swap weights) then leave the controller's event loop free for the train loop, and no other role's
work (the pool's relay, the store's index) delays them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from monarch.actor import Actor, concurrent_endpoint

from forge_rl.envs.renderers import make_renderer
from forge_rl.pipeline.prompts import PromptSource
from forge_rl.pipeline.rollouts import RolloutActors, Rollouts
from forge_rl.plumbing.gc_freeze import freeze_startup_objects
from forge_rl.plumbing.native_heap import trim_native_heap_if_due
from forge_rl.plumbing.port_calls import PortCalled, PortCalls, PortServed
from forge_rl.training.trainer_steps import PulledBatch

if TYPE_CHECKING:
    from forge_rl.actors.generator_pool import GeneratorPool
    from forge_rl.actors.scoring_stage import ScoringStage
    from forge_rl.config import GRPOConfig


class RolloutsActor(PortServed, Actor):
    def __init__(
        self,
        config: GRPOConfig,
        model_dir: str,
        generators: GeneratorPool,
        scoring: ScoringStage,
        policy_generators: dict[str, GeneratorPool] | None = None,
    ):
        # `scoring`: the recipe's stage, its actors' handles (its after_publish, which the
        # controller runs, is left out: a closure does not cross processes). The pool's calls, a
        # generate per prompt, are answered on one port (`forge_rl.plumbing.port_calls`).
        # `policy_generators`: the pool of each of config.policies, by name.
        renderer = None
        if config.environment.name is not None:
            renderer = make_renderer(config.environment.renderer, Path(model_dir), config.environment.tool_call_parser)
        self.rollouts = Rollouts(
            config,
            RolloutActors(
                generators=PortCalled(generators, PortCalls()),
                score=scoring.score,
                stats=scoring.stats,
                renderer=renderer,
                policy_generators={
                    name: PortCalled(pool, PortCalls()) for name, pool in (policy_generators or {}).items()
                },
            ),
            PromptSource(
                config.task,
                model_dir,
                config.generator.max_new_tokens,
                config.data,
                config.max_model_len if config.data is not None else None,
            ),
        )

    @concurrent_endpoint
    async def process_id(self) -> int:
        return os.getpid()

    @concurrent_endpoint
    async def start(self, timeline_path: str | None, origin_unix_time: float) -> None:
        # The process's startup objects (Monarch, the tokenizer, the configs) out of the collector's
        # full scans before the loops start, as in the trainer (`forge_rl.plumbing.gc_freeze`): with
        # many generators this loop is the control plane's busiest, and a full collection scanning
        # them stalls every generator's next request.
        freeze_startup_objects()
        self.rollouts.start(None if timeline_path is None else Path(timeline_path), origin_unix_time)

    @concurrent_endpoint
    async def wait_for_failure(self) -> None:
        await self.rollouts.wait_for_failure()

    @concurrent_endpoint
    async def batch_for_trainer(self, step: int, num_ranks: int, policy: str | None = None) -> PulledBatch | None:
        return await self.rollouts.batch_for_trainer(step, num_ranks, policy)

    @concurrent_endpoint
    async def batch_taken(self, step: int) -> float | None:
        return await self.rollouts.batch_taken(step)

    @concurrent_endpoint
    async def withhold_batch(self, step: int) -> None:
        await self.rollouts.withhold_batch(step)

    @concurrent_endpoint
    async def step_done(
        self, step: int, skipped: bool, policy_version: int, policies: dict[str, tuple[bool, int]] | None = None
    ) -> dict:
        trim_native_heap_if_due()  # once a minute at most
        return await self.rollouts.step_done(step, skipped, policy_version, policies)

    @concurrent_endpoint
    async def stop_loops(self, finish_updates: bool) -> dict:
        return await self.rollouts.stop_loops(finish_updates)

    @concurrent_endpoint
    async def state_dict(self, include_episodes: bool) -> dict:
        return self.rollouts.state_dict(include_episodes)

    @concurrent_endpoint
    async def load_state_dict(self, state: dict, policy_version: int, policies: dict[str, int] | None = None) -> int:
        return await self.rollouts.load_state_dict(state, policy_version, policies)

    @concurrent_endpoint
    async def add_generator(self) -> dict:
        return await self.rollouts.add_generator()

    @concurrent_endpoint
    async def remove_generator(self, index: int, grace_s: float) -> dict:
        return await self.rollouts.remove_generator(index, grace_s)

    @concurrent_endpoint
    async def generators(self) -> list[int]:
        """The generators in the pool now, by index."""
        return list(self.rollouts.generators)
