"""`forge-rl eval` without an engine: its arguments and bad input (each refused naming the value and
the fix), the targets of a run directory, and how a HumanEval sample becomes the completion the
sandbox checks (a fenced block's code, else the text up to a stop sequence)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from forge_rl.cli import run as cli_run
from forge_rl.data.config import DataConfig
from forge_rl.errors import ConfigError
from forge_rl.evaluation.config import EvalConfig, EvalSetConfig
from forge_rl.evaluation.humaneval import (
    STOP_SEQUENCES,
    check_completion,
    completion_of,
    extract_code,
    load_problems,
    truncate_at_stop,
)
from forge_rl.run.model_eval import EvalArgs, default_args, out_dir_of, targets_of

TRUNCATE = "HumanEval/2"  # truncate_number(number: float) -> float: number % 1.0


@pytest.fixture(scope="module")
def problem():
    return load_problems()[TRUNCATE]


def test_a_base_model_continuation_is_cut_at_the_first_new_top_level_statement(problem):
    body = "    return number % 1.0\n"
    for stop in STOP_SEQUENCES:
        assert truncate_at_stop(body + stop + "rest") == body
    assert truncate_at_stop(body + "\n\ndef helper():\n    pass\nprint(1)") == body + "\n"
    # Indented code and a nested def are the body, not a stop.
    nested = "    def inner(x):\n        return x % 1.0\n    return inner(number)\n"
    assert truncate_at_stop(nested) == nested
    assert completion_of(problem, body + "\nif __name__ == '__main__':\n    print(truncate_number(3.5))") == body


def test_a_fenced_block_is_taken_out_of_an_instruct_models_prose(problem):
    text = (
        "Here is the function:\n```python\nimport math\n\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```\nIt returns the decimal part.\n```python\nprint(truncate_number(3.5))\n```"
    )
    code = extract_code(text, "truncate_number")
    assert code == "import math\n\ndef truncate_number(number: float) -> float:\n    return number % 1.0"
    # A whole function at column 0 goes after the prompt on its own line, redefining the prompt's.
    assert completion_of(problem, text) == "\n" + code
    # The block that defines the entry point wins over an earlier one; an unclosed fence runs to the end.
    assert extract_code("```\nx = 1\n```\n```py\ndef truncate_number(n):\n    return n % 1", "truncate_number") == (
        "def truncate_number(n):\n    return n % 1"
    )
    # A model that first closes a fence it imagines around the prompt still has its function found.
    closed_first = "```\n\nHere it is:\n```python\ndef truncate_number(number):\n    return number % 1.0\n```\nDone."
    assert extract_code(closed_first, "truncate_number") == "def truncate_number(number):\n    return number % 1.0"
    assert extract_code("```\n\nUsage:\n```python\nprint(truncate_number(3.5))\n```", "truncate_number") == (
        "print(truncate_number(3.5))"
    )
    # An indented block is a body: it continues the prompt as it is.
    assert completion_of(problem, "```python\n    return number % 1.0\n```") == "    return number % 1.0"
    assert extract_code("    return number % 1.0", "truncate_number") is None


def test_an_extracted_function_passes_the_problems_tests_in_the_sandbox(problem):
    from forge_rl.envs.sandbox import SandboxConfig
    from forge_rl.errors import SandboxUnavailable

    text = "Sure!\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```\nDone."
    try:
        passed, ended_by = asyncio.run(
            check_completion(problem, completion_of(problem, text), SandboxConfig(max_wall_time_s=30.0))
        )
    except SandboxUnavailable as e:
        pytest.skip(f"the sandbox needs Linux with seccomp and Landlock: {e}")
    assert (passed, ended_by) == (True, "passed")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(benchmark="humaneval"), r"pass --model-path DIR .* or --run RUN_DIR .*not neither"),
        (dict(model_path=Path("m"), run=Path("r"), benchmark="humaneval"), r"not both"),
        (dict(model_path=Path("m"), every_checkpoint=True, benchmark="humaneval"), r"--every-checkpoint .* pass --run"),
        (dict(model_path=Path("m"), benchmark="mbpp"), r"--benchmark 'mbpp' is not a built-in benchmark.*humaneval"),
        (dict(model_path=Path("m"), benchmark="humaneval", num_problems=165), r"--num-problems \(165\) .* 164"),
        (
            dict(
                model_path=Path("m"), num_problems=3, eval=EvalConfig(sets=(EvalSetConfig("s", DataConfig("f.jsonl")),))
            ),
            r"--num-problems limits HumanEval's problems: pass --benchmark humaneval",
        ),
        (dict(model_path=Path("m")), r"nothing to evaluate.*--benchmark humaneval.*--data.path"),
        (
            dict(model_path=Path("m"), benchmark="humaneval", data=DataConfig("x/humaneval.jsonl")),
            r"an eval set is named 'humaneval'.*--set-name",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_the_value_and_the_fix(fields, match):
    with pytest.raises(ConfigError, match=match):
        EvalArgs(**fields)


def test_k_above_the_samples_per_prompt_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"eval.k_values \(\[1, 10\]\).*eval.num_samples \(2\).*--eval.num-samples"):
        EvalConfig(num_samples=2, temperature=0.8, k_values=(1, 10))


def test_the_data_flags_add_a_set_named_after_the_file():
    args = EvalArgs(
        model_path=Path("m"), data=DataConfig("sets/held-out.v2.jsonl", answer_column="answer"), max_prompts=7
    )
    assert [(s.name, s.max_prompts, s.data.answer_column) for s in args.sets] == [("held-out_v2", 7, "answer")]
    named = EvalArgs(model_path=Path("m"), data=DataConfig("a.jsonl"), set_name="mine")
    assert named.set_names == ["mine"]


def test_a_runs_config_gives_the_defaults_and_a_missing_one_names_the_directory(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "task: {reward: exact_match}\ngenerator: {top_p: 0.9}\n"
        "eval: {num_samples: 4, temperature: 0.7, k_values: [1, 4], sets: [{name: held, data: {path: held.jsonl}}]}\n"
    )
    args = default_args(None, tmp_path)
    assert (args.task.reward, args.generator.top_p, args.eval.num_samples, args.eval.k_values) == (
        "exact_match",
        0.9,
        4,
        (1, 4),
    )
    assert [s.name for s in args.eval.sets] == ["held"]
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=r"--run .*sub/config.yaml does not exist; not a run directory"):
        default_args(None, tmp_path / "sub")
    with pytest.raises(ConfigError, match=r"--run .*gone does not exist. Pass a run directory"):
        default_args(None, tmp_path / "gone")
    assert default_args(None, None).eval == EvalConfig()


def test_a_missing_model_directory_and_a_run_without_checkpoints_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--model-path .*nope does not exist.*forge-rl convert"):
        targets_of(EvalArgs(model_path=tmp_path / "nope", benchmark="humaneval"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"lacks tokenizer.json, tokenizer_config.json: not an HF model directory"):
        targets_of(EvalArgs(model_path=tmp_path / "half", benchmark="humaneval"))
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)  # cut short: no COMPLETE
    with pytest.raises(ConfigError, match=r"--run .*run has no complete checkpoint.*--checkpoint.enabled true"):
        targets_of(EvalArgs(run=run, benchmark="humaneval"))


def test_a_run_gives_its_newest_checkpoint_or_every_one_in_step_order(tmp_path):
    for step, version in ((10, 10), (2, 2), (5, 4)):
        path = tmp_path / "checkpoints" / f"step-{step:06d}"
        path.mkdir(parents=True)
        (path / "COMPLETE").write_text(json.dumps({"step": step, "policy_version": version}))
    newest = targets_of(EvalArgs(run=tmp_path, benchmark="humaneval"))
    assert [(t.step, t.policy_version) for t in newest] == [(10, 10)]
    curve = targets_of(EvalArgs(run=tmp_path, every_checkpoint=True, benchmark="humaneval"))
    assert [(t.step, t.policy_version) for t in curve] == [(2, 2), (5, 4), (10, 10)]


def test_results_never_go_into_a_directory_that_holds_some(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "eval.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"--out .*old exists and is not an empty directory"):
        out_dir_of(EvalArgs(model_path=Path("m"), benchmark="humaneval", out=tmp_path / "old"))
    assert out_dir_of(EvalArgs(model_path=Path("m"), benchmark="humaneval", out=tmp_path / "new")).is_dir()


def test_the_command_line_refuses_bad_input_before_starting_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_run(["eval", "--model-path", str(tmp_path / "nope"), "--benchmark", "humaneval"])
    assert stop.value.code == 2
    assert "cannot evaluate: --model-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_run(
            [
                "eval",
                "--model-path",
                str(tmp_path),
                "--benchmark",
                "humaneval",
                "--eval.num-samples",
                "2",
                "--eval.temperature",
                "0.8",
                "--eval.k-values",
                "1",
                "10",
            ]
        )
    assert "eval.k_values ([1, 10])" in capsys.readouterr().err
