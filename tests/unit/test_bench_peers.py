"""`forge-rl bench peers`' figures on fabricated per-step metrics, and its bad-input paths: TRL's
environment missing (forge_rl's side alone, marked), a peer run that crashes or misses the
threshold (reported as such, never as a number). The one test that runs TRL itself needs
`make peers-venv` and skips without it."""

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from forge_rl.bench import peers
from forge_rl.bench.peers import PeersArgs, analyze, read_trl_metrics, reward_at, summarize
from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.yaml_config import load_yaml_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "bench_peers_tiny_cpu.yaml"


def fake_metrics(rewards: list[float], step_s: float, tokens: int = 100) -> list[dict]:
    """Per-step metrics as a run logs them (forge_rl's names), one step every `step_s` seconds."""
    return [
        {"reward/mean": r, "wall_time_s": (i + 1) * step_s, "num_tokens": tokens, "policy_age/max": i % 2,
         "idle_fraction/trainer": 0.25, "idle_fraction/generators": 0.5}
        for i, r in enumerate(rewards)
    ]


def fake_run(library: str, seed: int, rewards: list[float], step_s: float, error: str | None = None) -> dict:
    return analyze(library, seed, fake_metrics(rewards, step_s), 10.0, PeersArgs(at_times_s=(3.0, 4.0)), error)


def test_time_and_steps_to_each_threshold_are_read_off_the_smoothed_reward():
    rewards = [0.0] * 5 + [1.0] * 10  # smoothed over 5 steps: 0.6 at step 8, 1.0 at step 10
    run = fake_run("forge_rl", 0, rewards, step_s=0.5)
    assert run["steps_to_reward"] == {"0.5": 8, "0.9": 10}
    assert run["time_to_reward_s"] == {"0.5": 4.0, "0.9": 5.0}
    assert run["status"] == "ok"
    assert run["steps_per_s"] == pytest.approx(2.0)
    assert run["trained_tokens_per_s"] == pytest.approx(15 * 100 / 7.5)
    assert (run["max_policy_age_seen"], run["trainer_idle_fraction"], run["generator_idle_fraction"]) == (1, 0.25, 0.5)
    assert run["reward_at_s"] == {"3.0": pytest.approx(0.2), "4.0": pytest.approx(0.6)}


def test_reward_at_a_time_is_null_before_the_first_smoothed_value_and_past_the_runs_end():
    metrics = fake_metrics([0.2] * 6, step_s=1.0)
    assert reward_at(metrics, (3.0, 5.0, 6.0, 7.0)) == {"3.0": None, "5.0": pytest.approx(0.2), "6.0": pytest.approx(0.2), "7.0": None}


def test_a_run_that_misses_the_threshold_or_crashes_reports_no_time():
    missed = fake_run("trl", 0, [0.5] * 20, step_s=0.2)
    assert missed["status"] == "not_reached"
    assert missed["time_to_reward_s"] == {"0.5": pytest.approx(1.0), "0.9": None}
    crashed = fake_run("trl", 1, [0.0, 1.0], step_s=0.2, error="exit status 1")
    assert (crashed["status"], crashed["error"]) == ("crashed", "exit status 1")
    assert "steps_per_s" not in crashed
    nothing = analyze("trl", 2, [], None, PeersArgs(), None)
    assert (nothing["status"], nothing["error"], nothing["time_to_reward_s"]["0.9"]) == ("crashed", "no step logged", None)


def test_the_ratio_is_forge_rls_median_time_over_trls_and_null_unless_every_seed_of_both_reached():
    learns = [0.0] * 5 + [1.0] * 10
    runs = {
        "trl": [fake_run("trl", s, learns, step_s) for s, step_s in ((0, 0.2), (1, 0.4), (2, 0.3))],
        "forge_rl": [fake_run("forge_rl", s, learns, step_s) for s, step_s in ((0, 0.5), (1, 0.6), (2, 0.4))],
    }
    summary = summarize(runs, (0.5, 0.9), {"trl": "1.16.0"}, skip_peer=False)
    assert summary["matched_tiny/trl_time_to_reward_s"] == pytest.approx(3.0)  # median step 0.3 s x 10 steps
    assert summary["matched_tiny/forge_rl_time_to_reward_s"] == pytest.approx(5.0)
    assert summary["matched_tiny/ratio_forge_rl_over_trl"] == pytest.approx(5.0 / 3.0)
    assert (summary["peer_status"], summary["peer"]) == ("ran", "trl 1.16.0")
    runs["trl"][1] = fake_run("trl", 1, [0.0] * 15, 0.4)
    summary = summarize(runs, (0.5, 0.9), {"trl": "1.16.0"}, skip_peer=False)
    assert summary["matched_tiny/trl_statuses"] == ["ok", "not_reached", "ok"]
    assert summary["matched_tiny/trl_time_to_reward_s"] is None
    assert summary["matched_tiny/ratio_forge_rl_over_trl"] is None


def test_trls_log_reads_back_as_forge_rls_metric_names(tmp_path):
    log = tmp_path / "trl_metrics.jsonl"
    log.write_text(
        json.dumps({"train_begin_unix_time": 100.0}) + "\n"
        + json.dumps({"step": 1, "wall_time_s": 0.3, "reward": 0.25, "completion_tokens": 800.0, "step_time_s": 0.2}) + "\n"
    )
    assert read_trl_metrics(log) == (100.0, [{"reward/mean": 0.25, "wall_time_s": 0.3, "num_tokens": 800.0}])
    assert read_trl_metrics(tmp_path / "absent.jsonl") == (None, [])


