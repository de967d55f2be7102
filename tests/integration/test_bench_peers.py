"""`forge-rl bench peers`' forge_rl side on the real recipe: a run of the matched workload with
TRL's side skipped, stopped at its training budget (the watch on its metrics.jsonl cancels the
recipe), read back as the bench reports it: steps, status, idle fractions, the role bound."""

import pytest

from forge_rl.bench import peers
from forge_rl.bench.peers import PeersArgs

pytestmark = pytest.mark.integration

BUDGET_S = 60.0
"""Seconds of training the run gets: room for its first steps on a loaded machine (beside the rest
of the suite and a busy loop, the first step alone can take longer than 30 s)."""


def test_the_forge_rl_side_stops_at_its_training_budget_and_reports_its_figures_and_role_bound(tmp_path):
    summary = peers.main(
        PeersArgs(workloads=("matched_tiny",), steps=1000, budget_s=BUDGET_S, skip_peer=True, out_dir=tmp_path)
    )
    # Within the budget a quiet machine may reach the threshold, a loaded one not.
    assert summary["peer_status"] == "skipped" and summary["matched_tiny/forge_rl_statuses"] in (
        ["ok"],
        ["not_reached"],
    )
    (run,) = summary["by_workload"]["matched_tiny"]["runs"]["forge_rl"]
    assert 1 <= run["steps"] < 1000 and run["training_s"] <= BUDGET_S  # stopped at the first step past the budget
    assert run["startup_s"] > 0 and run["max_policy_age_seen"] <= 1
    assert run["trainer_busy_s_per_step"] > 0 and run["generator_busy_s_per_step"] > 0
    if run["status"] == "ok":
        assert 0 < run["bound_time_to_reward_s"] and run["time_to_reward_s"]["0.9"] <= BUDGET_S
    else:
        assert run["bound_time_to_reward_s"] is None  # 0.9 not reached: no bound on a time that is not there
    assert (tmp_path / "matched_tiny" / "model" / "config.json").is_file()
