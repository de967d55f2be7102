"""`--resume` after a SIGKILL of the controller continues the groups that were mid-generation at
the checkpoint (generator.segment_tokens), from what the checkpoint held of them.

One run of the demo task whose completions decode in segments of SEGMENT_TOKENS, checkpointed
every CHECKPOINT_EVERY steps, its controller SIGKILLed once a checkpoint is complete; a resume
then runs STEPS_AFTER_RESUME steps past it with every trained episode written to rollouts.jsonl.
Checks: the checkpoint held partial groups, each of their prompts among those it re-issues; the
resumed run trained each of them beginning with exactly the tokens (and versions) the checkpoint
held; the summary counts them; no prompt is trained twice, none is lost.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from forge_rl.core.checkpoint import newest_complete_checkpoint, read_controller_state
from tests.support.helpers import assert_every_prompt_accounted_for

from .test_resume import _grpo, _kill_leftovers, _resume_to, _run_processes, _started, _wait_for_checkpoint

pytestmark = pytest.mark.integration

SEGMENT_TOKENS = 4
MAX_NEW_TOKENS = 24
CHECKPOINT_EVERY = 2
KILL_AFTER_CHECKPOINT_STEP = 4
STEPS_AFTER_RESUME = 4


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("partials")
    run_path = tmp_path / "run"
    stderr_path = tmp_path / "first.stderr"
    controller = _started(
        _grpo(
            "--config",
            "configs/grpo_tiny_cpu.yaml",
            "--steps",
            "1000",
            "--train-batch-size",
            "16",
            "--group-size",
            "4",
            "--prompts-in-flight-per-generator",
            "8",
            "--generator.max-new-tokens",
            str(MAX_NEW_TOKENS),
            "--generator.segment-tokens",
            str(SEGMENT_TOKENS),
            "--buffer.max-policy-age",
            "2",
            "--checkpoint.every-n-steps",
            str(CHECKPOINT_EVERY),
            "--log.rollouts",
            "--run-dir",
            str(tmp_path),
            "--run-name",
            "run",
        ),
        stderr_path,
    )
    run_processes = []
    try:
        _wait_for_checkpoint(KILL_AFTER_CHECKPOINT_STEP, controller, run_path, stderr_path)
        run_processes = _run_processes(controller, run_path)
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
    finally:
        _kill_leftovers(controller, run_processes)
    checkpoint = newest_complete_checkpoint(run_path)
    saved = read_controller_state(checkpoint)
    steps = saved.step + STEPS_AFTER_RESUME
    summary, stderr, _ = _resume_to(run_path, steps)
    records = [json.loads(line) for line in (run_path / "rollouts.jsonl").read_text().splitlines()]
    return {
        "saved": saved,
        "steps": steps,
        "summary": summary,
        "stderr": stderr,
        # The resumed run's, which come after the killed one's in the file: the last of each episode.
        "trained": {r["episode_id"]: r for r in records if r["step"] > saved.step},
    }


def test_the_checkpoint_held_groups_mid_generation_among_its_prompts_to_reissue(resumed):
    saved = resumed["saved"]
    assert saved.partial_groups, "no group was mid-generation at the checkpoint"
    assert {group["episode_id"] for group in saved.partial_groups} <= set(saved.reissue)
    assert all(
        len(c["token_ids"]) % SEGMENT_TOKENS == 0 or c["status"] == "ok"
        for group in saved.partial_groups
        for c in group["completions"]
    )
    assert f"({len(saved.partial_groups)} continuing their partial groups)" in resumed["stderr"]


def test_each_partial_group_was_trained_beginning_with_what_the_checkpoint_held(resumed):
    saved, trained = resumed["saved"], resumed["trained"]
    for group in saved.partial_groups:
        record = trained.get(group["episode_id"])
        assert record is not None, f"prompt {group['episode_id']} was not trained after the resume"
        for completion, head in zip(record["completions"], group["completions"]):
            n = len(head["token_ids"])
            assert completion["token_ids"][:n] == head["token_ids"]
            assert completion["policy_versions"][:n] == head["policy_versions"]
            assert completion["logprobs"][:n] == head["logprobs"]
        for completion, head, done in zip(record["completions"], group["completions"], group["finished"]):
            if not done:  # it went on past what the checkpoint held
                assert len(completion["token_ids"]) > len(head["token_ids"])


def test_the_summary_counts_them_and_the_accounting_is_exact(resumed):
    saved, summary = resumed["saved"], resumed["summary"]
    accounting = summary["accounting"]
    assert summary["steps"] == resumed["steps"]
    assert accounting["continued_after_resume"] == len(saved.partial_groups)
    assert accounting["salvaged_tokens"] >= sum(
        len(c["token_ids"]) for group in saved.partial_groups for c in group["completions"]
    )
    assert_every_prompt_accounted_for(accounting)
