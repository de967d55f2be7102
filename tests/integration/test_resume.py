"""Checkpoint and resume.

Two levels, and which one is exact:

- Trainer (exact): two FSDP2 ranks train 2 steps on a fixed batch and write a DCP checkpoint; fresh
  processes load it and train 2 more. Their losses and weights equal those of 4 uninterrupted steps
  (to 1e-6; they are in fact bit-identical).
- Whole loop (continuity, not equality): `forge-rl grpo` runs synchronously (max_policy_age 0) with a
  checkpoint every 2 steps until a trainer process is killed. The run must stop on its own, naming
  the resume command and the newest checkpoint. `forge-rl grpo --resume RUN_DIR` then continues:
  step numbers, policy versions and the dataset cursor go on from the checkpoint, the prompts that
  were unsettled at the checkpoint are trained (none skipped), and no prompt is trained twice over
  the whole run. Completions after a resume are not those of an uninterrupted run: vLLM's sampler
  restarts from its seed and async generation interleaves differently (docs/checkpointing.md).
"""

from __future__ import annotations

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
import torch.distributed as dist

from forge_rl.batching import make_train_batch
from forge_rl.checkpoint import newest_complete_checkpoint, read_controller_state
from forge_rl.models.titan import ParallelConfig, read_hf_config
from forge_rl.trainer import PolicyTrainer, TrainerConfig
from tests.helpers import spawn_ranks, wait_until

from .test_trainer import _episodes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 2


def _train_rank(rank: int, model_dir: Path, checkpoint: Path, out: Path, resume: bool) -> None:
    """One FSDP2 rank: either 2 steps, save, 2 more (`resume` False) or load, 2 steps (True)."""
    torch.set_num_threads(1)
    trainer = PolicyTrainer(TrainerConfig(num_procs=2, parallel=ParallelConfig(dp_shard=2)), model_dir)
    batch = make_train_batch(_episodes(), pad_id=read_hf_config(model_dir)["pad_token_id"])
    noise = 0.05 * torch.randn(batch.input_ids_NL.shape, generator=torch.Generator().manual_seed(0))
    batch = dataclasses.replace(batch, behaviour_logprobs_NL=(trainer.compute_logprobs(batch) + noise) * batch.loss_mask_NL)
    losses = []
    if resume:
        trainer.load_checkpoint(checkpoint)
    else:
        losses = [trainer.train_step(batch)["loss"] for _ in range(STEPS_BEFORE_SAVE)]
        trainer.save_checkpoint(checkpoint)
    version_after_load = trainer.policy_version
    losses += [trainer.train_step(batch)["loss"] for _ in range(STEPS_AFTER_SAVE)]
    weights = trainer.hf_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "version_after_load": version_after_load}, out)
    dist.destroy_process_group()


def test_fsdp_trainer_resumed_from_a_checkpoint_matches_the_uninterrupted_one(model_dir, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    runs = {}
    for resume in (False, True):  # fresh processes each time: nothing survives but the checkpoint
        out = tmp_path / f"resume-{resume}.pt"
        spawn_ranks(_train_rank, model_dir, checkpoint, out, resume)
        runs[resume] = torch.load(out)
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one per rank
    uninterrupted, resumed = runs[False], runs[True]
    assert resumed["version_after_load"] == STEPS_BEFORE_SAVE
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][STEPS_BEFORE_SAVE:], abs=1e-6)
    for name, expected in uninterrupted["weights"].items():
        assert (resumed["weights"][name] - expected).abs().max() <= 1e-6, name


# --- the whole loop ----------------------------------------------------------------------------

CHECKPOINT_EVERY = 2
KILL_AT_CHECKPOINT_STEP = 4
HANG_S = 600
"""Bounds a hang of a run (starting it, reaching a checkpoint, stopping); never a pass condition."""


def _grpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "forge_rl.cli", "grpo", *args, "--log.progress-every-s", "0"]


def _wait_for(predicate, process: subprocess.Popen, stderr_path: Path, what: str) -> None:
    """Until `predicate()` holds; fails at once if the run exits first."""

    def reached() -> bool:
        assert process.poll() is None, stderr_path.read_text()[-3000:]
        return predicate()

    wait_until(reached, what, timeout_s=HANG_S)


