"""`forge-rl bench trainer` end to end on tiny settings (under a minute): table, JSON, figure, and
a last stdout line of JSON with the headline ratios."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--repeats",
    "1",
    "--num-prompts",
    "2",
    "--group-size",
    "4",
    "--max-completion",
    "32",
    "--hidden-size",
    "64",
    "--num-heads",
    "2",
    "--num-layers",
    "1",
    "--intermediate-size",
    "128",
]


@pytest.mark.parametrize("num_procs", [1, 2])
def test_bench_trainer_smoke(tmp_path, num_procs):
    """Two gloo processes time the four TorchTitan variants; one process adds transformers' step."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_rl.cli",
            "bench",
            "trainer",
            "--out-dir",
            str(tmp_path),
            "--num-procs",
            str(num_procs),
            *TINY,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["vs_bare_torchtitan"] > 0 and summary["packing_speedup"] > 0
    assert summary["padding_fraction_pack"] < summary["padding_fraction_pad"]
    assert any(line.startswith("forge_pack") for line in lines)
    figures = json.loads((tmp_path / "trainer.json").read_text())
    torchtitan = {"bare_pad", "forge_pad", "forge_bucket", "forge_pack"}
    assert set(figures["variants"]) == (torchtitan | {"hf_pad"} if num_procs == 1 else torchtitan)
    assert ("vs_transformers" in summary) == (num_procs == 1)
    if num_procs == 1:
        assert summary["vs_transformers"] > 0 and summary["transformers_version"]
    assert (tmp_path / "trainer_throughput.png").stat().st_size > 0


def test_bench_trees_smoke(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_rl.cli",
            "bench",
            "trees",
            "--out-dir",
            str(tmp_path),
            "--group-sizes",
            "4",
            "--prompt-tokens",
            "8",
            "32",
            "--min-completion",
            "4",
            "--max-completion",
            "8",
            "--repeats",
            "1",
            "--headline",
            "4",
            "32",
            "--hidden-size",
            "64",
            "--num-heads",
            "2",
            "--num-layers",
            "1",
            "--intermediate-size",
            "128",
            "--num-threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["group_size"], summary["prompt_tokens"]) == (4, 32) and summary["tree_over_pack"] > 0
    # a group of 4 sharing a 32-token prompt: 3 of its 4 prompt copies are shared
    assert summary["shared_token_fraction"] >= 3 * 32 / (4 * (32 + 8))
    figures = json.loads((tmp_path / "trees.json").read_text())
    assert [(c["group_size"], c["prompt_tokens"]) for c in figures["cells"]] == [(4, 8), (4, 32)]
    assert (tmp_path / "trees.png").stat().st_size > 0


def test_bench_branches_smoke(tmp_path):
    """Three short runs of configs/bench_branches_cpu.yaml: the tree, plain groups of as many
    samples, plain groups of the same roots."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_rl.cli",
            "bench",
            "branches",
            "--out-dir",
            str(tmp_path),
            "--steps",
            "2",
            "--seeds",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # The tree resamples only the completions' last tokens: fewer generated than as many whole samples.
    assert 0 < summary["branch_over_plain_equal_generated_tokens"] < 1
    assert summary["samples_per_prompt_branch"] == 3 * summary["group_size"]
    figures = json.loads((tmp_path / "branches.json").read_text())
    assert set(figures["runs"]) == {"branch", "plain-equal", "plain-roots"}
    assert (tmp_path / "branches.png").stat().st_size > 0
