"""Config validation: every bad value fails at construction, naming the field and the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from forge_rl.cli import parse_config
from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.errors import ConfigError
from forge_rl.store.publisher import PublishConfig
from forge_rl.yaml_config import load_yaml_config

REPO = Path(__file__).resolve().parents[2]


def write_yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# SmolLM2-135M-Instruct's config.json as `forge-rl convert` writes it (the fields validation reads).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "head_dim": 64,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "dtype": "float32",
}


def _stub_model_dir(model_dir: Path) -> Path:
    """Stands in for models/SmolLM2-135M-Instruct, which a clone has only after `forge-rl convert`:
    validation reads config.json and checks the other files exist (the shapes LoRA's rank is
    checked against come from config.json)."""
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (model_dir / name).write_text("")
    return model_dir


@pytest.mark.parametrize("config_file", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(config_file, tmp_path, monkeypatch):
    model_path = yaml.safe_load(config_file.read_text()).get("model", {}).get("path")
    if model_path is not None:  # a converted model, relative to the repository root
        assert model_path == "models/SmolLM2-135M-Instruct", "stub the new model dir here"
        monkeypatch.chdir(tmp_path)
        _stub_model_dir(tmp_path / model_path)
    assert isinstance(load_yaml_config(GRPOConfig, config_file), GRPOConfig)


@pytest.mark.parametrize(
    "yaml_text,message",
    [
        ("stpes: 3\n", "unknown key(s) stpes"),
        ("buffer:\n  max_age: 1\n", "unknown key(s) buffer.max_age"),
        ("buffer:\n  max_policy_age: -1\n", "buffer.max_policy_age (-1) must be >= 0"),
        ("steps: ten\n", "steps must be int"),
        ("task:\n  name: sort\n", "task.name ('sort') must be one of"),
        ("train_batch_size: 100\ngroup_size: 8\n", "train_batch_size (100) is not divisible by group_size (8)"),
        ("trainer:\n  num_procs: 3\n  parallel:\n    tp: 3\n", "trainer.parallel.tp (3) must divide"),
        ("trainer:\n  num_procs: 2\n  parallel:\n    tp: 1\n", "must equal trainer.num_procs (2)"),
        ("model:\n  path: /no/such/model\n", "model.path (/no/such/model) lacks config.json"),
        ("model:\n  tiny:\n    hidden_size: 64\n", "head_dim"),
        ("group_size: 1\ntrain_batch_size: 8\n", "group_size (1) must be >= 2"),
        ("generator:\n  temperature: 0\n", "generator.temperature (0.0) must be > 0"),
        (
            "generator:\n  tensor_parallel_size: 0\n",
            "generator.tensor_parallel_size (0) must be >= 1. Set --generator.tensor-parallel-size.",
        ),
        ("buffer:\n  capacity_episodes: 4\n", "buffer.capacity_episodes (4) is below one step's prompts (16)"),
        ("- a\n- b\n", "must hold a mapping"),
        ("publish:\n  dtype: int8\n", "publish.dtype"),
        ("scorer:\n  overlong_buffer: 0\n", "scorer.overlong_buffer (0) must be >= 1"),
        ("buffer:\n  sampling: freshest\n", "buffer.sampling (freshest) cannot go with buffer.admission (pause)"),
        (
            "buffer:\n  wait_for_stragglers: false\n",
            "buffer.wait_for_stragglers (false) with buffer.drop_policy (drop_episode) would drop a straggler",
        ),
        (
            "buffer:\n  wait_for_stragglers: false\n  admission: drop\n  drop_policy: mask_tokens\n",
            "buffer.wait_for_stragglers (false) is an option of buffer.admission pause",
        ),
        (
            "group_size: 6\ntrain_batch_size: 96\ntrainer:\n  loss:\n    kl_beta: 0.1\n"
            "reference:\n  num_procs: 4\n  parallel:\n    dp_shard: 4\n",
            "group_size (6) is not divisible by reference.parallel.dp_replicate (1) * "
            "reference.parallel.dp_shard (4) = 4",
        ),
        ("train_step_timeout_s: 0\n", "train_step_timeout_s (0.0) must be > 0 and finite"),
        (
            "generator:\n  generate_timeout_s: -1\n",
            "generator.generate_timeout_s (-1.0) must be > 0 and finite, or unset. Set --generator.generate-timeout-s.",
        ),
        (
            "generator:\n  swap_mode: wait\n  generate_timeout_s: 900\n  update_timeout_s: 600\n",
            "generator.update_timeout_s (600) is below the generate timeout (900 s) with generator.swap_mode wait",
        ),
        ("generator:\n  engine: sim\n", "generator.engine (sim) and trainer.engine (torchtitan) must both be sim"),
        ("generator:\n  segment_tokens: 0\n", "generator.segment_tokens (0) must be >= 1 (or unset: no segments)"),
        (
            "generator:\n  engine: sim\n  segment_tokens: 8\n",
            "generator.segment_tokens (8) needs generator.engine vllm: the simulated engine decodes each group in one piece",
        ),
        (
            "model:\n  tiny:\n    num_experts: 8\ntrainer:\n  keep_routing: true\n",
            "trainer.keep_routing is on but generator.record_routing is off",
        ),
        ("generator:\n  record_routing: true\n", "generator.record_routing is on but the model is dense"),
        ("trainer:\n  engine: sim\n", "generator.engine (vllm) and trainer.engine (sim) must both be sim"),
        (
            "generator:\n  engine: sim\ntrainer:\n  engine: sim\ncheckpoint:\n  enabled: true\n",
            "a simulated trainer (trainer.engine sim) has no state to checkpoint. Set --checkpoint.enabled false",
        ),
        (
            "trainer:\n  lora:\n    enabled: true\n    rank: 200\n",
            "trainer.lora.rank (200) exceeds the smaller dimension of 5 targeted layer(s), e.g. wqkv [384 x 128]",
        ),
        (
            "trainer:\n  lora:\n    enabled: true\n    targets: [q_proj, wo]\n",
            "trainer.lora.targets ['q_proj'] match no linear layer of the model. Its linear layers are named "
            "['lm_head', 'w1', 'w2', 'w3', 'wo', 'wqkv']",
        ),
        (  # the tiny model's vocabulary (46) is smaller than its width (128)
            "trainer:\n  lora:\n    enabled: true\n    rank: 64\n    targets: [wo, lm_head]\n",
            "trainer.lora.rank (64) exceeds the smaller dimension of 1 targeted layer(s), e.g. lm_head [46 x 128]",
        ),
        (
            "generator:\n  engine: sim\n  sim:\n    length_sigma: -1\ntrainer:\n  engine: sim\n",
            "generator.sim.length_sigma (-1.0) must be >= 0 and finite. Set --generator.sim.length-sigma.",
        ),
    ],
)
def test_invalid_yaml_fails_naming_the_field(tmp_path, yaml_text, message):
    with pytest.raises(ConfigError) as error:
        load_yaml_config(GRPOConfig, write_yaml(tmp_path, yaml_text))
    assert message in str(error.value)


def test_the_configs_these_checks_refuse_have_a_valid_neighbour(tmp_path):
    """Each refusal above is about the relation it names, not about its fields alone."""
    for text in (
        "scorer:\n  overlong_buffer: 1\n",
        "buffer:\n  sampling: freshest\n  admission: drop\n",
        "group_size: 8\ntrain_batch_size: 96\ntrainer:\n  loss:\n    kl_beta: 0.1\n"
        "reference:\n  num_procs: 4\n  parallel:\n    dp_shard: 4\n",
        "generator:\n  swap_mode: keep\n  generate_timeout_s: 900\n  update_timeout_s: 600\n",
        "generator:\n  engine: sim\ntrainer:\n  engine: sim\n",
        "model:\n  tiny:\n    num_experts: 8\ngenerator:\n  record_routing: true\ntrainer:\n  keep_routing: true\n",
        "trainer:\n  lora:\n    enabled: true\n    rank: 128\n    targets: [wo]\n",
        "trainer:\n  lora:\n    enabled: true\n    rank: 46\n    targets: [wo, lm_head]\n",
    ):
        assert isinstance(load_yaml_config(GRPOConfig, write_yaml(tmp_path, text)), GRPOConfig)


def test_flags_override_the_yaml_which_overrides_defaults(tmp_path):
    path = write_yaml(tmp_path, "steps: 7\nbuffer:\n  max_policy_age: 3\n")
    config = parse_config(GRPOConfig, ["--config", str(path), "--buffer.max-policy-age", "0"], prog="forge-rl grpo")
    assert config.steps == 7
    assert config.buffer.max_policy_age == 0
    assert config.group_size == GRPOConfig().group_size


def test_a_user_model_directory_is_checked_against_the_parallelism(tmp_path):
    hf_config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("")
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\)"):
        load_yaml_config(
            GRPOConfig,
            write_yaml(tmp_path, f"model:\n  path: {tmp_path}\ntrainer:\n  num_procs: 3\n  parallel:\n    tp: 3\n"),
        )


def test_an_unsupported_architecture_is_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("")
    with pytest.raises(ConfigError, match="supports: LlamaForCausalLM"):
        load_yaml_config(GRPOConfig, write_yaml(tmp_path, f"model:\n  path: {tmp_path}\n"))


def test_a_model_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("")
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        load_yaml_config(GRPOConfig, write_yaml(tmp_path, f"model:\n  path: {tmp_path}\n"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forge_rl.cli", *args], capture_output=True, text=True, cwd=REPO)


def test_help_lists_subcommands_and_every_grpo_option_with_its_meaning():
    assert "grpo" in run_cli("--help").stdout
    help_text = run_cli("grpo", "--help").stdout
    for flag in (
        "--buffer.max-policy-age",
        "--trainer.parallel.tp",
        "--trainer.parallel.dp-shard",
        "--generator.max-new-tokens",
        "--model.path",
        "--train-batch-size",
    ):
        assert flag in help_text
    assert "Largest allowed (trainer version - token version)" in help_text


def test_an_invalid_config_exits_before_starting_anything(tmp_path):
    result = run_cli("grpo", "--buffer.max-policy-age", "-1", "--run-dir", str(tmp_path))
    assert result.returncode != 0
    assert "buffer.max_policy_age (-1) must be >= 0" in " ".join(result.stderr.replace("│", " ").split())
    assert not any(tmp_path.iterdir())  # no run directory was written


def test_a_flag_fixes_what_the_file_alone_gets_wrong_and_every_check_still_runs(tmp_path, capsys):
    """The recipe names models/SmolLM2-135M-Instruct; on a machine where the model is elsewhere,
    --model.path must win instead of the file's path failing first. The checks then run on the
    result: an unrelated flag does not hide the file's error, nor another field's."""
    path = write_yaml(tmp_path, "model:\n  path: /no/such/model\nsteps: 7\n")
    model_dir = _stub_model_dir(tmp_path / "elsewhere")
    config = parse_config(GRPOConfig, ["--config", str(path), "--model.path", str(model_dir)], prog="forge-rl grpo")
    assert (config.model.path, config.steps) == (model_dir, 7)

    def refusal(*flags: str) -> str:
        with pytest.raises((ConfigError, SystemExit)) as error:  # tyro prints its own and exits 2
            parse_config(GRPOConfig, ["--config", str(path), *flags], prog="forge-rl grpo")
        return " ".join(f"{error.value} {capsys.readouterr().err}".replace("│", " ").split())

    assert f"{path}: model.path (/no/such/model) lacks config.json" in refusal()
    assert "model.path (/no/such/model) lacks config.json" in refusal("--steps", "2")
    path = write_yaml(tmp_path, "model:\n  path: /no/such/model\nbuffer:\n  max_policy_age: -1\n")
    assert "buffer.max_policy_age (-1) must be >= 0" in refusal("--model.path", str(model_dir))


def test_the_publish_section_reaches_the_trainer_config(tmp_path):
    path = write_yaml(tmp_path, "publish:\n  dtype: bfloat16\n  background: false\n")
    config = parse_config(GRPOConfig, ["--config", str(path), "--publish.no-checksum"], prog="forge-rl grpo")
    assert (config.publish.dtype, config.publish.background, config.publish.checksum) == ("bfloat16", False, False)
    assert GRPOConfig().publish == PublishConfig()


def test_a_token_capacity_below_one_step_is_refused_before_anything_starts():
    # 4 prompts per step; an episode holds up to 128 - 4 + 8 * 4 = 156 tokens (tiny model: 128 positions).
    with pytest.raises(ConfigError, match=r"buffer.capacity_tokens \(300\) is below one step's prompts \(4\)"):
        GRPOConfig(train_batch_size=32, group_size=8, buffer=BufferConfig(capacity_tokens=300))


def test_the_gate_admits_no_more_than_the_buffer_holds():
    config = GRPOConfig(train_batch_size=32, group_size=8, buffer=BufferConfig(max_policy_age=3, capacity_episodes=6))
    assert config.max_episodes_queued == 6  # the age bound alone would admit (3 + 1) * 4 = 16
    tokens = GRPOConfig(
        train_batch_size=32, group_size=8, buffer=BufferConfig(capacity_tokens=10 * config.max_episode_tokens)
    )
    assert tokens.max_episodes_queued == min(8, 10)  # (1 + 1) * 4 by age, 10 by tokens


def test_generator_timeouts_are_derived_from_what_a_call_can_legitimately_take():
    demo = load_yaml_config(GRPOConfig, REPO / "configs" / "grpo_tiny_cpu.yaml")
    # 16 prompts x 8 samples in flight fit one vLLM batch (256): one round of 2 decode steps.
    assert demo.generate_timeout_s == 300 + 1 * 2 * 1.0
    assert demo.update_timeout_s == 600
    # 64 x 16 = 1024 sequences in flight: a call may wait out 4 rounds of 512 decode steps.
    queued = GRPOConfig(
        prompts_in_flight_per_generator=64,
        group_size=16,
        train_batch_size=128,
        generator=GeneratorConfig(max_new_tokens=512),
    )
    assert queued.generate_timeout_s == 300 + 4 * 512 * 1.0
    # A "wait" swap first drains every request in flight: an update may take a whole generate call.
    draining = GRPOConfig(generator=GeneratorConfig(swap_mode="wait"))
    assert draining.update_timeout_s == 600 + draining.generate_timeout_s
    explicit = GRPOConfig(generator=GeneratorConfig(generate_timeout_s=5, update_timeout_s=7))
    assert (explicit.generate_timeout_s, explicit.update_timeout_s) == (5, 7)


def test_simulated_roles_place_no_compute_threads(tmp_path):
    """A simulated engine or trainer step is a timed wait: 128 of them fit a 2-core host."""
    from forge_rl.plumbing.placement import demand_of

    config = load_yaml_config(GRPOConfig, REPO / "configs" / "sim_scale.yaml")
    demand = demand_of(config)
    assert config.simulated and demand.generator_threads == 0 and demand.trainer_threads == 0


def test_the_machine_check_lets_128_simulated_generators_run_on_this_host(tmp_path):
    """The core and KV-memory checks guard real engines; simulated ones use neither."""
    import dataclasses

    from forge_rl.run.preflight import check_machine

    config = load_yaml_config(GRPOConfig, REPO / "configs" / "sim_scale.yaml")
    check_machine(dataclasses.replace(config, num_generators=128, run_dir=tmp_path))


@pytest.mark.parametrize("section", ["reward_model", "judge"])
def test_a_reward_model_or_judge_with_an_environment_is_refused_naming_the_fields_and_the_fix(tmp_path, section):
    """They read a completion's text, and a trajectory's is its last turn: they would grade a
    fragment, so the combination is refused before anything starts instead of spawning them."""
    model = _stub_model_dir(tmp_path / section)
    text = (
        "environment:\n  name: calculator\n  limits:\n    max_total_tokens: 64\n    max_tokens_per_turn: 12\n"
        f"scorer:\n  {section}:\n    path: {model}\n"
    )
    with pytest.raises(ConfigError) as error:
        load_yaml_config(GRPOConfig, write_yaml(tmp_path, text))
    message = str(error.value)
    assert f"scorer.{section}.path ({model})" in message and "environment.name ('calculator')" in message
    assert f"Unset --scorer.{section.replace('_', '-')}.path" in message
    assert "--scorer.teacher" in message  # what can score trajectories: a teacher
