"""The tiny Qwen3-MoE in one trainer process: the TorchTitan model is the HF checkpoint in and out,
and Keep Routing (forge_rl/routing.py) replays exactly the recorded experts, a record equal to the
trainer's own routing changes nothing, bad records are refused, completions without one fall back
and are counted, records travel through trajectories, batches and checkpoints, EP is validated."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.models.moe import last_routing, take_replay_counts
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.routing import RoutingRecord, replay_topk, routing_differs_NL
from forge_rl.tasks.tokenizer import VOCAB_SIZE
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Completion, Episode
from tests.support.helpers import rank_env

TINY_MOE = TinyModelConfig(
    hidden_size=64,
    num_heads=2,
    num_kv_heads=2,
    intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
NUM_LAYERS, TOP_K, NUM_EXPERTS = TINY_MOE.num_layers, TINY_MOE.num_experts_per_tok, TINY_MOE.num_experts
PROMPT = [1, 14, 9, 7, 40]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return create_tiny_model(TINY_MOE, tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def trainer(moe_dir):
    with pytest.MonkeyPatch.context() as patch:
        for name in rank_env(rank=0, world_size=1, master_port=0):
            patch.delenv(name, raising=False)
        # "pad": one micro-batch whose rows are the batch's rows, so positions compare directly.
        yield PolicyTrainer(TrainerConfig(keep_routing=True, batching="pad"), moe_dir)


def _random_record(num_tokens: int, seed: int, num_layers=NUM_LAYERS, top_k=TOP_K) -> RoutingRecord:
    """Distinct experts per token and layer, as a router picks them."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand((num_tokens, num_layers, NUM_EXPERTS), generator=generator)
    return RoutingRecord(scores.topk(top_k, dim=-1).indices.to(torch.uint8))


def _episode(records: list[RoutingRecord | None], lengths=(4, 3)) -> Episode:
    completions = [
        Completion(
            token_ids=[(5 * c + 3 * t) % (VOCAB_SIZE - 4) + 4 for t in range(n)],
            logprobs=[-1.0] * n,
            policy_versions=[0] * n,
            reward=float(c),
            routed_experts=record,
        )
        for c, (n, record) in enumerate(zip(lengths, records))
    ]
    return Episode(0, "", "", PROMPT, completions)


def test_the_replayed_forward_routes_every_recorded_token_through_its_recorded_experts(trainer):
    records = [_random_record(4, seed=1), _random_record(3, seed=2)]
    batch = make_train_batch([_episode(records)], pad_id=0)
    trainer.compute_logprobs(batch)
    used_NLXK = last_routing(trainer.model)  # pad layout: row n, position p
    num_prompt = len(PROMPT)
    for n, record in enumerate(records):
        # Token t of the completion (sequence position num_prompt + t) was sampled by the pass at
        # the position before it.
        used = used_NLXK[n, num_prompt - 1 : num_prompt - 1 + record.num_tokens]
        assert torch.equal(used.sort(-1).values, record.expert_ids_GXK.long().sort(-1).values)
    # The prompt but its last token routes normally: as without any record.
    replayed = used_NLXK[:, : num_prompt - 1].clone()
    trainer.compute_logprobs(dataclasses.replace(batch, routed_experts_NLXK=None, routed_NL=None))
    assert torch.equal(replayed, last_routing(trainer.model)[:, : num_prompt - 1])


def test_a_record_of_the_trainers_own_routing_changes_no_logprob(trainer):
    """The gate weights of replayed tokens are recomputed with the router's own formula, so
    replaying the router's own choice is the unreplayed forward, to float rounding."""
    batch = make_train_batch([_episode([None, None])], pad_id=0)
    free = trainer.compute_logprobs(batch)
    own_NLXK = last_routing(trainer.model)
    num_prompt = len(PROMPT)
    records = [
        RoutingRecord(own_NLXK[n, num_prompt - 1 : num_prompt - 1 + length].to(torch.uint8))
        for n, length in enumerate((4, 3))
    ]
    take_replay_counts(trainer.model)
    replayed = trainer.compute_logprobs(make_train_batch([_episode(records)], pad_id=0))
    torch.testing.assert_close(replayed, free, rtol=0, atol=1e-6)
    assert take_replay_counts(trainer.model) == (7 * NUM_LAYERS, 0)  # every token replayed, none changed
    # and a foreign record does change them
    foreign = trainer.compute_logprobs(
        make_train_batch([_episode([_random_record(4, 3), _random_record(3, 4)])], pad_id=0)
    )
    assert (foreign - free).abs().max() > 1e-3


