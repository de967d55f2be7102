"""The real loop for a few steps: Monarch actors, a vLLM CPU engine, a 2-process TorchTitan trainer.

The fsdp variant runs in this process (`run(config)`, as a notebook does); the tp variant runs the
CLI over a host list of two localhost workers (services and trainer on one, the generator on the
other), so one run also covers the whole multi-host path: attach, cross-host weight fetch, and
workers left alive with none of the run's processes once it ends.
"""

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from apps.grpo.main import run
from forge_rl.config import GRPOConfig, LogConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.core.checkpoint import CheckpointConfig, newest_complete_checkpoint
from forge_rl.data.config import DataConfig
from forge_rl.data.rows import export_rows
from forge_rl.engines.config import GeneratorConfig
from forge_rl.evaluation.config import EvalConfig, EvalSetConfig
from forge_rl.models.titan import ParallelConfig
from forge_rl.pipeline.prompts import TaskRows
from forge_rl.plumbing.placement import LaunchConfig, PlacementConfig
from forge_rl.run.run_dir import config_to_dict
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.scoring.teacher import TEACHER_WEIGHTS_FILE, TeacherConfig, load_teacher_weights
from forge_rl.tasks import TaskConfig
from forge_rl.training.losses.policy import LossConfig
from forge_rl.training.trainer import TrainerConfig
from tests.support.helpers import assert_metric_keys_documented, wait_until
from tests.support.workers import REPO, run_processes_left, start_workers, stop_worker

pytestmark = pytest.mark.integration

NUM_STEPS = 4


SELF_TEACHER = TeacherConfig(pin="lagged", versions_back=1, refresh_every_n_steps=2)
"""Self-distillation: the teacher starts as the initial policy; after step 2 it serves version 1,
after step 4 version 3 (forge_rl/scoring/teacher.py `TeacherPin`)."""

# Each variant also runs recipe options that only a whole loop can check end to end:
#   fsdp  synchronous (max_policy_age 0), DAPO's dynamic sampling and soft overlong penalty,
#         self-distillation from a teacher pinned one version back, on its own process, and
#         checkpoints every 2 steps (a resume of it continues the teacher's schedule), and an
#         evaluation of every step's version on generators of its own (the resume's too);
#   tp    asynchronous (max_policy_age 1), temperature and top-p (the trainer must renormalize over
#         the generator's kept sets to agree with its logprobs), the KL penalty to a reference
#         model on its own process, a reward function that raises and hangs (it must cost
#         completions, not the run), every metrics sink (TensorBoard, W&B offline), and over a host
#         list of two workers: services and trainer on the first, generator and scorer on the second.
VARIANTS = {
    "fsdp": dict(
        buffer=BufferConfig(max_policy_age=0, capacity_episodes=32),
        trainer=TrainerConfig(num_procs=2, parallel=ParallelConfig(dp_shard=2)),
        generator=GeneratorConfig(max_new_tokens=3),
        dynamic_sampling=True,
        scorer=ScorerConfig(overlong_buffer=1, teacher=SELF_TEACHER),
        checkpoint=CheckpointConfig(enabled=True, every_n_steps=2),
    ),
    "tp": dict(
        buffer=BufferConfig(max_policy_age=1, capacity_episodes=32),
        trainer=TrainerConfig(num_procs=2, parallel=ParallelConfig(tp=2), loss=LossConfig(kl_beta=0.05)),
        generator=GeneratorConfig(max_new_tokens=3, temperature=0.7, top_p=0.9),
        task=TaskConfig(reward="tests.support.faulty_rewards:flaky_leading_number"),
        scorer=ScorerConfig(reward_timeout_s=0.5),
        log=LogConfig(tensorboard=True, wandb=True),
    ),
}


RUN_HANG_S = 600
"""Bounds a hang of a run (the CLI's, or one in this process); the pass condition is its summary and
what it left behind."""


def variant_config(name: str, tmp_path_factory, **overrides) -> GRPOConfig:
    return GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name=f"loop-{name}",
        steps=NUM_STEPS,
        train_batch_size=32,
        group_size=4,
        **VARIANTS[name],
        **overrides,
    )


def finished(summary: dict, config: GRPOConfig):
    run_path = config.run_dir / config.run_name
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics, run_path, config


def held_out_eval(tmp_path_factory, placement: str = "own") -> EvalConfig:
    """Every step's version evaluated on 16 prompts of the task written to a file (another seed's),
    none dropped: on the evaluation's own generator (placement own), each result must be exactly
    its step's version while the run's generator swaps to every version; on the run's generator
    (shared), pinned to it."""
    rows = tmp_path_factory.mktemp("eval") / "held_out.jsonl"
    export_rows(TaskRows(TaskConfig(seed=1)), rows, 16)
    data = DataConfig(str(rows), answer_column="answer")
    return EvalConfig(
        sets=(EvalSetConfig("held_out", data, max_prompts=16),),
        every_n_steps=1,
        max_waiting=NUM_STEPS + 2,
        placement=placement,
    )


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    config = variant_config("fsdp", tmp_path_factory, eval=held_out_eval(tmp_path_factory))
    return finished(asyncio.run(asyncio.wait_for(run(config), RUN_HANG_S)), config)


