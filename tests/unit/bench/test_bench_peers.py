"""`forge-rl bench peers`' figures on fabricated per-step metrics, and its bad-input paths: TRL's
environment missing (forge_rl's side alone, marked), a workload TRL's side cannot express (named,
forge_rl's side alone), a peer run that crashes or misses the threshold (reported as such, never
as a number). The one test that runs TRL itself needs `make peers-venv` and skips without it."""

import dataclasses
import json
import os
import random
import stat
from pathlib import Path

import pytest

from forge_rl.bench import peers
from forge_rl.bench.peers import PeersArgs, analyze, read_trl_metrics, reward_at, summarize
from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.tasks.synthetic import make_prompt
from forge_rl.yaml_config import load_yaml_config

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "bench_peers_tiny_cpu.yaml"
TARGETS = (0.5, 0.9)
ANALYZED = PeersArgs(target_rewards=TARGETS, at_times_s=(15.0, 30.0, 60.0))
"""The arguments a workload's runs are analyzed with (`main` fills in the workload's targets and times)."""


def fake_metrics(rewards: list[float], step_s: float, tokens: int = 100) -> list[dict]:
    """Per-step metrics as a run logs them (forge_rl's names), one step every `step_s` seconds."""
    return [
        {
            "reward/mean": r,
            "wall_time_s": (i + 1) * step_s,
            "num_tokens": tokens,
            "policy_age/max": i % 2,
            "idle_fraction/trainer": 0.25,
            "idle_fraction/generators": 0.5,
        }
        for i, r in enumerate(rewards)
    ]


def fake_run(library: str, seed: int, rewards: list[float], step_s: float, error: str | None = None) -> dict:
    return analyze(
        library,
        seed,
        fake_metrics(rewards, step_s),
        10.0,
        PeersArgs(target_rewards=TARGETS, at_times_s=(3.0, 4.0)),
        error,
    )


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
    assert reward_at(metrics, (3.0, 5.0, 6.0, 7.0)) == {
        "3.0": None,
        "5.0": pytest.approx(0.2),
        "6.0": pytest.approx(0.2),
        "7.0": None,
    }


def test_a_run_that_misses_the_threshold_or_crashes_reports_no_time():
    missed = fake_run("trl", 0, [0.5] * 20, step_s=0.2)
    assert missed["status"] == "not_reached"
    assert missed["time_to_reward_s"] == {"0.5": pytest.approx(1.0), "0.9": None}
    crashed = fake_run("trl", 1, [0.0, 1.0], step_s=0.2, error="exit status 1")
    assert (crashed["status"], crashed["error"]) == ("crashed", "exit status 1")
    assert "steps_per_s" not in crashed
    nothing = analyze("trl", 2, [], None, ANALYZED, None)
    assert (nothing["status"], nothing["error"], nothing["time_to_reward_s"]["0.9"]) == (
        "crashed",
        "no step logged",
        None,
    )
    # A loaded machine's first step can end past the budget: the run trained, not within it.
    late = analyze("forge_rl", 3, fake_metrics([0.5], step_s=ANALYZED.budget_s + 5.0), 10.0, ANALYZED, None)
    assert (late["status"], late["steps"], late["steps_per_s"], late["first_step_s"]) == (
        "not_reached",
        0,
        0.0,
        ANALYZED.budget_s + 5.0,
    )


def test_the_ratio_is_forge_rls_median_time_over_trls_and_null_unless_every_seed_of_both_reached():
    learns = [0.0] * 5 + [1.0] * 10
    runs = {
        "trl": [fake_run("trl", s, learns, step_s) for s, step_s in ((0, 0.2), (1, 0.4), (2, 0.3))],
        "forge_rl": [fake_run("forge_rl", s, learns, step_s) for s, step_s in ((0, 0.5), (1, 0.6), (2, 0.4))],
    }
    summary = summarize(runs, (0.5, 0.9))
    assert summary["trl_time_to_reward_s"] == pytest.approx(3.0)  # median step 0.3 s x 10 steps
    assert summary["forge_rl_time_to_reward_s"] == pytest.approx(5.0)
    assert summary["ratio_forge_rl_over_trl"] == pytest.approx(5.0 / 3.0)
    runs["trl"][1] = fake_run("trl", 1, [0.0] * 15, 0.4)
    summary = summarize(runs, (0.5, 0.9))
    assert summary["trl_statuses"] == ["ok", "not_reached", "ok"]
    assert summary["trl_time_to_reward_s"] is None
    assert summary["ratio_forge_rl_over_trl"] is None


