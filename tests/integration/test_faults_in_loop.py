"""The real loop with a reward function that raises and hangs, and every metrics sink on: the run
finishes, the faults are counted, and TensorBoard and W&B (offline) hold the steps."""

from __future__ import annotations

import asyncio
import json

import pytest

from apps.grpo.main import run
from forge_rl.buffer import BufferConfig
from forge_rl.config import GRPOConfig, LogConfig
from forge_rl.tasks import TaskConfig
from forge_rl.engines.vllm_engine import GeneratorConfig
from forge_rl.scoring import ScorerConfig

pytestmark = pytest.mark.integration

NUM_STEPS = 4


def test_a_faulty_reward_function_costs_completions_not_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # offline must not touch the network
    config = GRPOConfig(
        run_dir=tmp_path,
        run_name="faults",
        steps=NUM_STEPS,
        train_batch_size=32,
        group_size=4,
        task=TaskConfig(reward="tests.unit.faulty_rewards:flaky_leading_number"),
        scorer=ScorerConfig(reward_timeout_s=0.5),
        generator=GeneratorConfig(max_new_tokens=3),
        buffer=BufferConfig(max_policy_age=1, capacity_episodes=32),
        log=LogConfig(tensorboard=True, wandb=True),
    )
    summary = asyncio.run(run(config))
    run_path = tmp_path / "faults"
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]

    assert summary["steps"] == NUM_STEPS
    assert metrics[-1]["policy_version"] == NUM_STEPS
    assert all(m["step_skipped"] == 0 for m in metrics)
    # A random tiny model starts about 6 in 64 completions with A-F: dozens over the run.
    assert metrics[-1]["scorer/errored"] > 0
    assert sum(m["completions/errored"] for m in metrics) > 0
    assert metrics[-1]["scorer/worker_restarts"] == metrics[-1]["scorer/timed_out"]
    assert list((run_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list(run_path.glob("wandb/offline-run-*/run-*.wandb"))
