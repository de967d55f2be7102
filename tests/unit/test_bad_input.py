"""The bad-input catalogue: each case fails before any process starts, with a message that names the
problem and its fix, and leaves no run directory (not even a .partial one) behind.

Cases run in this process through the same entry points the CLI uses: `load_yaml_config` and the
config constructors (what `forge-rl grpo` parses), then `create_run_dir` (the first thing
`apps.grpo.main.run` does, before spawning anything). A few run the real `forge-rl` command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from forge_rl.config import GRPOConfig, ModelConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.errors import ConfigError
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.models.titan import ParallelConfig
from forge_rl.run import preflight
from forge_rl.run.run_dir import create_run_dir, remove_unstarted_run_dir
from forge_rl.tasks import TaskConfig
from forge_rl.training.trainer import TrainerConfig
from forge_rl.yaml_config import load_yaml_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


@dataclasses.dataclass
class Scene:
    """What a case may use: a fresh parent of run directories and a copy of a tiny model directory."""

    tmp_path: Path
    tiny_model: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def runs(self) -> Path:
        return self.tmp_path / "runs"

    def load_yaml(self, text: str) -> GRPOConfig:
        path = self.tmp_path / "config.yaml"
        path.write_text(text)
        return load_yaml_config(GRPOConfig, path)

    def start(self, **fields) -> Path:
        """Build the config as the CLI does and create its run directory as `run` does."""
        return create_run_dir(GRPOConfig(run_dir=fields.pop("run_dir", self.runs), run_name="run", **fields))

    def model(self, damage: Callable[[Path], None]) -> Path:
        model_dir = self.tmp_path / "model"
        shutil.copytree(self.tiny_model, model_dir)
        damage(model_dir)
        return model_dir

    def start_with_model(self, damage: Callable[[Path], None]) -> Path:
        return self.start(model=ModelConfig(path=self.model(damage)))


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda model_dir: (model_dir / name).write_text(text)


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(model_dir: Path) -> None:
        data = json.loads((model_dir / name).read_text())
        edit(data)
        (model_dir / name).write_text(json.dumps(data))

    return damage


def _drop_vocabulary_entry(token: str) -> Callable[[Path], None]:
    return _edit_json("tokenizer.json", lambda data: data["model"]["vocab"].pop(token))


def _many_compute_threads(scene: Scene) -> Path:
    num_threads = preflight.MAX_COMPUTE_THREADS_PER_CORE * len(os.sched_getaffinity(0)) + 1
    return scene.start(trainer=TrainerConfig(num_threads=num_threads))


def _more_trainer_ranks_than_gpus(scene: Scene) -> Path:
    scene.monkeypatch.setattr(preflight, "local_gpu_count", lambda: 1)
    return scene.start(trainer=TrainerConfig(num_procs=2, parallel=ParallelConfig(dp_shard=2)))


def _generator_without_a_gpu_of_its_own(scene: Scene) -> Path:
    scene.monkeypatch.setattr(preflight, "local_gpu_count", lambda: 1)
    return scene.start()  # 1 trainer rank on device 0, the generator on device 1


def _tensor_parallel_generator_on_cpu(scene: Scene) -> Path:
    scene.monkeypatch.setattr(preflight, "local_gpu_count", lambda: 0)
    return scene.start(generator=GeneratorConfig(tensor_parallel_size=2))


def _run_dir_under_a_file(scene: Scene) -> Path:
    (scene.tmp_path / "a_file").write_text("")
    return scene.start(run_dir=scene.tmp_path / "a_file" / "runs")


def _run_dir_read_only(scene: Scene) -> Path:
    scene.runs.mkdir()
    scene.runs.chmod(0o500)
    return scene.start()


def _run_dir_taken(scene: Scene) -> Path:
    (scene.runs / "run").mkdir(parents=True)
    (scene.runs / "run" / "metrics.jsonl").write_text("{}\n")
    return scene.start()


# (case id, the bad input, fragments the message must contain: the problem and the fix)
CASES: list = [
    # config files and values
    ("yaml_tab", lambda s: s.load_yaml("steps: 3\n\tgroup_size: 4\n"), ("line 2, column 1", "replace the tab")),
    (
        "yaml_syntax",
        lambda s: s.load_yaml("steps: [3\ngroup_size: 4\n"),
        ("not valid YAML", "line 2", "Fix the syntax"),
    ),
    (
        "yaml_unknown_key",
        lambda s: s.load_yaml("trainer:\n  learning_rate: 0.1\n"),
        ("trainer.learning_rate", "valid keys"),
    ),
    (
        "negative_lr",
        lambda s: s.load_yaml("trainer:\n  lr: -0.001\n"),
        ("trainer.lr (-0.001) must be > 0", "--trainer.lr"),
    ),
    (
        "overlong_buffer_past_the_budget",
        lambda s: s.load_yaml("generator:\n  max_new_tokens: 4\nscorer:\n  overlong_buffer: 8\n"),
        ("scorer.overlong_buffer (8) exceeds generator.max_new_tokens (4)", "--scorer.overlong-buffer"),
    ),
    (
        "reference_mesh_mismatch",
        lambda s: s.load_yaml("trainer:\n  loss:\n    kl_beta: 0.1\nreference:\n  num_procs: 2\n"),
        ("must equal reference.num_procs (2)", "--reference.num-procs 1"),
    ),
    (
        "unknown_task",
        lambda s: s.load_yaml("task:\n  name: sort\n"),
        ("task.name ('sort') must be one of", "--task.name"),
    ),
    (
        "unknown_reward",
        lambda s: s.load_yaml("task:\n  reward: exact\n"),
        ("task.reward ('exact') is not a registered", "--task.reward"),
    ),
    (
        "reward_module_missing",
        lambda s: s.load_yaml("task:\n  reward: no_such_pkg.verifiers:score\n"),
        ("module 'no_such_pkg.verifiers' cannot be imported", "PYTHONPATH"),
    ),
    (
        "reward_wrong_signature",
        lambda s: s.load_yaml("task:\n  reward: tests.support.faulty_rewards:one_argument\n"),
        ("must accept (completion_text, answer)", "def f(completion, answer, **columns)"),
    ),
    (
        "reward_timeout_zero",
        lambda s: s.load_yaml("scorer:\n  reward_timeout_s: 0\n"),
        ("scorer.reward_timeout_s (0.0) must be > 0", "--scorer.reward-timeout-s"),
    ),
    (
        "nonfinite_limit_zero",
        lambda s: s.load_yaml("trainer:\n  max_consecutive_nonfinite_steps: 0\n"),
        ("trainer.max_consecutive_nonfinite_steps (0) must be >= 1", "--trainer.max-consecutive-nonfinite-steps"),
    ),
    # hosts and placement (multi-host launching, forge_rl/plumbing/placement.py)
    (
        "host_list_without_workers",
        lambda s: s.load_yaml("launch:\n  hosts: list\n"),
        ("launch.workers is empty", "forge-rl worker --port"),
    ),
    (
        "worker_address_malformed",
        lambda s: s.load_yaml("launch:\n  hosts: list\n  workers: [node1:26600]\n"),
        ("'node1:26600' is not a worker address tcp://HOST:PORT", "tcp://node1:26600"),
    ),
    (
        "placement_names_a_missing_host",
        lambda s: s.load_yaml(
            "launch:\n  hosts: list\n  workers: [tcp://a:26600, tcp://b:26600]\n"
            "  placement:\n    generator_hosts: [2]\n"
        ),
        (
            "launch.placement.generator_hosts ([2]) names host 2, but launch.workers has 2 host(s)",
            "--launch.placement.generator-hosts",
        ),
    ),
    (
        "remote_placement_on_one_machine",
        lambda s: s.load_yaml("launch:\n  placement:\n    trainer_hosts: [1]\n"),
        ("names a host other than 0, but launch.hosts is 'local'", "--launch.hosts list"),
    ),
    (
        "trainer_and_generators_share_a_host",
        lambda s: s.load_yaml(
            "num_generators: 2\nlaunch:\n  hosts: list\n  workers: [tcp://a:26600, tcp://b:26600]\n"
            "  placement:\n    trainer_hosts: [1]\n    generator_hosts: [0, 1]\n"
        ),
        ("host 1 runs trainer/reference ranks and generators", "--launch.allow-shared-hosts true"),
    ),
    (
        "trainer_ranks_do_not_split_over_hosts",
        lambda s: s.load_yaml(
            "trainer:\n  num_procs: 3\n  parallel:\n    dp_shard: 3\ntrain_batch_size: 24\n"
            "launch:\n  hosts: list\n  workers: [tcp://a:1, tcp://b:1, tcp://c:1]\n"
            "  placement:\n    trainer_hosts: [0, 1]\n    generator_hosts: [2]\n"
        ),
        ("trainer.num_procs (3) is not divisible by the 2 host(s)", "--trainer.num-procs to a multiple of 2"),
    ),
    (
        "trainer_hosts_not_consecutive",
        lambda s: s.load_yaml(
            "launch:\n  hosts: list\n  workers: [tcp://a:1, tcp://b:1, tcp://c:1]\n"
            "  placement:\n    trainer_hosts: [0, 2]\n    generator_hosts: [1]\n"
        ),
        ("must be consecutive, increasing host indices", "Reorder launch.workers"),
    ),
    # model directory
    (
        "model_dir_missing",
        lambda s: ModelConfig(path=s.tmp_path / "nope").hf_config(),
        ("lacks config.json", "--model.path"),
    ),
    (
        "config_json_not_json",
        lambda s: s.start_with_model(_write("config.json", '{"architectures": ["LlamaForCausalLM",')),
        ("config.json that is not valid JSON", "save_pretrained"),
    ),
    (
        "weights_missing",
        lambda s: s.start_with_model(lambda d: (d / "model.safetensors").unlink()),
        ("neither model.safetensors nor", "model.path"),
    ),
    # tokenizer
    (
        "tokenizer_json_missing",
        lambda s: s.start_with_model(lambda d: (d / "tokenizer.json").unlink()),
        ("lacks tokenizer.json", "--model.path"),
    ),
    (
        "tokenizer_json_broken",
        lambda s: s.start_with_model(_write("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE"')),
        ("tokenizer.json cannot be loaded", "Re-export the tokenizer"),
    ),
    (
        "tokenizer_config_not_json",
        lambda s: s.start_with_model(_write("tokenizer_config.json", "eos_token: <eos>")),
        ("tokenizer_config.json is not valid JSON", "re-export"),
    ),
    (
        "eos_not_in_vocabulary",
        lambda s: s.start_with_model(_edit_json("tokenizer_config.json", lambda c: c.update(eos_token="</s>"))),
        ("eos_token='</s>', which is not in tokenizer.json's vocabulary", "Fix the tokenizer files"),
    ),
    # dataset rows
    (
        "prompt_longer_than_context",
        lambda s: s.start(
            model=ModelConfig(tiny=TinyModelConfig(max_position_embeddings=8)),
            generator=GeneratorConfig(max_new_tokens=4),
        ),
        (
            "needs 9 positions, more than the model's context (max_position_embeddings = 8)",
            "--generator.max-new-tokens",
        ),
    ),
    (
        "prompt_outside_vocabulary",
        lambda s: s.start_with_model(_drop_vocabulary_entry("M")),
        ("prompt 0", "does not survive", "covers the task's characters"),
    ),
    (
        "chat_prompts_without_a_chat_template",
        lambda s: s.start(model=ModelConfig(path=s.model(lambda d: None)), task=TaskConfig(prompt_format="chat")),
        ("task.prompt_format ('chat')", "has no chat template", "--task.prompt-format plain"),
    ),
    # resources and the run directory
    (
        "too_many_compute_threads",
        _many_compute_threads,
        ("compute threads on", "--trainer.num-procs or --num-generators"),
    ),
    (
        "kv_cache_beyond_memory",
        lambda s: s.start(generator=GeneratorConfig(kv_cache_space_gib=1e6)),
        ("GiB of KV cache exceeds this machine's available memory", "--generator.kv-cache-space-gib"),
    ),
    (
        "kv_block_size_the_cpu_backend_refuses",
        lambda s: s.start(generator=GeneratorConfig(kv_block_size=16)),
        ("generator.kv_block_size (16) is not a multiple of 32", "--generator.kv-block-size 32"),
    ),
    (
        "more_trainer_ranks_than_gpus",
        _more_trainer_ranks_than_gpus,
        ("this machine has 1 GPU(s) but the placement needs 3 there: 2 trainer rank(s)", "--trainer.num-procs"),
    ),
    (
        "generator_without_a_gpu_of_its_own",
        _generator_without_a_gpu_of_its_own,
        ("this machine has 1 GPU(s) but the placement needs 2 there", "--launch.share-gpus true"),
    ),
    (
        "tensor_parallel_generator_on_cpu",
        _tensor_parallel_generator_on_cpu,
        ("generator.tensor_parallel_size (2) > 1", "--generator.tensor-parallel-size 1"),
    ),
    ("run_dir_under_a_file", _run_dir_under_a_file, ("is a file, not a directory", "--run-dir")),
    (
        "run_dir_not_creatable",
        lambda s: s.start(run_dir=Path("/proc/forge_rl_runs")),
        ("cannot create run directory", "--run-dir"),
    ),
    pytest.param(
        "run_dir_read_only",
        _run_dir_read_only,
        ("is not writable: no write permission", "--run-dir"),
        marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere; /proc covers it"),
    ),
    ("run_dir_not_empty", _run_dir_taken, ("already exists and is not empty", "--run-name")),
]


def _case(case) -> object:
    """A CASES entry as a pytest parameter with its id (keeping marks)."""
    if hasattr(case, "marks"):  # already a pytest.param (a NamedTuple, so test it first)
        return pytest.param(*case.values[1:], id=case.values[0], marks=case.marks)
    return pytest.param(*case[1:], id=case[0])


@pytest.mark.parametrize("make_bad_input,fragments", [_case(c) for c in CASES])
def test_bad_input_fails_early_naming_problem_and_fix(make_bad_input, fragments, tiny_model, tmp_path, monkeypatch):
    scene = Scene(tmp_path, tiny_model, monkeypatch)
    with pytest.raises(ConfigError) as error:
        make_bad_input(scene)
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert half_written_run_dirs(scene.runs) == []


def half_written_run_dirs(runs: Path) -> list[Path]:
    """What a later run or resume could mistake for a run: a config.yaml, a model, a .partial."""
    if not runs.is_dir():
        return []
    return [p for p in runs.rglob("*") if p.name in ("config.yaml", "model") or p.name.endswith(".partial")]


def test_the_catalogue_has_at_least_fifteen_cases_across_the_issue_categories():
    assert len(CASES) + len(CLI_CASES) >= 15


def test_a_good_config_creates_the_run_directory_atomically(tiny_model, tmp_path, monkeypatch):
    scene = Scene(tmp_path, tiny_model, monkeypatch)
    (scene.runs / ".run.partial").mkdir(parents=True)  # left by a creation that was killed
    run_path = scene.start(model=ModelConfig(path=tiny_model))
    assert sorted(p.name for p in scene.runs.iterdir()) == ["run"]
    assert (run_path / "config.yaml").is_file()


def test_a_failure_while_writing_the_run_directory_removes_it(tiny_model, tmp_path, monkeypatch):
    """The tiny model is written inside the .partial directory; its failure leaves nothing behind."""
    import forge_rl.run.run_dir

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", "model.safetensors")

    monkeypatch.setattr(forge_rl.run.run_dir, "create_tiny_model", disk_full)
    scene = Scene(tmp_path, tiny_model, monkeypatch)
    with pytest.raises(ConfigError, match="No space left on device.*Free space or set --run-dir"):
        scene.start()
    assert list(scene.runs.iterdir()) == []


def test_a_run_that_fails_before_its_first_step_leaves_no_run_directory(tiny_model, tmp_path, monkeypatch):
    """What apps.grpo.main.run does when start-up fails after create_run_dir (an engine that will
    not start): the directory goes, and the same --run-name can run again."""
    scene = Scene(tmp_path, tiny_model, monkeypatch)
    run_path = scene.start()
    assert remove_unstarted_run_dir(run_path)
    assert list(scene.runs.iterdir()) == []
    run_path = scene.start()
    (run_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not remove_unstarted_run_dir(run_path) and run_path.is_dir()


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forge_rl.cli", *args], capture_output=True, text=True, cwd=cwd)


# (case id, argv after `forge-rl`, fragments of stderr); paths under {tmp} are made per test
CLI_CASES = [
    ("unknown_subcommand", ["trian"], ("unknown subcommand 'trian'", "forge-rl {grpo")),
    ("unknown_flag", ["grpo", "--stepz", "3"], ("--stepz", "--steps")),
    ("missing_config_file", ["grpo", "--config", "{tmp}/nope.yaml"], ("nope.yaml does not exist", "--config")),
    ("plot_without_metrics", ["plot", "{tmp}"], ("metrics.jsonl not found", "forge-rl grpo")),
    (
        "worker_not_listening",
        [
            "grpo",
            "--run-dir",
            "{tmp}/runs",
            "--steps",
            "1",
            "--launch.hosts",
            "list",
            "--launch.workers",
            "tcp://127.0.0.1:9",
            "--launch.connect-timeout-s",
            "1",
        ],
        ("cannot reach the Monarch worker(s) at tcp://127.0.0.1:9", "forge-rl worker --port PORT"),
    ),
    (
        "slurm_outside_an_allocation",
        ["grpo", "--run-dir", "{tmp}/runs", "--steps", "1", "--launch.hosts", "slurm"],
        ("SLURM_JOB_NODELIST is not set", "sbatch configs/slurm_grpo.sbatch"),
    ),
    (
        "broken_tokenizer_through_grpo",
        ["grpo", "--model.path", "{model}", "--run-dir", "{tmp}/runs", "--steps", "1"],
        ("cannot start the run", "tokenizer.json cannot be loaded"),
    ),
    (
        "missing_data_file",
        ["grpo", "--run-dir", "{tmp}/runs", "--steps", "1", "--data.path", "{tmp}/nope.jsonl"],
        ("cannot start the run", "data.path ('{tmp}/nope.jsonl')", "Check the path", "--data.path"),
    ),
]


@pytest.mark.parametrize("argv,fragments", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_the_cli_refuses_bad_input_with_exit_code_2(argv, fragments, tiny_model, tmp_path, monkeypatch):
    model_dir = Scene(tmp_path, tiny_model, monkeypatch).model(_write("tokenizer.json", "not json"))
    result = run_cli(*(a.format(tmp=tmp_path, model=model_dir) for a in argv))
    stderr = " ".join(result.stderr.replace("│", " ").split())  # tyro draws boxes around its errors
    assert result.returncode == 2, result.stderr
    for fragment in fragments:
        fragment = fragment.replace("{tmp}", str(tmp_path))
        assert fragment in stderr, f"{fragment!r} not in: {stderr}"
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