@pytest.mark.parametrize(
    "record, message",
    [
        (
            _random_record(4, 5, num_layers=NUM_LAYERS + 1),
            "3 MoE layers x top-2 experts per token, but the model has 2",
        ),
        (
            _random_record(4, 5, top_k=TOP_K + 1),
            "2 MoE layers x top-3 experts per token, but the model has 2 MoE layers x top-2",
        ),
        (
            RoutingRecord(torch.full((4, NUM_LAYERS, TOP_K), NUM_EXPERTS, dtype=torch.uint8)),
            "names expert 8, but the model has 8 experts",
        ),
    ],
)
def test_a_record_that_does_not_fit_the_model_is_refused(trainer, record, message):
    batch = make_train_batch([_episode([record, None])], pad_id=0)
    with pytest.raises(ValueError, match=message):
        trainer.compute_logprobs(batch)


def test_completions_without_a_record_route_normally_and_are_counted(trainer):
    batch = make_train_batch([_episode([_random_record(4, 6), None])], pad_id=0)
    metrics = trainer.train_step(batch)
    assert metrics["keep_routing/completions_without_record"] == 1.0
    assert metrics["keep_routing/routed_token_fraction"] == pytest.approx(4 / 7)
    # A random record of 2 of 8 experts almost never is the router's own choice.
    assert 0.5 < metrics["keep_routing/overridden_fraction"] <= 1.0


def test_keep_routing_is_refused_on_a_dense_model(tmp_path):
    dense_dir = create_tiny_model(TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=2), tmp_path / "dense")
    with pytest.raises(ValueError, match="dense model"):
        PolicyTrainer(TrainerConfig(keep_routing=True), dense_dir)


@pytest.mark.parametrize("batching", ["pad", "pack"])
def test_activation_checkpointing_recomputes_the_blocks_with_the_replayed_routing(moe_dir, batching):
    """The backward pass recomputes each block after the forward's replay has exited (and, packed,
    micro-batch by micro-batch, each with its own records): the step must be the one without
    checkpointing. Random records override most tokens' own choice, so a recomputation that
    routed by itself would compute other experts' outputs and other gradients."""
    batch = make_train_batch(
        [
            _episode([_random_record(4, seed=31), _random_record(3, seed=32)]),
            dataclasses.replace(_episode([_random_record(4, seed=33), None]), episode_id=1),
        ],
        pad_id=0,
    )
    noise = 0.05 * torch.randn(batch.input_ids_NL.shape, generator=torch.Generator().manual_seed(0))
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=(-2.0 + noise) * batch.loss_mask_NL)
    results = []
    with pytest.MonkeyPatch.context() as patch:
        for name in rank_env(rank=0, world_size=1, master_port=0):
            patch.delenv(name, raising=False)
        for checkpointing in ("none", "full"):
            config = TrainerConfig(keep_routing=True, batching=batching, activation_checkpointing=checkpointing)
            trainer = PolicyTrainer(config, moe_dir)
            metrics = trainer.train_step(batch)
            results.append((metrics, trainer.hf_state_dict()))
    (plain, plain_weights), (checkpointed, checkpointed_weights) = results
    assert plain["keep_routing/overridden_fraction"] > 0.5
    for name in ("loss", "grad_norm", "keep_routing/overridden_fraction"):
        assert checkpointed[name] == pytest.approx(plain[name], abs=1e-6), name
    for name, value in plain_weights.items():
        torch.testing.assert_close(checkpointed_weights[name], value, rtol=0, atol=1e-6)


