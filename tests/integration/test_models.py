"""HF checkpoints in and out, for both families, on tiny checkpoints written here with `transformers`.

- llama3: LlamaForCausalLM, GQA (4 heads, 2 kv heads), untied embeddings, saved in 200 KB shards
  (model.safetensors.index.json), exported again in shards.
- qwen3: Qwen3ForCausalLM, GQA, head_dim 64 != hidden_size / heads (as in Qwen3-0.6B), tied
  embeddings, q/k norms, one model.safetensors.

Per family, one PolicyTrainer (one process, fp32) takes one GRPO step and exports to an HF
directory; transformers and vLLM then load that directory. vLLM starts once per family (the slow
part: 15-30 s each).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.models.hf_checkpoint import INDEX_FILE, export_hf_model_dir, weight_files
from forge_rl.models.titan import ParallelConfig, build_titan_model, read_hf_config, validate_parallelism
from forge_rl.tasks import tokenizer as char_tokenizer
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Completion, Episode
from tests.support.helpers import run_on_ranks

pytestmark = pytest.mark.integration

FAMILIES = ("llama3", "qwen3")
LOGITS_ATOL = 1e-4
MAX_MISMATCH_KL = 1e-3
# Per family: (transformers config class, fields that differ, save_pretrained max_shard_size).
CHECKPOINTS = {
    "llama3": ("LlamaConfig", dict(head_dim=32, tie_word_embeddings=False, rope_theta=10000.0), "200KB"),
    "qwen3": ("Qwen3Config", dict(head_dim=64, tie_word_embeddings=True, rope_theta=1e6), None),
}
# llama3 is exported in ~100 KB shards to exercise the index; qwen3 as one file.
EXPORT_SHARD_BYTES = {"llama3": 100_000, "qwen3": 10**9}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough for O(1) logits (transformers' init gives ~0.2), and norm weights away
    from 1, so a swapped or dropped norm (q_norm vs k_norm, say) changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)


def create_checkpoint(family: str, model_dir: Path) -> Path:
    import transformers

    config_name, fields, max_shard_size = CHECKPOINTS[family]
    tokenizer = char_tokenizer.build_char_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=char_tokenizer.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.token_to_id(char_tokenizer.BOS),
        eos_token_id=tokenizer.token_to_id(char_tokenizer.EOS),
        pad_token_id=tokenizer.token_to_id(char_tokenizer.PAD),
        dtype="float32",
        **fields,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=FAMILIES.index(family))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(model_dir, **kwargs)
    transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(model_dir)
    char_tokenizer.save_char_tokenizer(model_dir)
    return model_dir


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, char_tokenizer.VOCAB_SIZE, (4, 24), generator=torch.Generator().manual_seed(seed))


def _episodes() -> list[Episode]:
    """2 prompts x 3 completions of uneven lengths, rewards that differ within each group."""
    episodes = []
    for e, lengths in enumerate([(5, 2, 4), (3, 6, 1)]):
        completions = [
            Completion(
                token_ids=[(7 * e + 3 * c + 5 * t) % (char_tokenizer.VOCAB_SIZE - 4) + 4 for t in range(n)],
                logprobs=[0.0] * n,
                policy_versions=[0] * n,
                reward=float(c == e),
            )
            for c, n in enumerate(lengths)
        ]
        episodes.append(Episode(e, f"P{e}=", "", [1, 10 + e, 20 + e, 14], completions))
    return episodes


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, create_checkpoint(family, tmp_path_factory.mktemp(family) / "hf")


@dataclasses.dataclass
class Trained:
    """One family after one GRPO step: the trainer, its HF weights and their export."""

    family: str
    source_dir: Path
    trainer: PolicyTrainer
    hf_state_dict: dict[str, torch.Tensor]
    export_dir: Path


@pytest.fixture(scope="module")
def trained(checkpoint, single_process, tmp_path_factory) -> Trained:
    family, source_dir = checkpoint
    trainer = PolicyTrainer(TrainerConfig(), source_dir)
    batch = make_train_batch(_episodes(), pad_id=read_hf_config(source_dir)["pad_token_id"])
    # Behaviour = the current policy: ratio 1, so the step follows the advantages alone.
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=trainer.compute_logprobs(batch) * batch.loss_mask_NL)
    trainer.train_step(batch)
    hf_state_dict = trainer.hf_state_dict()
    export_dir = export_hf_model_dir(
        hf_state_dict, source_dir, tmp_path_factory.mktemp(f"{family}_export") / "hf", EXPORT_SHARD_BYTES[family]
    )
    return Trained(family, source_dir, trainer, hf_state_dict, export_dir)


def test_source_checkpoints_have_the_intended_layout(checkpoint):
    family, model_dir = checkpoint
    if family == "llama3":
        assert len(weight_files(model_dir)) > 1 and (model_dir / INDEX_FILE).is_file()
    else:
        assert [path.name for path in weight_files(model_dir)] == ["model.safetensors"]
        assert read_hf_config(model_dir)["tie_word_embeddings"] is True


def test_trainer_logits_match_transformers(checkpoint, single_process):
    family, model_dir = checkpoint
    model, _ = build_titan_model(model_dir, ParallelConfig(), torch.device("cpu"))
    tokens = random_tokens(seed=1)
    with torch.no_grad():
        expected = hf_model(model_dir)(tokens).logits
        diff = (model(tokens) - expected).abs().max().item()
    print(f"{family}: max |trainer - transformers| logits = {diff:.2e} (logit std {expected.std():.2f})")
    assert expected.std() > 0.5  # O(1) logits, so the tolerance is meaningful
    assert diff < LOGITS_ATOL


def test_export_reloads_in_transformers_with_identical_weights(trained):
    from transformers import AutoModelForCausalLM

    source = hf_model(trained.source_dir).state_dict()
    moved = max((trained.hf_state_dict[name] - source[name]).abs().max().item() for name in trained.hf_state_dict)
    assert moved > 1e-4, "the training step did not change the weights; the test would prove nothing"

    reloaded, info = AutoModelForCausalLM.from_pretrained(
        trained.export_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    reloaded_state_dict = reloaded.state_dict()
    for name, tensor in trained.hf_state_dict.items():
        assert torch.equal(reloaded_state_dict[name], tensor), name
    tied = read_hf_config(trained.source_dir)["tie_word_embeddings"]
    assert set(reloaded_state_dict) - set(trained.hf_state_dict) == ({"lm_head.weight"} if tied else set())

    tokens = random_tokens(seed=2)
    with torch.no_grad():
        diff = (trained.trainer.model(tokens) - reloaded.eval()(tokens).logits).abs().max().item()
    print(f"{trained.family}: max |post-step trainer - reloaded export| logits = {diff:.2e}")
    assert diff < LOGITS_ATOL


def test_export_directory_layout(trained):
    out, source = trained.export_dir, trained.source_dir
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == read_hf_config(source)["architectures"]
    assert config["dtype"] == "float32"
    shards = weight_files(out)
    if trained.family == "llama3":
        assert len(shards) > 1
        weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
        assert set(weight_map) == set(trained.hf_state_dict)
        for shard in shards:
            names = [name for name, file in weight_map.items() if file == shard.name]
            # As save_pretrained does: a tensor above the limit (the 128 KB MLP weights) goes alone.
            nbytes = sum(trained.hf_state_dict[name].nbytes for name in names)
            assert len(names) == 1 or nbytes <= EXPORT_SHARD_BYTES["llama3"], shard.name
    else:
        assert [path.name for path in shards] == ["model.safetensors"]
    assert not list(out.parent.glob(".*partial"))


def test_export_loads_back_into_the_trainer(trained):
    model, _ = build_titan_model(trained.export_dir, ParallelConfig(), torch.device("cpu"))
    tokens = random_tokens(seed=3)
    with torch.no_grad():
        assert torch.equal(model(tokens), trained.trainer.model(tokens))


def _sample_with_vllm(model_dir: Path, prompts: list[list[int]]) -> list[list[Completion]]:
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine

    # Temperature 1: the trainer's logprobs are log_softmax(logits), unscaled.
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=24, temperature=1.0))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start(model_dir, max_model_len=128))
        return [loop.run_until_complete(engine.generate(p, n=4, eos_id=None)) for p in prompts]
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


def test_vllm_serves_the_export_with_the_trainers_logprobs(trained):
    """vLLM loads the exported directory unchanged; its behaviour logprobs of the tokens it sampled
    match the post-step trainer's (mismatch KL, k3 estimator, mean over tokens)."""
    tokenizer = char_tokenizer.PromptTokenizer(trained.export_dir)
    prompts = [tokenizer.encode_prompt(text) for text in ("M37=", "C5=")]
    groups = _sample_with_vllm(trained.export_dir, prompts)

    episodes = [Episode(i, "", "", prompt, group) for i, (prompt, group) in enumerate(zip(prompts, groups))]
    batch = make_train_batch(episodes, pad_id=tokenizer.pad_id)
    mask = batch.loss_mask_NL
    trainer_logprobs = trained.trainer.compute_logprobs(batch)[mask].double()
    vllm_logprobs = batch.behaviour_logprobs_NL[mask].double()
    log_ratio = trainer_logprobs - vllm_logprobs
    mismatch_kl = (log_ratio.exp() - 1 - log_ratio).mean().item()
    max_diff = log_ratio.abs().max().item()
    print(
        f"{trained.family}: vLLM vs trainer over {mask.sum()} tokens: k3 KL {mismatch_kl:.2e}, max |dlogp| {max_diff:.2e}"
    )
    assert mask.sum() == 2 * 4 * 24
    assert mismatch_kl < MAX_MISMATCH_KL


