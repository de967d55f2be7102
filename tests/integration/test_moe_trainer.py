"""The tiny Qwen3-MoE trainer over 2 gloo processes matches one process, Keep Routing replay
included: with expert parallelism (each rank holds half of every layer's experts, FSDP2 shards the
rest) and with tensor parallelism (the routers' outputs are DTensors; the replay follows them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from forge_rl.core.batching import TrainBatch, make_train_batch
from forge_rl.models.tiny import create_tiny_model
from forge_rl.models.titan import ParallelConfig
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from tests.support.helpers import run_on_ranks
from tests.unit.models.test_keep_routing import TINY_MOE, _episode, _random_record

pytestmark = pytest.mark.integration

CONFIG = TrainerConfig(keep_routing=True, adam_eps=1e-5)
NUM_STEPS = 2


def _batch() -> TrainBatch:
    """4 rows (2 per data-parallel rank), three of them with routing records."""
    episodes = [
        _episode([_random_record(4, 20), None]),
        dataclasses.replace(_episode([_random_record(4, 21), _random_record(3, 22)]), episode_id=1),
    ]
    batch = make_train_batch(episodes, pad_id=0)
    noise = 0.05 * torch.randn(batch.input_ids_NL.shape, generator=torch.Generator().manual_seed(0))
    return dataclasses.replace(batch, behaviour_logprobs_NL=(-2.0 + noise) * batch.loss_mask_NL)


def _run(trainer: PolicyTrainer, batch: TrainBatch) -> dict:
    logprobs = trainer.compute_logprobs(batch)
    metrics = [trainer.train_step(batch) for _ in range(NUM_STEPS)]
    return {"logprobs": logprobs, "metrics": metrics, "state_dict": trainer.hf_state_dict(keep=trainer.rank == 0)}


def _run_rank(rank: int, model_dir: Path, batch: TrainBatch, out: Path, parallel: ParallelConfig) -> None:
    config = dataclasses.replace(CONFIG, num_procs=2, parallel=parallel)
    result = _run(PolicyTrainer(config, model_dir), batch)
    if rank == 0:
        torch.save(result, out)


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(dp_shard=2, ep=2), ParallelConfig(tp=2), ParallelConfig(tp=2, ep=2)],
    ids=["fsdp2-ep2", "tp2", "tp2-ep2"],
)
def test_moe_over_two_gloo_processes_matches_one(tmp_path, single_process, parallel):
    model_dir = create_tiny_model(TINY_MOE, tmp_path / "model")
    batch = _batch()
    expected = _run(PolicyTrainer(CONFIG, model_dir), batch)
    out = tmp_path / "rank0.pt"
    run_on_ranks(_run_rank, model_dir, batch, out, parallel)
    result = torch.load(out)
    torch.testing.assert_close(result["logprobs"], expected["logprobs"], rtol=0, atol=1e-5)
    for step, reference in zip(result["metrics"], expected["metrics"], strict=True):
        assert step["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert step["keep_routing/completions_without_record"] == 1.0
    for name, value in expected["state_dict"].items():
        assert (result["state_dict"][name] - value).abs().max() < 1e-5, name