def test_the_record_travels_compactly_through_a_checkpoint_and_must_cover_the_generated_tokens():
    record = _random_record(4, seed=7)
    assert record.expert_ids_GXK.dtype == torch.uint8 and record.bytes_per_token == NUM_LAYERS * TOP_K
    episode = _episode([record, None])
    restored = Episode.from_dict(episode.to_dict())
    assert torch.equal(restored.completions[0].routed_experts.expert_ids_GXK, record.expert_ids_GXK)
    assert restored.completions[1].routed_experts is None
    with pytest.raises(ValueError, match="3 tokens' routing for 4 generated tokens"):
        Completion([4, 5, 6, 7], [0.0] * 4, [0] * 4, routed_experts=_random_record(3, 8))


def test_replayed_gate_weights_are_the_softmax_over_the_recorded_experts():
    logits_BLE = torch.randn(1, 3, 8)
    scores_BLE = logits_BLE.softmax(-1)
    own_scores, own_ids = scores_BLE.topk(2, dim=-1)
    recorded = torch.tensor([[[0, 1], [2, 3], [4, 5]]])
    weights, ids = replay_topk(
        scores_BLE, own_ids, own_scores, recorded, torch.tensor([[True, False, True]]), True, 1.0
    )
    assert torch.equal(ids[0, [0, 2]], recorded[0, [0, 2]]) and torch.equal(ids[0, 1], own_ids[0, 1])
    torch.testing.assert_close(weights[0, 0], logits_BLE[0, 0, [0, 1]].softmax(-1))
    torch.testing.assert_close(weights[0, 1], own_scores[0, 1])  # not replayed: the router's own
    assert routing_differs_NL(recorded[..., None, :], recorded.flip(-1)[..., None, :]).sum() == 0


@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_every_batching_layout_replays_the_same_routing(trainer, mode):
    from forge_rl.training.packing import layout_token_logprobs, plan_microbatches

    batch = make_train_batch([_episode([_random_record(4, 9), _random_record(3, 10)])], pad_id=0)
    padded = trainer.compute_logprobs(batch)
    lengths = batch.row_lengths
    laid_out = layout_token_logprobs(
        trainer._logits,
        batch.input_ids_NL,
        lengths,
        plan_microbatches(lengths, mode),
        routing=(batch.routed_experts_NLXK, batch.routed_NL),
    )
    torch.testing.assert_close(laid_out.detach(), padded, rtol=0, atol=1e-5)


def test_the_capture_keeps_the_row_that_sampled_each_token_per_request_and_child():
    from forge_rl.engines.routing_capture import RoutingCapture

    capture = RoutingCapture(num_layers=2, top_k=1, num_experts=8)
    rows = lambda *ids: [torch.tensor([[i] for i in ids]), torch.tensor([[i + 1] for i in ids])]  # noqa: E731
    # Step 1: prefill of a 3-token prompt for two children (prompt positions 0..2 each).
    capture.add_step(
        ["0_gen-1-abcd1234", "1_gen-1-abcd1234"],
        [3, 3],
        [3, 3],
        torch.tensor([0, 1, 2, 0, 1, 2]),
        rows(0, 1, 2, 3, 4, 5),
    )
    # Step 2: one decode row each (position 3); then child 0 recomputes position 3 (ignored: first row wins).
    capture.add_step(["0_gen-1-abcd1234", "1_gen-1-abcd1234"], [1, 1], [3, 3], torch.tensor([3, 3, 99]), rows(6, 7, 0))
    capture.add_step(["0_gen-1-abcd1234"], [1], [3], torch.tensor([3]), rows(0))
    records = capture.take("gen-1", {0: 2, 1: 2})
    assert records[0].expert_ids_GXK[:, :, 0].tolist() == [[2, 3], [6, 7]]
    assert records[1].expert_ids_GXK[:, :, 0].tolist() == [[5, 6], [7, 8]]
    assert capture.num_requests == 0
    # A completion whose rows have a gap gets no record (the trainer routes it and counts it).
    capture.add_step(["gen-2-abcd1234"], [1], [3], torch.tensor([2]), rows(1))
    assert capture.take("gen-2", {0: 2}) == {}