def test_trls_log_reads_back_as_forge_rls_metric_names(tmp_path):
    log = tmp_path / "trl_metrics.jsonl"
    log.write_text(
        json.dumps({"train_begin_unix_time": 100.0})
        + "\n"
        + json.dumps({"step": 1, "wall_time_s": 0.3, "reward": 0.25, "completion_tokens": 800.0, "step_time_s": 0.2})
        + "\n"
    )
    assert read_trl_metrics(log) == (100.0, [{"reward/mean": 0.25, "wall_time_s": 0.3, "num_tokens": 800.0}])
    assert read_trl_metrics(tmp_path / "absent.jsonl") == (None, [])


def test_trls_settings_are_forge_rls_configs(tmp_path):
    base = dataclasses.replace(load_yaml_config(GRPOConfig, CONFIG), steps=3)
    spec = peers.trl_spec(base, PeersArgs(out_dir=tmp_path), 7, tmp_path)
    assert (spec["completions_per_step"], spec["group_size"], spec["max_new_tokens"]) == (256, 8, 4)
    assert (Path(spec["reward_module"]).name, spec["reward_function"]) == ("synthetic.py", "leading_number_reward")
    assert (spec["loss_type"], spec["clip_eps_low"], spec["clip_eps_high"], spec["kl_beta"]) == ("dapo", 0.2, 0.28, 0.0)
    assert (spec["lr"], spec["temperature"], spec["seed"], spec["prompt_prefix"]) == (3e-4, 1.0, 7, "<bos>")
    rows = [json.loads(line) for line in Path(spec["prompts_path"]).read_text().splitlines()]
    assert len(rows) == 3 * 32 and rows[0]["prompt"].startswith("M") and rows[0]["prompt"].endswith("=")
    grpo = dataclasses.replace(
        base, trainer=dataclasses.replace(base.trainer, loss=dataclasses.replace(base.trainer.loss, name="grpo"))
    )
    with pytest.raises(ConfigError, match="matched for dapo only"):
        peers.trl_spec(grpo, PeersArgs(out_dir=tmp_path), 0, tmp_path)


def fake_forge_rl_side(calls):
    def run_forge_rl(base, args, seed, workload):
        calls.append(("forge_rl", workload, seed))
        return fake_run("forge_rl", seed, [0.0] * 5 + [1.0] * 10, 0.5)

    return run_forge_rl


def test_without_trls_environment_forge_rls_side_runs_alone_and_the_summary_says_how_to_build_it(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peers, "run_forge_rl", fake_forge_rl_side(calls))
    args = PeersArgs(
        workloads=("matched_tiny",),
        config=CONFIG,
        peer_venv=tmp_path / "no-venv",
        seeds=(0, 1),
        out_dir=tmp_path / "out",
    )
    summary = peers.main(args)
    assert calls == [("forge_rl", "matched_tiny", 0), ("forge_rl", "matched_tiny", 1)]
    assert (summary["peer_status"], summary["build_peer"], summary["peer"]) == ("missing", "make peers-venv", None)
    workload = summary["by_workload"]["matched_tiny"]
    assert workload["runs"]["trl"] == [] and "trl" not in workload["libraries"]
    assert summary["matched_tiny/forge_rl_time_to_reward_s"] == pytest.approx(5.0)
    assert summary["matched_tiny/ratio_forge_rl_over_trl"] is None
    assert (tmp_path / "out" / "matched_tiny" / "model" / "config.json").is_file()
    assert json.loads((tmp_path / "out" / "peers.json").read_text())["peer_status"] == "missing"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("  reward: leading_number\n", None),
        ("  reward: exact_match\n", "not a function of forge_rl/tasks/synthetic.py"),
        ("  rewards: {leading_number: 1.0, trailing_number: 0.5}\n", "names 2 reward functions"),
    ],
)
def test_what_trls_side_cannot_express_is_named(tmp_path, change, named):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.read_text().replace("  name: max_of_two\n", "  name: max_of_two\n" + change))
    reason = peers.peer_cannot_express(load_yaml_config(GRPOConfig, config))
    assert reason is None if named is None else named in reason


