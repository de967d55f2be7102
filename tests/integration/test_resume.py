"""Checkpoint and resume.

Two levels, and which one is exact:

- Trainer (exact): two FSDP2 ranks train 2 steps on a fixed batch and write a DCP checkpoint; fresh
  processes load it and train 2 more. Their losses and weights equal those of 4 uninterrupted steps
  (to 1e-6; they are in fact bit-identical).
- Whole loop (continuity, not equality), one run on a data file in three segments, each ended a
  different way:
  1. `forge-rl grpo` runs synchronously (max_policy_age 0) with a checkpoint every 2 steps until a
     trainer process is killed. The run must stop on its own, naming the resume command and the
     newest checkpoint, and leave no process behind.
  2. `forge-rl grpo --resume RUN_DIR` goes on until its next checkpoint; then its controller is
     killed with SIGKILL (it runs no cleanup). Within 10 s no process of the run is left and nothing
     of it in host shared memory: the weight store's root, and whatever else in /dev/shm the run's
     processes mapped or held open at the kill (tests that run beside it have their own).
  3. A second resume runs 2 steps past the newest checkpoint and ends normally: step numbers, policy
     versions and the dataset cursor go on from the checkpoint, the prompts that were unsettled at
     it are trained (none skipped), and no prompt is trained twice over the whole run: every row of
     the file once per epoch.
  Completions after a resume are not those of an uninterrupted run: vLLM's sampler restarts from
  its seed and async generation interleaves differently (docs/checkpointing.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.core.checkpoint import complete_checkpoints, newest_complete_checkpoint, read_controller_state
from forge_rl.data.config import DataConfig
from forge_rl.data.order import locate
from forge_rl.data.rows import export_rows
from forge_rl.models.titan import ParallelConfig, read_hf_config
from forge_rl.pipeline.prompts import TaskRows
from forge_rl.tasks import TaskConfig
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from tests.support.helpers import alive, described, run_on_ranks, wait_until

from .test_trainer import _episodes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 2


def _train_rank(rank: int, model_dir: Path, checkpoint: Path, out: Path, resume: bool) -> None:
    """One FSDP2 rank: either 2 steps, save (in the background) while 2 more train (`resume`
    False), or load, 2 steps (True)."""
    torch.set_num_threads(1)
    trainer = PolicyTrainer(TrainerConfig(num_procs=2, parallel=ParallelConfig(dp_shard=2)), model_dir)
    batch = make_train_batch(_episodes(), pad_id=read_hf_config(model_dir)["pad_token_id"])
    noise = 0.05 * torch.randn(batch.input_ids_NL.shape, generator=torch.Generator().manual_seed(0))
    batch = dataclasses.replace(
        batch, behaviour_logprobs_NL=(trainer.compute_logprobs(batch) + noise) * batch.loss_mask_NL
    )
    losses = []
    if resume:
        trainer.load_checkpoint(checkpoint)
    else:
        losses = [trainer.train_step(batch)["loss"] for _ in range(STEPS_BEFORE_SAVE)]
        trainer.start_checkpoint(checkpoint)  # written while the next steps train, as a run writes it
    version_after_load = trainer.policy_version
    losses += [trainer.train_step(batch)["loss"] for _ in range(STEPS_AFTER_SAVE)]
    trainer.wait_for_checkpoint()
    weights = trainer.hf_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "version_after_load": version_after_load}, out)


def test_fsdp_trainer_resumed_from_a_checkpoint_matches_the_uninterrupted_one(model_dir, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    runs = {}
    for resume in (False, True):  # fresh processes each time: nothing survives but the checkpoint
        out = tmp_path / f"resume-{resume}.pt"
        run_on_ranks(_train_rank, model_dir, checkpoint, out, resume, fresh=True)
        runs[resume] = torch.load(out)
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one per rank
    uninterrupted, resumed = runs[False], runs[True]
    assert resumed["version_after_load"] == STEPS_BEFORE_SAVE
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][STEPS_BEFORE_SAVE:], abs=1e-6)
    for name, expected in uninterrupted["weights"].items():
        assert (resumed["weights"][name] - expected).abs().max() <= 1e-6, name


# --- the whole loop ----------------------------------------------------------------------------

SHM = Path("/dev/shm")
CHECKPOINT_EVERY = 2
KILL_AT_CHECKPOINT_STEP = 4
CLEANUP_BUDGET_S = 10
STEPS_AFTER_LAST_RESUME = 2
HANG_S = 600
"""Bounds a hang of a run (starting it, reaching a checkpoint, stopping); never a pass condition."""


def _grpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "forge_rl.cli", "grpo", *args, "--log.progress-every-s", "0"]


def _started(command: list[str], stderr_path: Path) -> subprocess.Popen:
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)


def _wait_for_checkpoint(step: int, process: subprocess.Popen, run_path: Path, stderr_path: Path) -> None:
    """Until the checkpoint of `step` is complete; fails at once if the run exits first."""
    complete = run_path / "checkpoints" / f"step-{step:06d}" / "COMPLETE"

    def reached() -> bool:
        assert process.poll() is None, stderr_path.read_text()[-3000:]
        return complete.is_file()

    wait_until(reached, f"checkpoint step-{step:06d}", timeout_s=HANG_S)


def _run_processes(controller: subprocess.Popen, run_path: Path) -> list[psutil.Process]:
    """Every process of the run: the controller's descendants (actors, vLLM's engine processes,
    reward workers, ...) and the pids the run recorded."""
    processes = psutil.Process(controller.pid).children(recursive=True)
    recorded = json.loads((run_path / "processes.json").read_text())
    for pid in [*recorded["trainer"], *(pid for generator in recorded["generators"] for pid in generator)]:
        if pid not in {process.pid for process in processes}:
            with contextlib.suppress(psutil.NoSuchProcess):
                processes.append(psutil.Process(pid))
    return processes


def _shm_of(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm entries (names at its top level) the processes map or hold open (the weight
    store's root; shared-memory segments and semaphores, had any library of theirs made one): the
    run's own, told apart from those of the tests beside it (`make test` runs two files at once)."""
    paths = []
    for process in processes:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    paths.append(fields[5])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{process.pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.append(os.readlink(f"/proc/{process.pid}/fd/{fd}"))
    prefix = f"{SHM}/"
    return {
        path[len(prefix) :].split("/")[0]
        for path in paths
        if path.startswith(prefix) and not path.endswith(" (deleted)")
    }


def _store_roots(controller_pid: int) -> set[str]:
    """The weight-store roots a launch of the run made (forge_rl/store/shm.py names them
    forge_rl-<run>-<controller pid>-<nonce>)."""
    return {name for name in os.listdir(SHM) if name.startswith(f"forge_rl-run-{controller_pid}-")}


def _kill_leftovers(controller: subprocess.Popen, processes: list[psutil.Process]) -> None:
    """Whatever of the run a failed segment left; resource trackers are spared, as they unlink the
    shared memory they track once the processes holding them are gone."""
    if controller.poll() is None:
        processes = [*processes, *psutil.Process(controller.pid).children(recursive=True)]
        controller.kill()
    for process in alive(processes):
        if not any("resource_tracker" in part for part in described([process])):
            process.kill()


def _poll(condition, deadline: float) -> None:
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


NUM_ROWS = 40
"""Rows of the run's data file (the demo task's first prompts): 8 prompts a step, an epoch each 5 steps."""


def _first_segment_killed_trainer(tmp_path: Path, run_path: Path) -> dict:
    stderr_path = tmp_path / "first.stderr"
    rows = tmp_path / "rows.jsonl"
    export_rows(TaskRows(TaskConfig()), rows, NUM_ROWS)
    process = _started(
        _grpo(
            "--config",
            "configs/grpo_tiny_cpu.yaml",
            "--data.path",
            str(rows),
            "--data.answer-column",
            "answer",
            "--steps",
            "1000",
            "--train-batch-size",
            "32",
            "--group-size",
            "4",
            "--prompts-in-flight-per-generator",
            "8",
            "--buffer.max-policy-age",
            "0",
            "--checkpoint.enabled",
            "--checkpoint.every-n-steps",
            str(CHECKPOINT_EVERY),
            "--checkpoint.keep-last",
            "2",
            "--run-dir",
            str(tmp_path),
            "--run-name",
            "run",
        ),
        stderr_path,
    )
    descendants = []
    try:
        _wait_for_checkpoint(KILL_AT_CHECKPOINT_STEP, process, run_path, stderr_path)
        descendants = psutil.Process(process.pid).children(recursive=True)
        os.kill(json.loads((run_path / "processes.json").read_text())["trainer"][0], signal.SIGKILL)
        killed_at = time.monotonic()
        # The pass condition is that the run stops on its own (exit code 1, checked below) and
        # leaves no process behind; how long detection takes on this machine is only reported.
        process.wait(timeout=HANG_S)
        stopped_s = time.monotonic() - killed_at
        _, still_alive = psutil.wait_procs(descendants, timeout=HANG_S)
    finally:
        _kill_leftovers(process, descendants)
    resumed_from = newest_complete_checkpoint(run_path)
    return {
        "returncode": process.returncode,
        "stderr": stderr_path.read_text(),
        "stopped_s": stopped_s,
        "alive": still_alive,
        "resumed_from": resumed_from,
        "state": read_controller_state(resumed_from),
    }


def _second_segment_killed_controller(tmp_path: Path, run_path: Path) -> dict:
    resumed_at = read_controller_state(newest_complete_checkpoint(run_path)).step
    stderr_path = tmp_path / "second.stderr"
    controller = _started(_grpo("--resume", str(run_path), "--steps", "1000"), stderr_path)
    run_processes = []
    try:
        _wait_for_checkpoint(resumed_at + CHECKPOINT_EVERY, controller, run_path, stderr_path)
        run_processes = _run_processes(controller, run_path)
        run_shm = _shm_of([psutil.Process(controller.pid), *run_processes]) | _store_roots(controller.pid)
        os.kill(controller.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        controller.wait()
        deadline = killed_at + CLEANUP_BUDGET_S
        _poll(lambda: not alive(run_processes), deadline)
        survivors = described(alive(run_processes))
        _poll(lambda: not run_shm & set(os.listdir(SHM)), deadline)
        left_in_shm = sorted(run_shm & set(os.listdir(SHM)))
        cleaned_up_s = time.monotonic() - killed_at
    finally:
        _kill_leftovers(controller, run_processes)
    return {"survivors": survivors, "run_shm": run_shm, "left_in_shm": left_in_shm, "cleaned_up_s": cleaned_up_s}


def _resume_to(run_path: Path, steps: int) -> tuple[dict, str, int]:
    """`forge-rl grpo --resume RUN_PATH --steps STEPS` to its end: its summary, its stderr, its pid."""
    resumed = subprocess.Popen(
        _grpo("--resume", str(run_path), "--steps", str(steps)),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = resumed.communicate(timeout=HANG_S)
    finally:
        resumed.kill()
    assert resumed.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1]), stderr, resumed.pid


@pytest.fixture(scope="module")
def three_segments(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resume")
    run_path = tmp_path / "run"
    first = _first_segment_killed_trainer(tmp_path, run_path)
    second = _second_segment_killed_controller(tmp_path, run_path) if SHM.is_dir() else None
    last_resumed_from = newest_complete_checkpoint(run_path)
    at_last_resume = read_controller_state(last_resumed_from)
    steps = at_last_resume.step + STEPS_AFTER_LAST_RESUME
    summary, _, third_pid = _resume_to(run_path, steps)
    return {
        "first": first,
        "second": second,
        "last_resumed_from": last_resumed_from,
        "at_last_resume": at_last_resume,
        "steps": steps,
        "run_path": run_path,
        "third_store_roots": _store_roots(third_pid),
        "summary": summary,
        "metrics": [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()],
    }


def test_a_dead_trainer_stops_the_run_naming_the_resume_command(three_segments):
    first, run_path = three_segments["first"], three_segments["run_path"]
    assert first["returncode"] == 1, first["stderr"][-3000:]
    assert not first["alive"], "processes of the run outlived it"
    print(f"the run stopped {first['stopped_s']:.1f} s after its trainer was killed")
    message = " ".join(first["stderr"].split())
    assert "a process of run" in message and "died" in message
    assert f"forge-rl grpo --resume {run_path}" in message
    assert first["resumed_from"].name in message  # the newest complete checkpoint
    assert first["state"].step >= KILL_AT_CHECKPOINT_STEP
    kept = sorted(p.name for p in (run_path / "checkpoints").iterdir())  # after the later segments
    assert len(kept) <= 2 and "step-000002" not in kept  # keep_last 2: the oldest were pruned


@pytest.mark.skipif(not SHM.is_dir(), reason="needs host shared memory at /dev/shm (Linux)")
def test_a_killed_controller_leaves_no_process_and_no_shared_memory(three_segments):
    second = three_segments["second"]
    assert not second["survivors"], f"alive {CLEANUP_BUDGET_S} s after the controller was killed: {second['survivors']}"
    assert any(name.startswith("forge_rl-run-") for name in second["run_shm"]), second["run_shm"]  # its store
    assert not second["left_in_shm"], (
        f"left in /dev/shm {CLEANUP_BUDGET_S} s after the controller was killed: {second['left_in_shm']}"
    )
    assert second["cleaned_up_s"] < CLEANUP_BUDGET_S
    print(f"everything of the run was gone {second['cleaned_up_s']:.1f} s after its controller was killed")


def test_the_resumed_run_continues_steps_versions_and_metrics(three_segments):
    state, summary, metrics, steps = (three_segments[k] for k in ("at_last_resume", "summary", "metrics", "steps"))
    assert summary["steps"] == steps
    assert summary["resumed_from"] == str(three_segments["last_resumed_from"])
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # steps after each checkpoint were redone
    resumed = metrics[state.step :]
    assert resumed[0]["policy_version"] == state.policy_version + 1 - resumed[0]["step_skipped"]
    # Synchronous RL: the first resumed batch was generated by the checkpoint's policy version, so
    # the generators served the restored weights, not the model directory's.
    assert all(m["policy_age/max"] == 0 for m in resumed)
    assert all(min(m["generator/policy_versions"]) >= state.policy_version for m in resumed)


def test_no_prompt_is_skipped_or_trained_twice_across_the_resumes(three_segments):
    at_resume, summary, run_path, steps = (
        three_segments[k] for k in ("at_last_resume", "summary", "run_path", "steps")
    )
    accounting = summary["accounting"]
    assert accounting["trained_more_than_once"] == 0
    # The count goes on over both resumes: the checkpoint's count, plus what this resume reissued.
    assert accounting["reissued_after_resume"] == at_resume.accounting["reissued_after_resume"] + len(at_resume.reissue)
    assert accounting["prompts_handed_out"] == (
        accounting["trained"]
        + accounting["dropped"]
        + accounting["skipped_nonfinite"]
        + accounting["unfinished_at_stop"]
    )
    # The run ended with a checkpoint (checkpoint.on_shutdown): every prompt unsettled at the
    # resume is now trained, dropped, or still pending (none skipped); the cursor only moved on.
    at_end = read_controller_state(newest_complete_checkpoint(run_path))
    assert at_end.step == steps and at_end.dataset_cursor >= at_resume.dataset_cursor
    trained = bytearray.fromhex(at_end.accounting["times_trained"])
    settled_or_pending = {
        *(i for i, count in enumerate(trained) if count),
        *at_end.buffer["dropped"]["episode_ids"],
        *at_end.accounting["skipped_ids"],
        *at_end.accounting["filtered_ids"],
        *at_end.reissue,
    }
    assert set(at_resume.reissue) <= settled_or_pending
    assert set(range(at_end.dataset_cursor)) == settled_or_pending
    # Prompt i is row perm(epoch)[i mod N] of the data file: every epoch the cursor passed handed
    # out each row exactly once, across the killed trainer, the killed controller and both resumes.
    rows_by_epoch: dict[int, list[int]] = {}
    for index in range(at_end.dataset_cursor):
        position = locate(index, NUM_ROWS, DataConfig(path="rows.jsonl").seed)
        rows_by_epoch.setdefault(position.epoch, []).append(position.row_number)
    assert len(rows_by_epoch) >= 2  # the run went past the end of the file
    assert all(
        sorted(rows) == list(range(NUM_ROWS)) for epoch, rows in rows_by_epoch.items() if epoch < max(rows_by_epoch)
    )
    assert all(len(set(rows)) == len(rows) for rows in rows_by_epoch.values())
    if three_segments["second"] is not None:
        assert not three_segments["third_store_roots"], "the resumed run left its weight store behind"


def test_forge_rl_eval_draws_the_runs_curve_over_its_checkpoints(three_segments, tmp_path):
    """`forge-rl eval --run RUN --every-checkpoint` on the resumed run: each complete checkpoint
    exported and evaluated in step order, at the policy version it saved."""
    run_path = three_segments["run_path"]
    checkpoints = complete_checkpoints(run_path)
    out = tmp_path / "eval"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_rl.cli",
            "eval",
            "--run",
            str(run_path),
            "--every-checkpoint",
            "--data.path",
            str(run_path.parent / "rows.jsonl"),
            "--data.answer-column",
            "answer",
            "--max-prompts",
            "8",
            "--eval.num-samples",
            "2",
            "--eval.temperature",
            "1.0",
            "--eval.k-values",
            "1",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    curve = json.loads(cli.stdout.strip().splitlines()[-1])["curve"]
    versions = [read_controller_state(path).policy_version for _, path in checkpoints]
    assert [(c["step"], c["policy_version"]) for c in curve] == [
        (step, v) for (step, _), v in zip(checkpoints, versions)
    ]
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [step for step, _ in checkpoints]
    assert all(
        r["eval/rows/num_prompts"] == 8 and 0.0 <= r["eval/rows/pass@1"] <= r["eval/rows/pass@2"] <= 1.0
        for r in records
    )
