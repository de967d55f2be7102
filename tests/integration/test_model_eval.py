"""`forge-rl eval` for real: a tiny model (from scratch, a character tokenizer that spells Python)
on a small JSONL eval set and on HumanEval's first 3 problems, 2 samples each, sampled by a vLLM
engine of the evaluation's own. The model is untrained, so it scores 0: what is checked is the
output, the per-prompt and per-problem files and the summary line."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest

from forge_rl.models.tiny import TinyModelConfig, create_tiny_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PYTHON_ALPHABET = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c") | set("≤➞")))
"""Every character of HumanEval's prompts, one token each."""
EVAL_HANG_S = 240


def test_forge_rl_eval_writes_each_prompts_and_problems_samples_and_ends_with_the_figures(tmp_path):
    model_dir = create_tiny_model(TinyModelConfig(max_position_embeddings=1024), tmp_path / "model", PYTHON_ALPHABET)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"M{i}{i + 1}=", "answer": str(i + 1)}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_rl.cli",
            "eval",
            "--model-path",
            str(model_dir),
            "--benchmark",
            "humaneval",
            "--num-problems",
            "3",
            "--data.path",
            str(held_out),
            "--data.answer-column",
            "answer",
            "--task.reward",
            "exact_match",
            "--eval.num-samples",
            "2",
            "--eval.temperature",
            "1.0",
            "--eval.k-values",
            "1",
            "2",
            "--eval.max-new-tokens",
            "16",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=EVAL_HANG_S,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    summary = json.loads(cli.stdout.strip().splitlines()[-1])
    assert "sampled 8/8 prompts (16 samples)" in cli.stderr  # 5 of the set, 3 problems
    assert (summary["model"], summary["step"], summary["policy_version"], summary["out"]) == (
        str(model_dir),
        0,
        0,
        str(out),
    )

    humaneval = summary["humaneval"]
    assert {k: humaneval[k] for k in ("num_problems", "num_samples", "pass@1", "pass@2")} == {
        "num_problems": 3,
        "num_samples": 6,
        "pass@1": 0.0,
        "pass@2": 0.0,
    }
    problems = [json.loads(line) for line in Path(humaneval["results"]).read_text().splitlines()]
    assert [p["task_id"] for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    for problem in problems:
        assert problem["num_samples"] == 2 and problem["num_passed"] == 0 and len(problem["ended_by"]) == 2
        assert problem["prompt"].lstrip().startswith(("from ", "def ", "import "))
        assert all(0 < s["num_tokens"] <= 16 and s["completion"] in s["text"] for s in problem["samples"])

    held = summary["held_out"]
    assert (held["num_prompts"], held["num_errored"], held["version"]) == (5, 0, 0)
    prompts = [json.loads(line) for line in Path(held["results"]).read_text().splitlines()]
    assert sorted(p["prompt"] for p in prompts) == [f"M{i}{i + 1}=" for i in range(5)]
    assert all(len(p["samples"]) == 2 and all(s["reward"] in (0.0, 1.0) for s in p["samples"]) for p in prompts)

    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"]) for r in records] == [(0, 0), (0, 0)]
    assert records[0]["eval/held_out/num_prompts"] == 5 and records[1]["eval/humaneval/num_problems"] == 3
