"""What the trainer reports about the sampler: entropy of the policy, and the mismatch per
generator that catches a generator serving stale weights (forge_rl/observability/health.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.models.titan import read_hf_config
from forge_rl.observability.health import MismatchAlarm, MismatchAlarmConfig, token_versions_by_generator
from forge_rl.observability.metric_names import POLICY_ENTROPY
from forge_rl.tasks.tokenizer import VOCAB_SIZE
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
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
    # Every completion is at the trainer's version (0): the fresh KL is the same.
    assert metrics["mismatch_kl_fresh/generator/1"] == metrics["mismatch_kl/generator/1"]
    assert 0 < metrics[POLICY_ENTROPY] <= math.log(VOCAB_SIZE)
    (warning,) = MismatchAlarm(MismatchAlarmConfig()).observe(
        1, metrics, token_versions_by_generator(episodes_from_two_generators()), 0
    )
    assert "generator 1's sampler mismatch" in warning


def test_the_fresh_mismatch_counts_only_tokens_whose_weights_and_kv_are_the_trainers_version(model_dir, single_process):
    """After one update (the trainer at version 1): generator 0's turns had a swap in their middle,
    so their later tokens attended to KV of version 0 and are left out; generator 1's episodes
    had it between two turns, so their second turns were encoded and sampled by version 1 alone
    and are the fresh ones. Tokens of version 0 add the update's size (policy lag) to the
    all-token KL only."""
    trainer = PolicyTrainer(TrainerConfig(lr=1e-2), model_dir)
    pad_id = read_hf_config(model_dir)["pad_token_id"]
    episodes = episodes_from_two_generators()
    version_0 = make_train_batch(episodes, pad_id=pad_id)
    behaviour_0 = trainer.compute_logprobs(version_0) * version_0.loss_mask_NL
    trainer.train_step(dataclasses.replace(version_0, behaviour_logprobs_NL=behaviour_0))  # now at version 1
    behaviour_1 = trainer.compute_logprobs(version_0)
    for episode in episodes:
        for completion in episode.completions:
            completion.policy_versions = [0, 0, 1, 1]
            if episode.generator_index == 1:  # a turn, an observation token, a second turn
                completion.generated = [True, False, True, True]
                completion.logprobs[1] = 0.0
    batch = make_train_batch(episodes, pad_id=pad_id)
    # Behaviour logprobs of the weights that sampled each token: version 0 before the swap, 1 after.
    after_swap_NL = torch.arange(batch.input_ids_NL.shape[1]) >= batch.lengths_N.unsqueeze(-1) - 2
    behaviour = torch.where(after_swap_NL, behaviour_1, behaviour_0) * batch.loss_mask_NL

    metrics = trainer.train_step(dataclasses.replace(batch, behaviour_logprobs_NL=behaviour))

    assert "mismatch_kl_fresh/generator/0" not in metrics
    assert metrics["mismatch_kl/generator/0"] > 1e-4  # the first update's size
    assert metrics["mismatch_kl_fresh/generator/1"] < 1e-6
    assert metrics["mismatch_kl/generator/1"] > 1e-4
