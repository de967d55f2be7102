"""A SIMULATED trainer shell (`trainer.engine: sim`): the TrainerActor's endpoints with no model.

Each step waits `SimTrainerConfig.step_s(tokens in the batch)` (`forge_rl.engines.simulated` has
the calibration) and advances the policy version; nothing is published to the weight store, since
the simulated generators (`generator.engine: sim`) load no weights, only version numbers. For
testing the control plane at scale only: it trains nothing, and never replaces the real trainer
in the demo, the recipes' defaults or the integration tests of the real path.
"""

from __future__ import annotations

import asyncio
import os
import time

from monarch.actor import Actor, endpoint

from forge_rl.core.columns import BatchColumns, batch_columns
from forge_rl.errors import ConfigError
from forge_rl.observability import metric_names as m
from forge_rl.plumbing.port_calls import PortCalled, PortCalls, PortServed
from forge_rl.training.trainer_config import TrainerConfig
from forge_rl.training.trainer_steps import (
    BatchPrefetch,
    PulledStep,
    StepTurns,
    TrainStepResult,
    train_pulled_batch_in_turn,
)
from forge_rl.types import Episode


class SimulatedTrainerActor(PortServed, Actor):
    def __init__(self, config: TrainerConfig, *_unused):
        # Spawned with the TrainerActor's arguments (model_dir, store, ...), which it does not need.
        self.config = config
        self.policy_version = 0
        self._turns = StepTurns()
        self._prefetch = BatchPrefetch()
        self._calls = PortCalls()  # each step's batch_for_trainer (`forge_rl.plumbing.port_calls`)

    @endpoint
    async def setup(self) -> dict:
        return {"trainer_setup_s": 0.0, "pid": os.getpid(), "simulated": True}

    @endpoint  # as the TrainerActor's
    async def train_next_step(self, step: int, rollouts, num_ranks: int, prefetch_next: bool) -> PulledStep | None:
        return await train_pulled_batch_in_turn(
            self._turns,
            step,
            None if rollouts is None else PortCalled(rollouts, self._calls),
            num_ranks,
            self._train_pulled,
            self._prefetch,
            prefetch_next,
        )

    async def _train_pulled(self, columns: BatchColumns | None) -> TrainStepResult:
        assert (
            columns is not None
        )  # a batch has nothing for a trainer only with several policies, which a simulation refuses
        return await self._train_step(columns)

    @endpoint
    async def train_step(self, episodes: list[Episode]) -> TrainStepResult:
        loss = self.config.loss
        return await self._train_step(
            batch_columns(episodes, loss.normalize_advantage_std, loss.step_discount, loss.local_advantage_weight)
        )

    async def _train_step(self, columns: BatchColumns) -> TrainStepResult:
        started = time.perf_counter()
        await asyncio.sleep(self.config.sim.step_s(columns.num_tokens))
        self.policy_version += 1
        metrics = {
            m.TRAINED_TOKENS: columns.num_trained_tokens,
            m.STEP_SKIPPED: 0,
            "policy_version": self.policy_version,
            m.SIMULATED: 1,
            "simulated/step_s": time.perf_counter() - started,
        }
        return TrainStepResult(self.policy_version, False, f"simulated://policy-{self.policy_version}", metrics)

    @endpoint
    async def wait_for_publish(self) -> None:
        """Nothing to publish: the simulated generators load version numbers only."""

    @endpoint
    async def save_checkpoint(self, path: str, written) -> dict:
        raise ConfigError(_NO_CHECKPOINTS)

    @endpoint
    async def load_checkpoint(self, path: str) -> dict:
        raise ConfigError(_NO_CHECKPOINTS)


_NO_CHECKPOINTS = (
    "a simulated trainer (trainer.engine sim) has no state to checkpoint. Run it with "
    "--checkpoint.enabled false, or use trainer.engine torchtitan."
)
