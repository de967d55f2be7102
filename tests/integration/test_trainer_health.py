"""What the trainer reports about the sampler: entropy of the policy, and the mismatch per
generator that catches a generator serving stale weights (forge_rl/health.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from forge_rl.batching import make_train_batch
from forge_rl.health import MismatchAlarm, MismatchAlarmConfig
from forge_rl.metrics import POLICY_ENTROPY
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.models.titan import read_hf_config
from forge_rl.tasks.tokenizer import VOCAB_SIZE
from forge_rl.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Completion, Episode

pytestmark = pytest.mark.integration


def episodes_from_two_generators() -> list[Episode]:
    episodes = []
    for e in range(4):
        completions = [
            Completion(
                token_ids=[(5 * e + 3 * c + 7 * t) % 40 + 4 for t in range(4)],
                logprobs=[0.0] * 4,
                policy_versions=[0] * 4,
                reward=float(c % 2),
            )
            for c in range(4)
        ]
        episodes.append(Episode(e, f"P{e}=", "", [1, 10 + e, 14], completions, generator_index=e % 2))
    return episodes


def test_a_generator_sampling_with_stale_weights_stands_out_and_raises_the_alarm(model_dir, single_process, tmp_path):
    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    stale = PolicyTrainer(TrainerConfig(), create_tiny_model(TinyModelConfig(seed=7), tmp_path / "stale"))
    batch = make_train_batch(episodes_from_two_generators(), pad_id=read_hf_config(model_dir)["pad_token_id"])
    # Generator 0 sampled with the trainer's weights; generator 1 claims the same version but
    # sampled with other weights (an update that never applied).
    from_generator_1 = (batch.generator_N == 1).unsqueeze(-1)
    behaviour = torch.where(from_generator_1, stale.compute_logprobs(batch), trainer.compute_logprobs(batch))
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=behaviour * batch.loss_mask_NL)

    metrics = trainer.train_step(batch)

    assert metrics["mismatch_kl/generator/0"] < 1e-6
    assert metrics["mismatch_kl/generator/1"] > 1e-2
    assert 0 < metrics[POLICY_ENTROPY] <= math.log(VOCAB_SIZE)
    (warning,) = MismatchAlarm(MismatchAlarmConfig()).observe(1, metrics, episodes_from_two_generators(), 0)
    assert "generator 1's sampler mismatch" in warning
