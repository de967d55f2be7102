"""`forge-rl bench trainer` end to end on tiny settings (under a minute): table, JSON, figure, and
a last stdout line of JSON with the headline ratios."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = ["--repeats", "1", "--num-prompts", "2", "--group-size", "4", "--max-completion", "32",
        "--hidden-size", "64", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "128"]


def test_bench_trainer_smoke(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "forge_rl.cli", "bench", "trainer", "--out-dir", str(tmp_path), "--num-procs", "2", *TINY],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["vs_bare_torchtitan"] > 0 and summary["packing_speedup"] > 0
    assert summary["padding_fraction_pack"] < summary["padding_fraction_pad"]
    assert any(line.startswith("forge_pack") for line in lines)
    figures = json.loads((tmp_path / "trainer.json").read_text())
    assert set(figures["variants"]) == {"bare_pad", "forge_pad", "forge_bucket", "forge_pack"}
    assert (tmp_path / "trainer_throughput.png").stat().st_size > 0