@pytest.fixture(scope="module")
def tp_workers_after_the_run():
    """Two localhost workers; after the tp run, whether both are alive (filled in by tp_run)."""
    ports, workers = start_workers(2)
    after = {"ports": ports, "workers": workers}
    yield after
    for worker in workers:
        stop_worker(worker)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, tp_workers_after_the_run):
    after = tp_workers_after_the_run
    workers = after["workers"]
    config = variant_config(
        "tp",
        tmp_path_factory,
        launch=LaunchConfig(
            hosts="list",
            workers=tuple(f"tcp://127.0.0.1:{port}" for port in after["ports"]),
            placement=PlacementConfig(generator_hosts=(1,), scorer_host=1),
        ),
        eval=held_out_eval(tmp_path_factory, placement="shared"),
    )
    config_path = config.run_dir / "tp.yaml"
    config_path.write_text(yaml.safe_dump(config_to_dict(config)))
    cli = subprocess.run(
        [sys.executable, "-m", "forge_rl.cli", "grpo", "--config", str(config_path), "--log.progress-every-s", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_HANG_S,
        env={**os.environ, "WANDB_BASE_URL": "http://127.0.0.1:9"},  # offline must not touch the network
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    after["alive_at_the_end"] = all(w.poll() is None for w in workers)
    # The run's processes on a worker end when the worker has stopped them, a little after the
    # run: wait for that state (a leak fails at the deadline, naming what is left).
    wait_until(lambda: not run_processes_left(workers), "the workers to reap the run's processes")
    after["alive_after_reaping"] = all(w.poll() is None for w in workers)
    return finished(json.loads(cli.stdout.strip().splitlines()[-1]), config)


@pytest.fixture(params=list(VARIANTS))
def finished_run(request):
    return request.getfixturevalue(f"{request.param}_run")


def test_the_run_trains_every_step_and_writes_its_outputs(finished_run):
    summary, metrics, run_path, _ = finished_run
    assert summary["steps"] == NUM_STEPS
    assert [m["step"] for m in metrics] == list(range(1, NUM_STEPS + 1))
    assert (run_path / "config.yaml").is_file()
    assert json.loads((run_path / "summary.json").read_text()) == summary
    for key in ("final_mean_reward", "wall_time_s", "max_policy_age_seen", "dropped_samples"):
        assert key in summary
    assert_metric_keys_documented(metrics)


def test_generators_serve_the_versions_the_trainer_publishes(finished_run):
    _, metrics, _, config = finished_run
    # Weight updates are not awaited by the train loop, so by the last step a generator holds at
    # least the version published max_policy_age + 1 steps earlier.
    assert min(metrics[-1]["generator/policy_versions"]) >= NUM_STEPS - config.buffer.max_policy_age - 1


def test_no_trained_token_is_older_than_max_policy_age(finished_run):
    summary, metrics, _, config = finished_run
    assert summary["max_policy_age_seen"] <= config.buffer.max_policy_age
    for m in metrics:
        assert all(int(age) <= config.buffer.max_policy_age for age in m["policy_age/histogram"])


def test_every_version_label_names_the_weights_that_sampled_the_token(fsdp_run):
    """Synchronous RL trains every token at the version it is labelled with, so the trainer's
    logprob under those weights must equal the generator's, at every step: a generator still
    sampling with older weights under a newer label (an update that did not apply) breaks this
    from step 2 on, by orders of magnitude."""
    _, metrics, _, _ = fsdp_run
    for m in metrics:
        assert m["policy_age/histogram"].keys() == {"0"}
        assert m["loss/mismatch_kl"] < 1e-5, m["step"]
        assert m["loss/max_abs_log_ratio"] < 1e-3, m["step"]
        assert m["health/mismatch_alarms"] == 0
    assert metrics[-1]["policy/entropy"] > 0


def test_trainer_and_generator_logprobs_agree_at_version_zero(finished_run):
    _, metrics, _, _ = finished_run
    first = metrics[0]  # step 1 trains version-0 tokens with version-0 weights: ratio must be 1
    assert first["policy_age/max"] == 0
    assert first["loss/mismatch_kl"] < 1e-5
    assert first["loss/max_abs_log_ratio"] < 1e-3


def test_dynamic_sampling_trains_only_groups_with_a_signal(fsdp_run):
    """A group has a signal when any token it trains has a nonzero advantage. Here the pinned
    teacher's token rewards give nearly every group one (its reverse KL is nonzero wherever the
    engine's and the trainer's numerics differ), so few or none are filtered; groups whose signal is
    in final rewards alone are filtered in tests/unit/core/test_advantages.py."""
    summary, metrics, _, config = fsdp_run
    assert all(m["groups/zero_advantage_fraction"] == 0 for m in metrics)
    accounting = summary["accounting"]
    assert accounting["trained"] == NUM_STEPS * config.prompts_per_step
    assert accounting["trained_more_than_once"] == 0
    # max_new_tokens 3, overlong_buffer 1: a 3-token (truncated) completion loses 1.
    assert metrics[-1]["scorer/overlong_penalized"] > 0


def test_a_pinned_teacher_scores_every_token_and_swaps_versions_while_generators_decode(fsdp_run):
    """The teacher starts as the initial policy, so at step 1 (synchronous: tokens sampled by
    version 0) its logprob of every sampled token is the generator's: reverse KL 0 up to the
    engine/trainer mismatch. It then serves version 1 after step 2 and version 3 after step 4,
    loaded from the weight store by its own process; the generators take no part in a swap, so
    they serve every published version (`generator/policy_versions`) and none was replaced. This run
    is synchronous, so its generators drain every step anyway; that they decode across a swap is
    checked in an asynchronous run, from its timeline: tests/integration/test_judge_run.py."""
    summary, metrics, _, _ = fsdp_run
    reverse_kl = [m["reward/components/teacher/reverse_kl"] for m in metrics]
    assert abs(reverse_kl[0]) < 1e-3
    assert all(m["scorer/teacher/errored"] == 0 for m in metrics)
    assert [m["teacher/policy_version"] for m in metrics] == [0, 1, 1, 3]
    # Step 3's tokens were sampled by version 2, one step ahead of the teacher's version 1.
    assert abs(reverse_kl[2]) > abs(reverse_kl[0])
    assert [min(m["generator/policy_versions"]) for m in metrics][-1] >= NUM_STEPS - 1
    assert summary["generator_recoveries"] == []


def test_a_resumed_self_distillation_run_serves_the_teacher_it_had_at_the_checkpoint(fsdp_run, tmp_path):
    """The fsdp run checkpoints after step 4, where its teacher serves version 3 with nothing
    staged. A copy of it resumed for 2 more steps: step 5 is scored by version 3 (a teacher started
    again would serve the initial policy, 0, and step 5 would say so), and step 6 swaps in
    version 5, staged at step 5 from the resumed run's store, which its checkpoint then holds."""
    _, _, run_path, config = fsdp_run
    copy = tmp_path / run_path.name
    shutil.copytree(run_path, copy)
    saved = load_teacher_weights(newest_complete_checkpoint(copy) / "teacher" / TEACHER_WEIGHTS_FILE)
    assert (saved["served_version"], saved["staged"]) == (3, None)

    asyncio.run(asyncio.wait_for(run(dataclasses.replace(config, steps=NUM_STEPS + 2, resume=copy)), RUN_HANG_S))
    metrics = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    served = {m["step"]: m["teacher/policy_version"] for m in metrics}
    assert (served[5], served[6]) == (3, 5)
    # The resumed run evaluates the version it resumed at (held in its store), then steps 5 and 6.
    assert [(r["step"], r["policy_version"]) for r in eval_records(copy)][-3:] == [(4, 4), (5, 5), (6, 6)]
    checkpoint = newest_complete_checkpoint(copy)
    assert checkpoint.name == "step-000006"
    assert load_teacher_weights(checkpoint / "teacher" / TEACHER_WEIGHTS_FILE)["served_version"] == 5


def eval_records(run_path) -> list[dict]:
    return [json.loads(line) for line in (run_path / "eval.jsonl").read_text().splitlines()]


def test_every_steps_version_is_evaluated_exactly_beside_training_and_never_trained(fsdp_run):
    """Each evaluation loads exactly its step's version, reserved in the store a step ahead, and
    every sampled token proves it (a result with another version's token is discarded and counted
    in eval/failed); the run's generator meanwhile swaps to each version. Nothing evaluated reaches
    the buffer: the accounting holds the training prompts only."""
    summary, metrics, run_path, config = fsdp_run
    records = eval_records(run_path)
    assert [(r["step"], r["policy_version"]) for r in records] == [(s, s) for s in range(NUM_STEPS + 1)]
    assert all(r["eval/failed"] == 0 and r["eval/dropped"] == 0 for r in records)
    assert all(
        r["eval/held_out/num_prompts"] == 16 and r["eval/held_out/version"] == r["policy_version"] for r in records
    )
    for record in records:
        samples = (
            (run_path / "eval" / "held_out" / f"version-{record['policy_version']}.jsonl").read_text().splitlines()
        )
        assert len(samples) == 16
    assert summary["eval"]["held_out"] == {k: v for k, v in records[-1].items() if k.startswith("eval/held_out/")}
    assert summary["evaluations"] == {"evaluated": NUM_STEPS + 1, "failed": 0, "dropped": 0}
    assert summary["accounting"]["trained"] == NUM_STEPS * config.prompts_per_step
    assert [min(m["generator/policy_versions"]) for m in metrics][-1] >= NUM_STEPS - 1


def test_forge_rl_eval_of_every_checkpoint_draws_the_runs_curve_from_its_checkpoints(fsdp_run, tmp_path):
    """`forge-rl eval --run RUN --every-checkpoint` after the run: each complete checkpoint (steps 2
    and 4) is written as an HF model directory and evaluated, in step order, on the run's own eval
    set (read from its config.yaml: one greedy sample per prompt) by an engine started from that
    directory; every sample is stamped with the engine's only version, so each result is that
    checkpoint's weights alone."""
    _, _, run_path, _ = fsdp_run
    out = tmp_path / "curve"
    cli = subprocess.run(
        [sys.executable, "-m", "forge_rl.cli", "eval", "--run", str(run_path), "--every-checkpoint", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_HANG_S,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    summary = json.loads(cli.stdout.strip().splitlines()[-1])
    assert [(point["step"], point["policy_version"]) for point in summary["curve"]] == [(2, 2), (4, 4)]
    assert (summary["step"], summary["policy_version"]) == (4, 4)
    for point in summary["curve"]:
        held = point["held_out"]
        assert (held["num_prompts"], held["num_errored"], held["version"]) == (16, 0, point["policy_version"])
        assert 0.0 <= held["pass@1"] <= 1.0
        prompts = [json.loads(line) for line in Path(held["results"]).read_text().splitlines()]
        assert len(prompts) == 16 and all(len(p["samples"]) == 1 for p in prompts)
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"]) for r in records] == [(2, 2), (4, 4)]
    assert "writing checkpoint step 2 (policy version 2)" in cli.stderr
    assert not list(out.glob("**/model.safetensors"))  # the exports are temporary


def test_an_evaluation_on_the_runs_generator_is_pinned_to_its_version_while_training_goes_on(tp_run):
    """eval.placement shared over a host list: the run's generator (on the second worker) samples
    each evaluation while it serves exactly the version, its updates held behind the call. The
    version training starts from is evaluated before the first step can publish (a batch must be
    generated first); a later version the generator has passed by the time its evaluation comes
    cannot be evaluated there, and is counted, never mixed."""
    summary, _, run_path, config = tp_run
    records = eval_records(run_path)
    assert (records[0]["step"], records[0]["policy_version"]) == (0, 0)
    assert all(
        r["eval/held_out/version"] == r["policy_version"] and r["eval/held_out/num_prompts"] == 16 for r in records
    )
    counts = summary["evaluations"]
    assert counts["evaluated"] == len(records) and counts["dropped"] == 0
    assert counts["evaluated"] + counts["failed"] == NUM_STEPS + 1  # every one asked for: made, or counted
    assert summary["accounting"]["trained"] == NUM_STEPS * config.prompts_per_step


def test_reference_model_is_the_initial_policy(tp_run):
    _, metrics, _, _ = tp_run
    # Step 1 trains with the initial weights, which the reference model holds: KL(pi || ref) = 0.
    assert metrics[0]["loss/ref_kl"] < 1e-6
    assert metrics[-1]["loss/ref_kl"] > metrics[0]["loss/ref_kl"]


def test_a_faulty_reward_function_costs_completions_not_the_run(tp_run):
    """Completions starting with A-F make the reward raise, with Z hang past its 0.5 s timeout."""
    _, metrics, run_path, _ = tp_run
    assert all(m["step_skipped"] == 0 for m in metrics)
    # A random tiny model starts about 6 in 46 completions with A-F: dozens over the run.
    assert metrics[-1]["scorer/errored"] > 0
    assert sum(m["completions/errored"] for m in metrics) > 0
    assert metrics[-1]["scorer/worker_restarts"] == metrics[-1]["scorer/timed_out"]


def test_every_metrics_sink_holds_the_steps(tp_run):
    _, _, run_path, _ = tp_run
    assert list((run_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list(run_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_workers_outlive_a_run_over_a_host_list_and_keep_none_of_its_processes(tp_run, tp_workers_after_the_run):
    assert tp_workers_after_the_run["alive_at_the_end"], "a worker exited with the run"
    assert tp_workers_after_the_run["alive_after_reaping"], "a worker exited while reaping the run"
