"""`forge-rl bench elastic` on real vLLM engines and the real trainer: the demo's run grows from one
generator to two while it trains, each phase measured, the accounting exact."""

from pathlib import Path

import pytest

from forge_rl.bench.elastic import ElasticArgs, main

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_a_real_run_grows_its_pool_mid_run_and_each_phase_is_measured(tmp_path):
    summary = main(
        ElasticArgs(
            config=REPO / "configs/grpo_tiny_cpu.yaml",
            counts=(1, 2),
            steps_per_phase=3,
            prompts_per_step=4,
            out_dir=tmp_path,
        )
    )
    assert summary["simulated"] is False and summary["counts"] == [1, 2]
    assert [phase["generators"] for phase in summary["phases"]] == [1, 2]
    assert all(phase["steps_measured"] >= 1 and phase["trained_tokens_per_s"] > 0 for phase in summary["phases"])
    assert summary["change_s"][0] > 0  # a real engine started mid-run
    assert summary["accounting_ok"], summary["accounting"]
    assert (tmp_path / "elastic.json").is_file()