@pytest.mark.parametrize(
    "architecture, overrides, offending",
    [
        ("GPT2LMHeadModel", {"model_type": "gpt2"}, r"architectures \['GPT2LMHeadModel'\]"),
        ("Qwen3ForCausalLM", {"num_experts": 8, "moe_intermediate_size": 64}, "num_experts=8"),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=True"),
        ("Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias=True"),
    ],
    ids=["gpt2", "qwen3-moe", "qwen3-sliding-window", "qwen3-yarn", "llama-gelu", "llama-attention-bias"],
)
def test_unsupported_configs_fail_naming_what_is_supported(tmp_path, architecture, overrides, offending):
    config = {"architectures": [architecture], "hidden_size": 128, "num_attention_heads": 4, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=offending) as error:
        read_hf_config(tmp_path)
    message = str(error.value)
    assert "supports" in message and "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message


# Small enough that 5 steps stay inside the clip range (at 1e-4 every token is clipped by step 3 and
# the loss stops moving); the weights still move 10x beyond the tolerance.
PARALLEL_CONFIG = TrainerConfig(lr=2e-5, adam_eps=1e-5)
NUM_PARALLEL_STEPS = 5


def _parallel_batch(trainer: PolicyTrainer):
    batch = make_train_batch(_episodes(), pad_id=0)
    noise = 0.05 * torch.randn(batch.input_ids_NL.shape, generator=torch.Generator().manual_seed(0))
    return dataclasses.replace(
        batch, behaviour_logprobs_NL=(trainer.compute_logprobs(batch) + noise) * batch.loss_mask_NL
    )