def test_trls_settings_are_forge_rls_configs(tmp_path):
    base = dataclasses.replace(load_yaml_config(GRPOConfig, CONFIG), steps=3)
    spec = peers.trl_spec(base, PeersArgs(out_dir=tmp_path), 7, tmp_path / "model", tmp_path)
    assert (spec["completions_per_step"], spec["group_size"], spec["max_new_tokens"]) == (256, 8, 4)
    assert (spec["loss_type"], spec["clip_eps_low"], spec["clip_eps_high"], spec["kl_beta"]) == ("dapo", 0.2, 0.28, 0.0)
    assert (spec["lr"], spec["temperature"], spec["seed"], spec["prompt_prefix"]) == (3e-4, 1.0, 7, "<bos>")
    rows = [json.loads(line) for line in Path(spec["prompts_path"]).read_text().splitlines()]
    assert len(rows) == 3 * 32 and rows[0]["prompt"].startswith("M") and rows[0]["prompt"].endswith("=")
    grpo = dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, loss=dataclasses.replace(base.trainer.loss, name="grpo")))
    with pytest.raises(ConfigError, match="matched for dapo only"):
        peers.trl_spec(grpo, PeersArgs(out_dir=tmp_path), 0, tmp_path / "model", tmp_path)


def fake_forge_rl_side(calls):
    def run_forge_rl(base, args, seed):
        calls.append(("forge_rl", seed))
        return fake_run("forge_rl", seed, [0.0] * 5 + [1.0] * 10, 0.5)
    return run_forge_rl


def test_without_trls_environment_forge_rls_side_runs_alone_and_the_summary_says_how_to_build_it(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peers, "run_forge_rl", fake_forge_rl_side(calls))
    summary = peers.main(PeersArgs(config=CONFIG, peer_venv=tmp_path / "no-venv", seeds=(0, 1), out_dir=tmp_path / "out"))
    assert calls == [("forge_rl", 0), ("forge_rl", 1)]
    assert (summary["peer_status"], summary["build_peer"], summary["peer"]) == ("missing", "make peers-venv", None)
    assert summary["runs"]["trl"] == [] and "trl" not in summary["libraries"]
    assert summary["matched_tiny/forge_rl_time_to_reward_s"] == pytest.approx(5.0)
    assert summary["matched_tiny/ratio_forge_rl_over_trl"] is None
    assert json.loads((tmp_path / "out" / "peers.json").read_text())["peer_status"] == "missing"


def fake_venv(path: Path, script: str) -> Path:
    """A virtual environment whose python is a shell script (a broken or crashing TRL)."""
    python = path / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n" + script)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return path


def test_an_environment_that_cannot_import_trl_counts_as_missing(tmp_path):
    assert peers.peer_versions(fake_venv(tmp_path / "venv", "echo 'No module named trl' >&2; exit 1\n")) is None
    assert peers.peer_versions(tmp_path / "absent") is None


def test_a_peer_run_that_crashes_is_reported_as_crashed_with_its_log(tmp_path):
    venv = fake_venv(tmp_path / "venv", "echo boom; exit 3\n")
    base = dataclasses.replace(load_yaml_config(GRPOConfig, CONFIG), steps=2)
    result = peers.run_trl(base, PeersArgs(peer_venv=venv, out_dir=tmp_path / "out"), 0, tmp_path / "model")
    assert result["status"] == "crashed" and result["error"].startswith("exit status 3")
    assert result["time_to_reward_s"]["0.9"] is None and result["startup_s"] is None
    assert (tmp_path / "out" / "trl-seed0" / "trl.log").read_text().strip() == "boom"


def test_bad_bench_arguments_are_refused_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match="--seeds"):
        peers.main(PeersArgs(config=CONFIG, seeds=(), out_dir=tmp_path))
    other_task = tmp_path / "add_mod10.yaml"
    other_task.write_text(CONFIG.read_text().replace("name: max_of_two", "name: add_mod10"))
    with pytest.raises(ConfigError, match="max_of_two"):
        peers.main(PeersArgs(config=other_task, out_dir=tmp_path / "out"))


PEER_PYTHON = REPO / peers.PEER_VENV / "bin" / "python"


@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason=f"needs TRL's environment {peers.PEER_VENV} (make peers-venv)")
def test_trls_side_trains_two_steps_on_the_workloads_model(tmp_path):
    base = dataclasses.replace(load_yaml_config(GRPOConfig, CONFIG), steps=2)
    model = peers.build_model(base, tmp_path / "model")
    result = peers.run_trl(base, PeersArgs(peer_venv=REPO / peers.PEER_VENV, out_dir=tmp_path, peer_threads=1), 0, model)
    assert result["steps"] == 2 and result["status"] == "not_reached", result
    assert result["startup_s"] > 0 and result["trained_tokens_per_s"] > 0
    assert os.path.isfile(tmp_path / "trl-seed0" / "trl_metrics.jsonl")


def test_steps_past_the_training_budget_are_left_out():
    late = analyze("forge_rl", 0, fake_metrics([0.0] * 5 + [1.0] * 10, step_s=1.0), 5.0, PeersArgs(budget_s=9.5), None)
    assert (late["steps"], late["status"], late["time_to_reward_s"]["0.9"]) == (9, "not_reached", None)
