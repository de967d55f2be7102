"""Frozen-model shell: one actor per rank of a model that scores tokens and never trains.

It serves both "frozen models that score tokens": the reference model of the KL penalty
(forge_rl/reference.py, spawned when trainer.loss.kl_beta > 0, its logprobs stored on the
completions) and the teacher of on-policy distillation (forge_rl/teacher.py, spawned when
scorer.teacher.path is set, its logprobs turned into per-token rewards by the teacher scorer).
The model is a `PolicyTrainer` that never takes a step: the same TorchTitan build, parallelism and
logprob code as the policy (the generator's temperature and kept sets), so a frozen model and the
policy can only differ by their weights. `token_logprobs` is a collective over the model's ranks,
called on all of them at once (`.call()`); rank 0's answer is the result.
"""

from __future__ import annotations

import time
from pathlib import Path

from monarch.actor import Actor, endpoint

from forge_rl.batching import make_train_batch
from forge_rl.reference import ReferenceConfig, completion_logprobs
from forge_rl.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode


class FrozenModelActor(Actor):
    def __init__(self, config: ReferenceConfig, model_dir: str, pad_id: int):
        """`config`: a ReferenceConfig or a TeacherConfig (its processes, parallelism, threads)."""
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
        return {f"{self.config.section}_setup_s": time.perf_counter() - started}

    @endpoint
    async def token_logprobs(self, episodes: list[Episode]) -> list[list[list[float]]]:
        """The frozen model's logprob of every completion token, [episode][completion][token],
        under the distribution each was sampled from."""
        logprobs_NL = self.model.compute_logprobs(make_train_batch(episodes, self.pad_id))
        return completion_logprobs(episodes, logprobs_NL)