def _run_rank(rank: int, parallel: ParallelConfig, model_dir: Path, batch, out: Path):
    trainer = PolicyTrainer(dataclasses.replace(PARALLEL_CONFIG, num_procs=2, parallel=parallel), model_dir)
    losses = [trainer.train_step(batch)["loss"] for _ in range(NUM_PARALLEL_STEPS)]
    state_dict = trainer.hf_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state_dict": state_dict}, out)


@pytest.fixture(scope="module")
def qwen3_reference(single_process, tmp_path_factory):
    """The tied qwen3 checkpoint and its 1-process run: (dir, batch, losses, final HF weights)."""
    model_dir = create_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_parallel") / "hf")
    trainer = PolicyTrainer(PARALLEL_CONFIG, model_dir)
    batch = _parallel_batch(trainer)
    losses = [trainer.train_step(batch)["loss"] for _ in range(NUM_PARALLEL_STEPS)]
    return model_dir, batch, losses, trainer.hf_state_dict()


@pytest.mark.parametrize("parallel", [ParallelConfig(dp_shard=2), ParallelConfig(tp=2)], ids=["fsdp2", "tp2"])
def test_qwen3_with_tied_embeddings_trains_the_same_on_two_processes(parallel, qwen3_reference, tmp_path):
    """parallelize_qwen3 over gloo, q/k norms and tied embeddings included (TP unties them unless
    titan.py re-ties them): 5 losses equal to 4 decimals, final weights within 1e-6."""
    model_dir, batch, reference_losses, reference_state_dict = qwen3_reference
    out = tmp_path / "rank0.pt"
    run_on_ranks(_run_rank, parallel, model_dir, batch, out)
    result = torch.load(out)
    assert len(set(reference_losses)) == NUM_PARALLEL_STEPS  # every step changed the loss
    assert result["losses"] == pytest.approx(reference_losses, abs=1e-4)
    source = hf_model(model_dir).state_dict()
    for name, expected in reference_state_dict.items():
        assert (expected - source[name]).abs().max() > 1e-5, name
        assert (result["state_dict"][name] - expected).abs().max() < 1e-6, name


def test_tied_embeddings_refuse_tp_with_fsdp():
    hf_config = {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true.*Set --trainer.parallel.tp 1"):
        validate_parallelism(ParallelConfig(dp_shard=2, tp=2), 4, hf_config)
    validate_parallelism(ParallelConfig(tp=2), 2, hf_config)
    validate_parallelism(ParallelConfig(dp_shard=2), 2, hf_config)