def test_a_workload_trls_side_cannot_express_runs_forge_rls_side_alone_and_says_why(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peers, "run_forge_rl", fake_forge_rl_side(calls))
    monkeypatch.setattr(peers, "peer_versions", lambda venv: {"trl": "1.16.0"})
    monkeypatch.setattr(peers, "run_trl", lambda *a: pytest.fail("TRL's side ran a workload it cannot express"))
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.read_text().replace("    name: dapo", "    name: grpo"))
    summary = peers.main(PeersArgs(workloads=("matched_tiny",), config=config, out_dir=tmp_path / "out"))
    assert calls == [("forge_rl", "matched_tiny", 0)]
    assert summary["peer_status"] == "ran" and "matched for dapo only" in summary["matched_tiny/peer_skipped"]
    assert (
        summary["matched_tiny/trl_time_to_reward_s"] is None
        and summary["matched_tiny/forge_rl_time_to_reward_s"] == 5.0
    )


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
    result = peers.run_trl(
        base, dataclasses.replace(ANALYZED, peer_venv=venv, out_dir=tmp_path / "out"), 0, "matched_tiny"
    )
    assert result["status"] == "crashed" and result["error"].startswith("exit status 3")
    assert result["time_to_reward_s"]["0.9"] is None and result["startup_s"] is None
    assert (tmp_path / "out" / "matched_tiny" / "trl-seed0" / "trl.log").read_text().strip() == "boom"


def test_bad_bench_arguments_are_refused_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match="--seeds"):
        peers.main(PeersArgs(workloads=("matched_tiny",), seeds=(), out_dir=tmp_path))
    with pytest.raises(ConfigError, match="unknown: \\['huge'\\]"):
        peers.main(PeersArgs(workloads=("matched_tiny", "huge"), out_dir=tmp_path))
    with pytest.raises(ConfigError, match="--config .* takes the place of one workload's config"):
        peers.main(PeersArgs(config=CONFIG, out_dir=tmp_path))
    other_task = tmp_path / "reasoning_gym.yaml"
    other_task.write_text(
        CONFIG.read_text().replace("name: max_of_two", "name: reasoning_gym\n  reward: reasoning_gym")
    )
    with pytest.raises(ConfigError, match="must train a synthetic task"):
        peers.main(PeersArgs(workloads=("matched_tiny",), config=other_task, out_dir=tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before anything was written


PEER_PYTHON = REPO / peers.PEER_VENV / "bin" / "python"


@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason=f"needs TRL's environment {peers.PEER_VENV} (make peers-venv)")
def test_trls_side_trains_two_steps_on_the_workloads_model(tmp_path):
    base = dataclasses.replace(load_yaml_config(GRPOConfig, CONFIG), steps=2)
    model = peers.build_model(base, peers.WORKLOADS["matched_tiny"], tmp_path / "model")
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, path=model))
    args = dataclasses.replace(ANALYZED, peer_venv=REPO / peers.PEER_VENV, out_dir=tmp_path, peer_threads=1)
    result = peers.run_trl(base, args, 0, "matched_tiny")
    assert result["steps"] == 2 and result["status"] == "not_reached", result
    assert result["startup_s"] > 0 and result["trained_tokens_per_s"] > 0
    assert os.path.isfile(tmp_path / "matched_tiny" / "trl-seed0" / "trl_metrics.jsonl")


def test_a_workload_with_a_form_trains_its_model_on_it_before_both_sides_read_it(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "FORM_STEPS", 2)
    base = load_yaml_config(GRPOConfig, REPO / peers.WORKLOADS["long_tail"].config)
    model = peers.build_model(base, peers.WORKLOADS["long_tail"], tmp_path / "model")
    assert (model / "config.json").is_file() and not (tmp_path / ".model.building").exists()
    fresh = peers.build_model(base, peers.WORKLOADS["matched_tiny"], tmp_path / "fresh")
    assert (model / "model.safetensors").read_bytes() != (fresh / "model.safetensors").read_bytes()
    forms = {peers.repeat_digit_form(make_prompt("repeat_digit", 0, 0), random.Random(seed)) for seed in range(20)}
    assert (
        len({form[0] for form in forms}) == 1 and len({len(form) for form in forms}) > 2
    )  # its digit, at several lengths


def test_steps_past_the_training_budget_are_left_out():
    late = analyze(
        "forge_rl",
        0,
        fake_metrics([0.0] * 5 + [1.0] * 10, step_s=1.0),
        5.0,
        dataclasses.replace(ANALYZED, budget_s=9.5),
        None,
    )
    assert (late["steps"], late["status"], late["time_to_reward_s"]["0.9"]) == (9, "not_reached", None)