def test_a_trajectorys_turn_records_join_into_one_and_land_on_its_generated_tokens_only():
    from forge_rl.envs.rollout import trajectory_completion
    from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, Trajectory, TrajectorySample, TrajectoryStatus

    first, second = _random_record(2, seed=11), _random_record(1, seed=12)
    spans = [
        ContextSpan((1, 7, 40)),
        GeneratedSpan((16, 2), (-0.5, -0.1), (0, 0), None, first),
        ContextSpan((31, 40)),
        GeneratedSpan((5,), (-0.2,), (0,), None, second),
    ]
    trajectory = Trajectory(
        samples=[TrajectorySample(spans)],
        status=TrajectoryStatus.DONE,
        final_reward=1.0,
        turn_rewards=[None, None],
        conversation=[],
        num_turns=2,
        num_malformed_turns=0,
        env_latencies_s=[],
    )
    completion = trajectory_completion(trajectory)
    assert torch.equal(
        completion.routed_experts.expert_ids_GXK, torch.cat([first.expert_ids_GXK, second.expert_ids_GXK])
    )
    batch = make_train_batch(
        [Episode(0, "", "", [], [completion, dataclasses.replace(completion, routed_experts=None)])], pad_id=0
    )
    assert batch.routed_NL[0].tolist() == [False, False, False, True, True, False, False, True]
    assert torch.equal(batch.routed_experts_NLXK[0, 7], second.expert_ids_GXK[0])
    assert not batch.routed_NL[1].any()
    with pytest.raises(ValueError, match="disagree in length"):
        GeneratedSpan((16, 2), (-0.5, -0.1), (0, 0), None, second)


def test_expert_parallelism_is_validated_against_the_ranks_and_the_expert_count(moe_dir, tmp_path):
    from forge_rl.models.titan import ParallelConfig, read_hf_config, validate_parallelism

    hf_config = read_hf_config(moe_dir)
    validate_parallelism(ParallelConfig(dp_shard=2, ep=2), 2, hf_config)
    with pytest.raises(
        ValueError,
        match=r"trainer.parallel.ep \(4\) must divide .* = 2 .* 8 experts per layer. Set --trainer.parallel.ep to one of \[1, 2\]",
    ):
        validate_parallelism(ParallelConfig(dp_shard=2, ep=4), 2, hf_config)
    with pytest.raises(ValueError, match=r"experts per layer"):
        validate_parallelism(ParallelConfig(dp_shard=3, ep=3), 3, hf_config)
    dense = read_hf_config(
        create_tiny_model(TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=2), tmp_path / "d")
    )
    with pytest.raises(ValueError, match=r"needs a mixture-of-experts model"):
        validate_parallelism(ParallelConfig(dp_shard=2, ep=2), 2, dense)


def test_the_benchmark_measures_the_mismatch_the_replay_removes(trainer):
    """`forge-rl bench keep-routing`'s measurement on a batch whose behaviour logprobs are the
    replayed forward's own: with the replay nothing is left, without it the foreign routing shows."""
    from forge_rl.bench.keep_routing import _measure

    batch = make_train_batch([_episode([_random_record(4, 30), _random_record(3, 31)])], pad_id=0)
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=trainer.compute_logprobs(batch))
    measured = _measure(trainer, batch)
    assert measured["mismatch_kl_with"] == pytest.approx(0.0, abs=1e-10)
    assert measured["mismatch_kl_without"] > 1e-6 and measured["mismatch_kl_ratio"] < 1e-3
    assert measured["routing_differs_fraction"] > 0.5
    # The tokens no foreign routing reaches compute the same function on both sides: the whole
    # mismatch sits on the affected ones, and a perfect replay reaches the floor of 0.
    assert measured["routing_affected_fraction"] >= measured["routing_differs_fraction"]
    assert measured["without/affected_kl_share"] == pytest.approx(1.0)
    assert measured["ratio_floor"] == pytest.approx(0.0, abs=1e-6)
    assert TOP_K / NUM_EXPERTS <= measured["router_topk_mass"] <= 1.0