def _kill_tree(process: subprocess.Popen) -> None:
    if process.poll() is None:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory):
    """Segment 1 until its trainer is killed after the step-4 checkpoint; segment 2 resumed to
    2 steps past the newest checkpoint."""
    tmp_path = tmp_path_factory.mktemp("resume")
    run_path = tmp_path / "run"
    stderr_path = tmp_path / "first.stderr"
    first = _grpo(
        "--config", "configs/grpo_tiny_cpu.yaml", "--steps", "1000", "--train-batch-size", "32", "--group-size", "4",
        "--prompts-in-flight-per-generator", "8", "--buffer.max-policy-age", "0",
        "--checkpoint.enabled", "--checkpoint.every-n-steps", str(CHECKPOINT_EVERY),
        "--checkpoint.keep-last", "2", "--run-dir", str(tmp_path), "--run-name", "run",
    )
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(first, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        checkpoint = run_path / "checkpoints" / f"step-{KILL_AT_CHECKPOINT_STEP:06d}"
        _wait_for(lambda: (checkpoint / "COMPLETE").is_file(), process, stderr_path, f"checkpoint {checkpoint.name}")
        descendants = psutil.Process(process.pid).children(recursive=True)
        trainer_pid = json.loads((run_path / "processes.json").read_text())["trainer"][0]
        os.kill(trainer_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # The pass condition is that the run stops on its own (exit code 1, checked below) and
        # leaves no process behind; how long detection takes on this machine is only reported.
        process.wait(timeout=HANG_S)
        stopped_s = time.monotonic() - killed_at
        _, alive = psutil.wait_procs(descendants, timeout=HANG_S)
    finally:
        _kill_tree(process)
    resumed_from = newest_complete_checkpoint(run_path)
    first_result = {
        "returncode": process.returncode, "stderr": stderr_path.read_text(), "stopped_s": stopped_s,
        "alive": alive, "resumed_from": resumed_from, "state": read_controller_state(resumed_from),
        "metrics_lines": len((run_path / "metrics.jsonl").read_text().splitlines()),
    }
    steps = first_result["state"].step + 2
    second = subprocess.run(
        _grpo("--resume", str(run_path), "--steps", str(steps)), cwd=REPO, capture_output=True, text=True, timeout=HANG_S
    )
    assert second.returncode == 0, second.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    return first_result, summary, metrics, run_path, steps


def test_a_dead_trainer_stops_the_run_naming_the_resume_command(killed_then_resumed):
    first, _, _, run_path, _ = killed_then_resumed
    assert first["returncode"] == 1, first["stderr"][-3000:]
    assert not first["alive"], "processes of the run outlived it"
    print(f"the run stopped {first['stopped_s']:.1f} s after its trainer was killed")
    message = " ".join(first["stderr"].split())
    assert "a process of run" in message and "died" in message
    assert f"forge-rl grpo --resume {run_path}" in message
    assert first["resumed_from"].name in message  # the newest complete checkpoint
    assert first["state"].step >= KILL_AT_CHECKPOINT_STEP
    kept = sorted(p.name for p in (run_path / "checkpoints").iterdir())
    assert len(kept) <= 2 and "step-000002" not in kept  # keep_last 2: the oldest was pruned


def test_the_resumed_run_continues_steps_versions_and_metrics(killed_then_resumed):
    first, summary, metrics, _, steps = killed_then_resumed
    state = first["state"]
    assert summary["steps"] == steps and summary["resumed_from"] == str(first["resumed_from"])
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # steps after the checkpoint were redone
    resumed = metrics[state.step:]
    assert resumed[0]["policy_version"] == state.policy_version + 1 - resumed[0]["step_skipped"]
    # Synchronous RL: the first resumed batch was generated by the checkpoint's policy version, so
    # the generators served the restored weights, not the model directory's.
    assert all(m["policy_age/max"] == 0 for m in resumed)
    assert all(min(m["generator/policy_versions"]) >= state.policy_version for m in resumed)


def test_no_prompt_is_skipped_or_trained_twice_across_the_resume(killed_then_resumed):
    first, summary, _, run_path, steps = killed_then_resumed
    at_resume = first["state"]
    accounting = summary["accounting"]
    assert accounting["trained_more_than_once"] == 0
    assert accounting["reissued_after_resume"] == len(at_resume.reissue)
    assert accounting["prompts_handed_out"] == (
        accounting["trained"] + accounting["dropped"] + accounting["skipped_nonfinite"] + accounting["unfinished_at_stop"]
    )
    # The run ended with a checkpoint (checkpoint.on_shutdown): every prompt unsettled at the
    # resume is now trained, dropped, or still pending (none skipped); the cursor only moved on.
    at_end = read_controller_state(newest_complete_checkpoint(run_path))
    assert at_end.step == steps and at_end.dataset_cursor >= at_resume.dataset_cursor
    trained = bytearray.fromhex(at_end.accounting["times_trained"])
    settled_or_pending = {
        *(i for i, count in enumerate(trained) if count), *at_end.buffer["dropped"]["episode_ids"],
        *at_end.accounting["skipped_ids"], *at_end.reissue,
    }
    assert set(at_resume.reissue) <= settled_or_pending
    assert set(range(at_end.dataset_cursor)) == settled_or_pending