def test_the_role_bound_is_the_steps_taken_times_the_busier_roles_seconds_per_step():
    metrics = fake_metrics([0.0] * 5 + [1.0] * 10, step_s=0.5)  # generators idle half of 7.5 s: busy 0.25 s a step
    for m in metrics:
        m.update(
            {
                "trainer/data_wait_s": 0.2,
                "trainer/forward_s": 0.1,
                "trainer/backward_s": 0.15,
                "trainer/optimizer_s": 0.02,
                "trainer/batching_s": 0.01,
                "trainer/publish_s": 0.01,
                "trainer/overhead_s": 0.01,
            }
        )
    run = analyze("forge_rl", 0, metrics, 10.0, ANALYZED, None)
    assert run["trainer_busy_s_per_step"] == pytest.approx(0.30)  # its step but the wait for data
    assert run["generator_busy_s_per_step"] == pytest.approx(0.25)
    assert run["bound_time_to_reward_s"] == pytest.approx(10 * 0.30)  # reached 0.9 at step 10
    trl = [fake_run("trl", 0, [0.0] * 5 + [1.0] * 10, 0.2)]
    summary = summarize({"trl": trl, "forge_rl": [run]}, (0.5, 0.9))
    assert summary["bound_ratio_forge_rl_over_trl"] == pytest.approx(3.0 / 2.0)
    assert summary["ratio_forge_rl_over_trl"] == pytest.approx(5.0 / 2.0)
    assert "bound_time_to_reward_s" not in fake_run("forge_rl", 0, [0.0] * 15, 0.5)  # a run without the trainer's parts


def test_forge_rls_run_is_cancelled_once_a_logged_step_passes_the_training_budget(tmp_path):
    import asyncio

    metrics = tmp_path / "metrics.jsonl"
    events = []

    async def fake_recipe(logged: asyncio.Event):
        try:
            with open(metrics, "w") as f:
                f.write(json.dumps({"wall_time_s": 5.0}) + "\n")
                f.flush()
                assert not peers.trained_past(metrics, 10.0)
                f.write(json.dumps({"wall_time_s": 11.0}) + "\n")
            logged.set()
            await asyncio.Event().wait()  # a run that would go on for its steps
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def main():
        logged = asyncio.Event()
        await peers.within_budget(fake_recipe(logged), metrics, PeersArgs(budget_s=10.0), poll_s=0.01)
        assert logged.is_set()

    asyncio.run(main())
    assert events == ["cancelled"]
    assert not peers.trained_past(tmp_path / "absent.jsonl", 10.0)

    async def ends():
        return None

    async def fails():
        raise RuntimeError("the recipe's own error")

    asyncio.run(peers.within_budget(ends(), metrics.with_name("none.jsonl"), PeersArgs(), poll_s=0.01))
    with pytest.raises(RuntimeError, match="own error"):
        asyncio.run(peers.within_budget(fails(), metrics.with_name("none.jsonl"), PeersArgs(), poll_s=0.01))


SMOLLM2 = REPO / peers.WORKLOADS["smollm2_lora"].config


def test_the_lora_workloads_trl_settings_carry_chat_prompts_the_data_rows_and_peft_names_of_the_same_layers(tmp_path):
    # A tiny model in the converted model's place: TRL's settings do not depend on its weights.
    tiny = load_yaml_config(GRPOConfig, CONFIG)
    model = peers.build_model(tiny, peers.WORKLOADS["matched_tiny"], tmp_path / "model")
    config = tmp_path / "smollm2.yaml"
    config.write_text(SMOLLM2.read_text().replace("path: models/SmolLM2-135M-Instruct", f"path: {model}"))
    base = dataclasses.replace(load_yaml_config(GRPOConfig, config), steps=2)
    assert peers.peer_cannot_express(base) is None
    spec = peers.trl_spec(base, ANALYZED, 0, tmp_path)
    assert spec["chat"] and spec["reward_function"] == "final_integer_reward"
    assert spec["lora"] == {
        "r": 16,
        "alpha": 32.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"],
    }
    rows = [json.loads(line) for line in Path(spec["prompts_path"]).read_text().splitlines()]
    source = [json.loads(line) for line in (REPO / "data" / "chain_sum_train.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": r["prompt"], "answer": r["answer"]} for r in source]
    lm_head = dataclasses.replace(
        base,
        trainer=dataclasses.replace(
            base.trainer, lora=dataclasses.replace(base.trainer.lora, targets=("wqkv", "lm_head"))
        ),
    )
    assert "['wqkv', 'lm_head']" in peers.peer_cannot_express(lm_head)
    (tmp_path / "rows.json").write_text(json.dumps([{"prompt": "1 + 1 =", "answer": "2"}]))
    json_list = dataclasses.replace(base, data=dataclasses.replace(base.data, path=str(tmp_path / "rows.json")))
    assert "not a .jsonl file" in peers.peer_cannot_express(json_list)


def test_the_lora_workload_without_its_converted_model_is_refused_naming_the_command_that_writes_it(tmp_path):
    config = tmp_path / "smollm2.yaml"
    config.write_text(SMOLLM2.read_text().replace("path: models/SmolLM2-135M-Instruct", f"path: {tmp_path / 'absent'}"))
    with pytest.raises(ConfigError, match="forge-rl convert"):
        peers.main(PeersArgs(workloads=("smollm2_lora",), config=config, out_dir=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
