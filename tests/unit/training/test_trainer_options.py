"""Trainer options (batching layout, activation checkpointing, mixed precision, HSDP degree) are
validated at config time, naming the field, the value and the flag."""

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.models.titan import ParallelConfig, validate_parallelism
from forge_rl.training.trainer import TrainerConfig
from forge_rl.yaml_config import load_yaml_config

HF_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True}


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("batching", "zip", "trainer.batching (zip) must be one of pad, bucket, pack, tree. Set --trainer.batching."),
        ("activation_checkpointing", "selective", "trainer.activation_checkpointing (selective) must be none or full"),
        (
            "mixed_precision",
            "fp16",
            "trainer.mixed_precision (fp16) must be fp32 or bf16. Set --trainer.mixed-precision.",
        ),
    ],
)
def test_an_unknown_option_value_is_refused_naming_the_flag(field, value, message):
    with pytest.raises(ValueError) as error:
        TrainerConfig(**{field: value})
    assert message in str(error.value)


def test_every_option_value_is_accepted_and_kept():
    for batching in ("pad", "bucket", "pack", "tree"):
        for checkpointing in ("none", "full"):
            for precision in ("fp32", "bf16"):
                config = TrainerConfig(
                    batching=batching, activation_checkpointing=checkpointing, mixed_precision=precision
                )
                assert (config.batching, config.activation_checkpointing, config.mixed_precision) == (
                    batching,
                    checkpointing,
                    precision,
                )


def test_the_tree_layout_is_refused_with_routing_replay_naming_the_fix():
    with pytest.raises(
        ValueError, match="trainer.batching tree with trainer.keep_routing.*Set --trainer.batching pack"
    ):
        TrainerConfig(batching="tree", keep_routing=True)


def test_dp_replicate_counts_in_the_process_product():
    with pytest.raises(ValueError, match=r"= 4 must equal trainer.num_procs \(2\).*--trainer.parallel.dp-replicate"):
        validate_parallelism(ParallelConfig(dp_replicate=2, dp_shard=2), 2, HF_CONFIG)
    validate_parallelism(ParallelConfig(dp_replicate=2, dp_shard=2), 4, HF_CONFIG)
    assert ParallelConfig(dp_replicate=2, dp_shard=3).dp_degree == 6
    with pytest.raises(ValueError, match=r"trainer.parallel.dp_replicate \(0\) must be >= 1"):
        ParallelConfig(dp_replicate=0)


def test_tp_with_replicas_cannot_train_tied_embeddings():
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        validate_parallelism(ParallelConfig(dp_replicate=2, tp=2), 4, HF_CONFIG)


def test_the_batch_must_split_over_every_data_parallel_rank(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "train_batch_size: 6\ngroup_size: 2\ntrainer:\n  num_procs: 4\n  parallel:\n    dp_replicate: 2\n    dp_shard: 2\n"
    )
    with pytest.raises(ConfigError, match=r"train_batch_size \(6\) is not divisible by .* = 4"):
        load_yaml_config(GRPOConfig, path)


def test_the_yaml_reaches_the_new_options(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("trainer:\n  batching: bucket\n  activation_checkpointing: full\n  mixed_precision: bf16\n")
    trainer = load_yaml_config(GRPOConfig, path).trainer
    assert (trainer.batching, trainer.activation_checkpointing, trainer.mixed_precision) == ("bucket", "full", "bf16")
