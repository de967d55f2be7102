"""Reference-model shell: one actor per reference rank, annotating episodes with reference logprobs.

Spawned only when trainer.loss.kl_beta > 0 (forge_rl/reference.py). The frozen model is a
`PolicyTrainer` that never takes a step: the same TorchTitan build, parallelism and logprob code
as the policy, so the two can only differ by their weights. `annotate` is a collective over the
reference ranks, called on all of them at once (`.call()`).
"""

from __future__ import annotations

import time
from pathlib import Path

from monarch.actor import Actor, endpoint

from forge_rl.batching import make_train_batch
from forge_rl.reference import ReferenceConfig, attach_reference_logprobs
from forge_rl.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode


class ReferenceActor(Actor):
    def __init__(self, config: ReferenceConfig, model_dir: str, pad_id: int):
        self.config = config
        self.model_dir = Path(model_dir)
        self.pad_id = pad_id
        self.model: PolicyTrainer | None = None

    @endpoint
    async def setup(self) -> dict:
        started = time.perf_counter()
        trainer_config = TrainerConfig(
            num_procs=self.config.num_procs, parallel=self.config.parallel, num_threads=self.config.num_threads
        )
        self.model = PolicyTrainer(trainer_config, self.model_dir)
        self.model.model.requires_grad_(False)
        return {"reference_setup_s": time.perf_counter() - started}

    @endpoint
    async def annotate(self, episodes: list[Episode]) -> list[Episode]:
        """`episodes` with `reference_logprobs` set on every completion."""
        logprobs_NL = self.model.compute_logprobs(make_train_batch(episodes, self.pad_id))
        return attach_reference_logprobs(episodes, logprobs_NL)