def test_the_benchmark_splits_out_the_tokens_that_read_kv_the_record_does_not_describe(trainer):
    """A completion resubmitted to version 1 after two tokens: its continuation attends to KV that
    version 1 encoded anew (`kv_versions`), so those tokens are measured apart."""
    from forge_rl.bench.keep_routing import KeepRoutingArgs, _measure, reencoded_tokens_T

    episode = _episode([_random_record(4, 40), _random_record(3, 41)])
    resubmitted, untouched = episode.completions
    resubmitted.policy_versions, resubmitted.kv_versions = [0, 0, 1, 1], [0, 0, 1, 1]
    # A swap that kept the KV: the tokens after it still read version 0's KV, which the record describes.
    untouched.policy_versions, untouched.kv_versions = [0, 1, 1], [0, 0, 0]
    reencoded_T = reencoded_tokens_T(episode.completions)
    assert reencoded_T == [False, False, True, True, False, False, False]
    batch = make_train_batch([episode], pad_id=0)
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=trainer.compute_logprobs(batch))
    measured = _measure(trainer, batch, torch.tensor(reencoded_T))
    assert measured["with/reencoded_kl_mean"] == pytest.approx(0.0, abs=1e-10)
    assert measured["without/reencoded_kl_mean"] > 0 and measured["reencoded_mismatch_kl_ratio"] < 1e-3
    assert 0 < measured["without/reencoded_kl_share"] < 1

    assert KeepRoutingArgs().resubmit_after == 4  # half of max_new_tokens
    assert KeepRoutingArgs(max_staleness=0).resubmit_after == 0  # no next version to resubmit to
    with pytest.raises(ValueError, match=r"resubmit_after \(8\) must be between 1 and max_new_tokens - 1 \(7\)"):
        KeepRoutingArgs(resubmit_after=8)
    with pytest.raises(ValueError, match=r"needs the next version.*--max-staleness 1"):
        KeepRoutingArgs(resubmit_after=2, max_staleness=0)


def test_the_benchmark_pretrains_its_model_on_the_task_and_refuses_a_dense_one(moe_dir, tmp_path):
    """`--pretrain-steps` lowers the model's loss on the task's text and records it beside the
    weights; `--model-path` to a dense model is refused before anything starts."""
    from forge_rl.bench.keep_routing import KeepRoutingArgs, _prepare_model

    args = KeepRoutingArgs(model_path=moe_dir, pretrain_steps=30, pretrain_batch_size=8, out_dir=tmp_path)
    _prepare_model(args, tmp_path / "model")
    figures = json.loads((tmp_path / "model" / "pretrain.json").read_text())
    assert figures["final_loss"] < figures["first_loss"] - 0.5
    assert (moe_dir / "config.json").is_file() and not (moe_dir / "pretrain.json").exists()  # the source untouched
    dense = create_tiny_model(TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=2), tmp_path / "dense")
    with pytest.raises(ValueError, match="is a dense model"):
        _prepare_model(dataclasses.replace(args, model_path=dense), tmp_path / "model2")
    with pytest.raises(ValueError, match=r"pretrain_steps \(-1\) must be >= 0. Set --pretrain-steps"):
        KeepRoutingArgs(pretrain_steps=-1)
    with pytest.raises(ValueError, match="reward_seeds is empty"):
        KeepRoutingArgs(reward_seeds=())


def test_the_torchtitan_moe_is_the_hf_qwen3_moe_checkpoint_in_and_out(moe_dir):
    """Logits equal transformers' Qwen3MoeForCausalLM (fp32) and the export is the checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from forge_rl.models.titan import ParallelConfig, build_titan_model, export_hf_state_dict

    model, _ = build_titan_model(moe_dir, ParallelConfig(), torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(moe_dir)
    ids = torch.tensor([PROMPT + [9, 11, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, rtol=0, atol=1e-5)
    exported, checkpoint = export_hf_state_dict(model), load_file(moe_dir / "model.safetensors")
    assert exported.keys() == checkpoint.keys()
    assert all(torch.equal(exported[name], checkpoint[name]) for name in checkpoint)
