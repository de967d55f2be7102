"""PolicyTrainer on the tiny Llama: HF parity in one process, FSDP2 and TP parity over 2 gloo processes.

The 2-process runs use tests.support.helpers.run_on_ranks, processes with RANK/WORLD_SIZE/MASTER_* set, which
is what the Monarch launcher provides in production.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forge_rl.core.batching import TrainBatch, make_train_batch
from forge_rl.models.lora import LoRAConfig
from forge_rl.models.lora_config import ATTENTION_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
from forge_rl.models.titan import ParallelConfig, read_hf_config, validate_parallelism
from forge_rl.observability.metric_names import TRAINER_STEP_CLOCK
from forge_rl.tasks.tokenizer import VOCAB_SIZE
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Completion, Episode
from tests.support.helpers import run_on_ranks

pytestmark = pytest.mark.integration

NUM_STEPS = 3
# AdamW moves a coordinate by lr * m / (sqrt(v) + eps). Where a gradient cancels to ~1e-8, about the
# size of the float differences between 1 and 2 processes (which reduce in other orders), the
# default eps 1e-8 lets those differences swing the update by a good fraction of lr (seen: 5e-5 under
# TP). With eps 1e-5 a gradient difference of 1e-8 moves the update by at most lr * 1e-3.
PARITY_CONFIG = TrainerConfig(adam_eps=1e-5)
# Rank 4 on every projection and the unembedding (lm_head, column-parallel under TP as wqkv); lr
# 1e-3 so that 3 steps move B (zero at start) well past the tolerance.
LORA_PARITY_CONFIG = dataclasses.replace(
    PARITY_CONFIG,
    lr=1e-3,
    lora=LoRAConfig(enabled=True, rank=4, alpha=8.0, targets=ATTENTION_TARGETS + MLP_TARGETS + UNEMBED_TARGETS),
)


def _episodes() -> list[Episode]:
    """3 prompts x 4 completions of uneven lengths, so the two data-parallel halves (rows 0-5 and
    6-11) hold different token counts and the loss normalization across ranks is exercised."""
    episodes = []
    for e, lengths in enumerate([(5, 1, 4, 2), (3, 3, 1, 2), (2, 1, 1, 2)]):
        completions = [
            Completion(
                token_ids=[(7 * e + 3 * c + 5 * t) % (VOCAB_SIZE - 4) + 4 for t in range(n)],
                logprobs=[0.0] * n,
                policy_versions=[0] * n,
                reward=float((c + e) % 3) / 2,
            )
            for c, n in enumerate(lengths)
        ]
        episodes.append(Episode(e, f"P{e}=", "", [1, 10 + e, 20 + e, 14], completions))
    return episodes


@pytest.fixture(scope="module")
def reference(model_dir, single_process):
    """The fixed batch (behaviour = version-0 logprobs + noise) and the 1-process run on it."""
    trainer = PolicyTrainer(PARITY_CONFIG, model_dir)
    batch = make_train_batch(_episodes(), pad_id=read_hf_config(model_dir)["pad_token_id"])
    noise = 0.05 * torch.randn(batch.input_ids_NL.shape, generator=torch.Generator().manual_seed(0))
    behaviour = (trainer.compute_logprobs(batch) + noise) * batch.loss_mask_NL
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=behaviour)
    metrics = [trainer.train_step(batch) for _ in range(NUM_STEPS)]
    return batch, metrics, trainer.hf_state_dict()


@pytest.fixture(scope="module")
def lora_reference(model_dir, single_process, reference):
    """The 1-process LoRA run on the same batch: metrics, adapters, merged HF weights."""
    batch = reference[0]
    trainer = PolicyTrainer(LORA_PARITY_CONFIG, model_dir)
    metrics = [trainer.train_step(batch) for _ in range(NUM_STEPS)]
    return metrics, trainer.adapter_state_dict(), trainer.hf_state_dict(), trainer


def test_logits_match_transformers(model_dir, single_process):
    from transformers import LlamaForCausalLM

    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    hf_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.randint(0, VOCAB_SIZE, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (trainer.model(input_ids) - hf_model(input_ids).logits).abs().max().item()
    assert diff < 1e-4


def test_export_at_step_0_is_the_checkpoint(model_dir, single_process):
    exported = PolicyTrainer(TrainerConfig(), model_dir).hf_state_dict()
    checkpoint = load_file(model_dir / "model.safetensors")
    assert exported.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor), name


def test_reference_run_learns_on_uneven_shards(reference):
    batch, metrics, _ = reference
    losses = [step["loss"] for step in metrics]
    halves = [batch.shard(rank, 2).num_generated_tokens for rank in range(2)]
    assert halves[0] != halves[1]
    assert batch.advantages_NL.abs().sum() > 0
    assert losses[-1] < losses[0] - 1e-3


def _with_nan_behaviour(batch: TrainBatch) -> TrainBatch:
    behaviour = batch.behaviour_logprobs_NL.clone()
    behaviour[0, -1] = float("nan")
    return dataclasses.replace(batch, behaviour_logprobs_NL=behaviour)


def _snapshot(trainer: PolicyTrainer) -> tuple[dict, dict]:
    weights = trainer.hf_state_dict()
    moments = {
        (i, key): value.clone()
        for i, state in enumerate(trainer.optimizer.state.values())
        for key, value in state.items()
    }
    return weights, moments


def _assert_unchanged(before: tuple[dict, dict], after: tuple[dict, dict]) -> None:
    for old, new in zip(before, after, strict=True):
        assert old.keys() == new.keys()
        assert all(torch.equal(old[key], new[key]) for key in old)


def test_a_non_finite_loss_skips_the_step_leaving_weights_optimizer_and_version(model_dir, reference):
    batch, _, _ = reference
    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    assert trainer.train_step(batch)["step_skipped"] == 0  # AdamW moments now exist
    before = _snapshot(trainer)
    metrics = trainer.train_step(_with_nan_behaviour(batch))
    assert metrics["step_skipped"] == 1
    assert trainer.policy_version == 1
    _assert_unchanged(before, _snapshot(trainer))


def test_a_non_finite_gradient_skips_the_step_and_a_finite_step_resets_the_count(model_dir, reference):
    batch, _, _ = reference
    trainer = PolicyTrainer(TrainerConfig(max_consecutive_nonfinite_steps=2), model_dir)
    before = _snapshot(trainer)
    parameter = next(trainer.model.parameters())
    hook = parameter.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    metrics = trainer.train_step(batch)
    assert metrics["step_skipped"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert math.isfinite(metrics["loss"])
    _assert_unchanged(before, _snapshot(trainer))
    hook.remove()
    assert trainer.train_step(batch)["step_skipped"] == 0
    assert trainer.policy_version == 1
    assert trainer.train_step(_with_nan_behaviour(batch))["step_skipped"] == 1  # 1 of 2 again, not 2


def test_a_batch_without_signal_leaves_weights_and_optimizer_as_they_were(model_dir, reference):
    """Every group's rewards equal: advantages and gradient zero. AdamW would still move the weights
    (momentum from the step before, weight decay); the trainer takes no step, and the version
    advances as for any step."""
    batch, _, _ = reference
    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    assert trainer.train_step(batch)["step_without_gradient"] == 0  # AdamW moments now exist
    before = _snapshot(trainer)
    flat = [
        dataclasses.replace(e, completions=[dataclasses.replace(c, reward=1.0) for c in e.completions])
        for e in _episodes()
    ]
    metrics = trainer.train_step(make_train_batch(flat, pad_id=read_hf_config(model_dir)["pad_token_id"]))
    assert metrics["grad_norm"] == 0.0 and metrics["step_without_gradient"] == 1 and metrics["step_skipped"] == 0
    assert trainer.policy_version == 2
    _assert_unchanged(before, _snapshot(trainer))


def test_consecutive_non_finite_steps_stop_training_naming_the_flag(model_dir, reference):
    batch, _, _ = reference
    trainer = PolicyTrainer(TrainerConfig(max_consecutive_nonfinite_steps=2), model_dir)
    assert trainer.train_step(_with_nan_behaviour(batch))["step_skipped"] == 1
    with pytest.raises(FloatingPointError) as error:
        trainer.train_step(_with_nan_behaviour(batch))
    message = str(error.value)
    assert "non-finite grpo loss" in message and "2 consecutive steps" in message
    assert "--trainer.max-consecutive-nonfinite-steps" in message
    assert trainer.policy_version == 0


def _without_timing(metrics: dict[str, float]) -> dict[str, float]:
    """Without the clock, and without padding_fraction: each rank lays out (packs) only its own rows."""
    return {
        name: value for name, value in metrics.items() if name not in TRAINER_STEP_CLOCK and name != "padding_fraction"
    }


def _world_size(parallel: ParallelConfig) -> int:
    return parallel.dp_degree * parallel.tp


def _run_rank(
    rank: int, config: TrainerConfig, parallel: ParallelConfig, model_dir: Path, batch: TrainBatch, out: Path
):
    trainer = PolicyTrainer(dataclasses.replace(config, num_procs=_world_size(parallel), parallel=parallel), model_dir)
    metrics = [trainer.train_step(batch) for _ in range(NUM_STEPS)]
    # As the trainer actor publishes: every rank joins the gathers, only rank 0 keeps a copy.
    state_dict = trainer.hf_state_dict(keep=rank == 0)
    adapters = trainer.adapter_state_dict(keep=rank == 0) if config.lora.enabled else {}
    if rank == 0:
        torch.save({"metrics": metrics, "state_dict": state_dict, "adapters": adapters}, out)
    else:
        assert state_dict == {} and adapters == {}


@pytest.mark.parametrize("parallel", [ParallelConfig(dp_shard=2), ParallelConfig(tp=2)], ids=["fsdp2", "tp2"])
def test_two_processes_match_one(parallel, model_dir, reference, tmp_path):
    batch, reference_metrics, reference_state_dict = reference
    out = tmp_path / "rank0.pt"
    run_on_ranks(_run_rank, PARITY_CONFIG, parallel, model_dir, batch, out)
    result = torch.load(out)
    for step, expected in zip(result["metrics"], reference_metrics, strict=True):
        assert _without_timing(step) == pytest.approx(_without_timing(expected), abs=1e-4)
    checkpoint = load_file(model_dir / "model.safetensors")
    for name, expected in reference_state_dict.items():
        # The steps moved the weights far more than the tolerance, so agreement is meaningful.
        assert (expected - checkpoint[name]).abs().max() > 1e-4, name
        assert (result["state_dict"][name] - expected).abs().max() < 1e-5, name


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(dp_shard=2), ParallelConfig(tp=2), ParallelConfig(dp_shard=2, tp=2)],
    ids=["fsdp2", "tp2", "fsdp2_tp2"],
)
def test_lora_over_several_processes_matches_one(parallel, model_dir, reference, lora_reference, tmp_path):
    """Adapters split as their layers (TP), replicated with summed gradients (FSDP2), and both at
    once on a 2 x 2 mesh: the same losses, gradient norms, adapters and merged weights as one process."""
    batch = reference[0]
    reference_metrics, reference_adapters, reference_merged, _ = lora_reference
    out = tmp_path / "rank0.pt"
    run_on_ranks(_run_rank, LORA_PARITY_CONFIG, parallel, model_dir, batch, out, nprocs=_world_size(parallel))
    result = torch.load(out)
    for step, expected in zip(result["metrics"], reference_metrics, strict=True):
        assert _without_timing(step) == pytest.approx(_without_timing(expected), abs=1e-4)
    assert result["adapters"].keys() == reference_adapters.keys()
    for name, expected in reference_adapters.items():
        assert expected.abs().max() > 1e-3, name  # every adapter (B from zero, A) moved
        assert (result["adapters"][name] - expected).abs().max() < 1e-5, name
    checkpoint = load_file(model_dir / "model.safetensors")
    for name, expected in reference_merged.items():
        assert (result["state_dict"][name] - expected).abs().max() < 1e-5, name
    assert (
        reference_merged["model.layers.0.self_attn.q_proj.weight"]
        - checkpoint["model.layers.0.self_attn.q_proj.weight"]
    ).abs().max() > 1e-5


def test_the_merged_hf_export_computes_what_the_adapted_trainer_does(model_dir, lora_reference, tmp_path):
    from transformers import LlamaForCausalLM

    from forge_rl.models.hf_checkpoint import export_hf_model_dir

    *_, trainer = lora_reference
    merged_dir = export_hf_model_dir(trainer.hf_state_dict(), model_dir, tmp_path / "merged")
    input_ids = torch.randint(0, VOCAB_SIZE, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = trainer.model(input_ids)
        merged = LlamaForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(input_ids).logits
        base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(input_ids).logits
    assert (merged - adapted).abs().max() < 1e-4
    assert (base - adapted).abs().max() > 1e-3  # the adapters changed what the model computes


def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_exactly(model_dir, single_process, reference, tmp_path):
    import torch.distributed.checkpoint as dcp

    batch = reference[0]
    trainer = PolicyTrainer(LORA_PARITY_CONFIG, model_dir)
    trainer.train_step(batch)
    trainer.save_checkpoint(tmp_path / "ckpt")
    continued = [_without_timing(trainer.train_step(batch)) for _ in range(2)]
    saved = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    tensors = {key for key in saved if key.startswith(("adapters.", "model."))}
    assert tensors == {f"adapters.{key}" for key in trainer.adapter_state_dict()}  # no base weight
    assert (
        sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir())
        < 0.5 * (model_dir / "model.safetensors").stat().st_size
    )

    resumed = PolicyTrainer(LORA_PARITY_CONFIG, model_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.policy_version == 1
    assert [_without_timing(resumed.train_step(batch)) for _ in range(2)] == continued
    expected = trainer.adapter_state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in resumed.adapter_state_dict().items())


def _resume_rank(rank: int, parallel: ParallelConfig, model_dir: Path, batch: TrainBatch, checkpoint: Path, out: Path):
    config = dataclasses.replace(LORA_PARITY_CONFIG, num_procs=_world_size(parallel), parallel=parallel)
    trainer = PolicyTrainer(config, model_dir)
    trainer.train_step(batch)
    # Written in the background while the next steps train (as a run writes it): what it holds is
    # the state of before them, and its collectives do not meet the steps'.
    trainer.start_checkpoint(checkpoint)
    continued = [_without_timing(trainer.train_step(batch)) for _ in range(2)]
    trainer.wait_for_checkpoint()
    adapters = trainer.adapter_state_dict(keep=rank == 0)
    resumed = PolicyTrainer(config, model_dir)
    resumed.load_checkpoint(checkpoint)
    resumed_steps = [_without_timing(resumed.train_step(batch)) for _ in range(2)]
    resumed_adapters = resumed.adapter_state_dict(keep=rank == 0)
    if rank == 0:
        torch.save(
            {
                "continued": continued,
                "resumed": resumed_steps,
                "adapters": adapters,
                "resumed_adapters": resumed_adapters,
                "policy_version": resumed.policy_version,
            },
            out,
        )


@pytest.mark.parametrize("parallel", [ParallelConfig(dp_shard=2), ParallelConfig(tp=2)], ids=["fsdp2", "tp2"])
def test_a_lora_checkpoint_over_two_processes_resumes_exactly(parallel, model_dir, reference, tmp_path):
    """The adapters-only checkpoint saved by sharded adapters (TP) or replicated ones (FSDP2), each
    rank writing its part in the background while two more steps train, loads into fresh trainers
    of the same layout and continues bit for bit."""
    out = tmp_path / "rank0.pt"
    run_on_ranks(_resume_rank, parallel, model_dir, reference[0], tmp_path / "ckpt", out)
    result = torch.load(out)
    assert result["policy_version"] == 3  # 1 step, then the 2 resumed steps
    assert result["resumed"] == result["continued"]
    assert result["resumed_adapters"].keys() == result["adapters"].keys()
    assert all(torch.equal(value, result["adapters"][key]) for key, value in result["resumed_adapters"].items())


def test_a_checkpoint_that_does_not_fit_the_trainer_is_refused_naming_the_flag(model_dir, single_process, tmp_path):
    PolicyTrainer(LORA_PARITY_CONFIG, model_dir).save_checkpoint(tmp_path / "lora")
    other_rank = dataclasses.replace(LORA_PARITY_CONFIG, lora=LoRAConfig(enabled=True, rank=8))
    fit_error = r"does not fit.*rank 8.*lora_A has shape \[4, 128\], these adapters \[8, 128\].*--trainer.lora.rank"
    with pytest.raises(ValueError, match=fit_error):
        PolicyTrainer(other_rank, model_dir).load_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match=r"holds LoRA adapters.*--trainer.lora.enabled true"):
        PolicyTrainer(PARITY_CONFIG, model_dir).load_checkpoint(tmp_path / "lora")
    PolicyTrainer(PARITY_CONFIG, model_dir).save_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match=r"holds full weights.*--trainer.lora.enabled false"):
        PolicyTrainer(LORA_PARITY_CONFIG, model_dir).load_checkpoint(tmp_path / "full")


def test_parallelism_errors_name_the_flag(model_dir):
    hf_config = read_hf_config(model_dir)
    tp_error = r"trainer.parallel.tp \(3\) .* Set --trainer.parallel.tp to 1, 2 or 4"
    with pytest.raises(ValueError, match=tp_error):
        validate_parallelism(ParallelConfig(dp_shard=1, tp=3), 3, hf_config)
    with pytest.raises(ValueError, match=r"must equal trainer.num_procs \(2\)"):
        validate_parallelism(ParallelConfig(dp_shard=2, tp=2), 2, hf_config)
    with pytest.raises(ValueError, match=r"trainer.lr \(0.0\)"):
        TrainerConfig(lr=0.0)
