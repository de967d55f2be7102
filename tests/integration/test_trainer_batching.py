"""Trainer layouts and options on the tiny Llama: pad, bucket, pack and tree give the same logprobs,
loss and weights (1 process, and FSDP2 / TP / HSDP over 2 gloo processes); activation checkpointing
changes nothing but memory; bf16 mixed precision trains close to fp32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from forge_rl.bench.trainer import TrainerBenchArgs
from forge_rl.bench.trainer import long_tail_episodes as bench_episodes
from forge_rl.core.batching import make_train_batch
from forge_rl.models.titan import ParallelConfig
from forge_rl.observability.metric_names import TRAINER_STEP_CLOCK
from forge_rl.training.packing import layout_token_logprobs, plan_microbatches
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Episode
from tests.integration.test_trainer import PARITY_CONFIG
from tests.support.helpers import run_on_ranks

pytestmark = pytest.mark.integration

NUM_STEPS = 2
TOLERANCE = 1e-5
# Depend on the layout by definition, or on the clock.
LAYOUT_METRICS = ("padding_fraction", "shared_token_fraction", *TRAINER_STEP_CLOCK)


def long_tail_episodes() -> list[Episode]:
    """4 groups of 4 completions of Pareto(1)-like lengths 2..80 after a 4-token prompt: most
    short, a few long (the trainer benchmark's workload, smaller)."""
    return bench_episodes(
        TrainerBenchArgs(num_prompts=4, group_size=4, min_completion=2, max_completion=80, prompt_tokens=4)
    )


@pytest.fixture(scope="module")
def batch():
    return make_train_batch(long_tail_episodes(), pad_id=0)


def _run(config: TrainerConfig, model_dir: Path, batch) -> dict:
    trainer = PolicyTrainer(config, model_dir)
    logprobs = trainer.compute_logprobs(batch)
    metrics = [trainer.train_step(batch) for _ in range(NUM_STEPS)]
    return {"logprobs": logprobs, "metrics": metrics, "state_dict": trainer.hf_state_dict()}


@pytest.fixture(scope="module")
def padded(model_dir, batch, single_process):
    return _run(dataclasses.replace(PARITY_CONFIG, batching="pad"), model_dir, batch)


def _assert_same_run(result: dict, expected: dict, batch, tolerance: float = TOLERANCE) -> None:
    real = torch.zeros_like(batch.loss_mask_NL)
    for i, n in enumerate(batch.row_lengths):
        real[i, 1:n] = True  # position 0 has no prediction; the rest of the row is padding
    assert (result["logprobs"] - expected["logprobs"])[real].abs().max() < tolerance
    assert (result["logprobs"][~real] == 0).all()
    for step, reference in zip(result["metrics"], expected["metrics"], strict=True):
        comparable = {k: v for k, v in reference.items() if k not in LAYOUT_METRICS}
        assert {k: step[k] for k in comparable} == pytest.approx(comparable, abs=tolerance)
    for name, tensor in expected["state_dict"].items():
        assert (result["state_dict"][name] - tensor).abs().max() < tolerance, name


def test_the_long_tail_batch_really_packs(batch):
    lengths = batch.row_lengths
    assert max(lengths) >= 4 * sorted(lengths)[len(lengths) // 2]
    (packed,) = plan_microbatches(lengths, "pack")
    assert packed.num_rows < len(lengths) / 2


@pytest.mark.parametrize(
    "options",
    [
        {"batching": "bucket"},
        {"batching": "pack"},
        {"batching": "pack", "activation_checkpointing": "full"},
        {"batching": "tree"},
    ],
    ids=["bucket", "pack", "pack+full_ac", "tree"],
)
def test_layouts_give_the_padded_logprobs_loss_and_weights(options, model_dir, batch, padded, single_process):
    result = _run(dataclasses.replace(PARITY_CONFIG, **options), model_dir, batch)
    _assert_same_run(result, padded, batch)
    if options["batching"] == "tree":  # each group's prompt computed once: 3 of its 4 copies shared
        assert result["metrics"][0]["shared_token_fraction"] >= 0.75 * 4 * 4 * 3 / sum(batch.row_lengths)
    else:
        assert result["metrics"][0]["padding_fraction"] < padded["metrics"][0]["padding_fraction"] / 2
    # Trained tokens are real generated tokens in every layout, padding never.
    assert result["metrics"][0]["num_tokens"] == padded["metrics"][0]["num_tokens"] == batch.loss_mask_NL.sum()
    assert result["metrics"][0]["num_input_tokens"] == sum(batch.row_lengths)


def test_packed_rows_without_the_document_mask_would_leak_across_sequences(model_dir, batch, single_process):
    """Guards the test above: it can only pass if the mask and restarted positions do their job."""
    trainer = PolicyTrainer(PARITY_CONFIG, model_dir)
    lengths, ids = batch.row_lengths, batch.input_ids_NL
    with torch.no_grad():
        masked = layout_token_logprobs(trainer._logits, ids, lengths, plan_microbatches(lengths, "pack"))
        unmasked = layout_token_logprobs(
            lambda ids_RW, positions, mask: trainer._logits(ids_RW), ids, lengths, plan_microbatches(lengths, "pack")
        )
    assert (masked - unmasked).abs().max() > 1e-2


def test_bf16_mixed_precision_trains_close_to_fp32(model_dir, batch, padded, single_process):
    result = _run(dataclasses.replace(PARITY_CONFIG, mixed_precision="bf16"), model_dir, batch)
    difference = (result["logprobs"] - padded["logprobs"])[batch.loss_mask_NL].abs().max()
    assert 1e-4 < difference < 5e-2  # bf16 rounding shows, and stays small
    assert result["metrics"][-1]["loss"] == pytest.approx(padded["metrics"][-1]["loss"], abs=1e-2)


def _run_rank(rank: int, config: TrainerConfig, model_dir: Path, batch, out: Path):
    torch.set_num_threads(1)
    result = _run(config, model_dir, batch)
    if rank == 0:
        torch.save(result, out)


@pytest.mark.parametrize(
    "parallel,options",
    [
        (ParallelConfig(dp_shard=2), {"batching": "pack"}),
        (ParallelConfig(tp=2), {"batching": "pack"}),
        (ParallelConfig(tp=2), {"batching": "tree"}),
        (ParallelConfig(dp_replicate=2), {"batching": "bucket", "activation_checkpointing": "full"}),
    ],
    ids=["fsdp2_pack", "tp2_pack", "tp2_tree", "hsdp_replicate2_bucket_ac"],
)
def test_two_processes_in_any_layout_match_one_padded(parallel, options, model_dir, batch, padded, tmp_path):
    out = tmp_path / "rank0.pt"
    config = dataclasses.replace(PARITY_CONFIG, num_procs=2, parallel=parallel, **options)
    run_on_ranks(_run_rank, config, model_dir, batch, out)
    _assert_same_run(torch.load(out), padded, batch)


def test_bf16_over_fsdp2_on_two_processes_trains_close_to_fp32(model_dir, batch, padded, tmp_path):
    out = tmp_path / "rank0.pt"
    config = dataclasses.replace(
        PARITY_CONFIG, num_procs=2, parallel=ParallelConfig(dp_shard=2), mixed_precision="bf16"
    )
    run_on_ranks(_run_rank, config, model_dir, batch, out)
    result = torch.load(out)
    difference = (result["logprobs"] - padded["logprobs"])[batch.loss_mask_NL].abs().max()
    assert 1e-4 < difference < 5e-2  # bf16 rounding shows, and stays small
    assert result["metrics"][-1]["loss"] == pytest.approx(padded["metrics"][-1]["loss"], abs=1e-2)
