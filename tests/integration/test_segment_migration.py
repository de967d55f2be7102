"""A generator killed while a group is half decoded: what it had sampled is continued on a live
generator and trained, not generated again (generator.segment_tokens, forge_rl/pipeline/rollouts.py).

A real run with two real generators, decoding in segments of SEGMENT_TOKENS. Generator 0 holds
the first continuation it is asked for (tests/support/held_segments.py), so it dies with a
group whose first segment it returned and whose second it was decoding; the test kills its actor
and engine processes as soon as it holds (it writes held.json then: an event, not a sleep). The
train loop then waits after the next step until generator 0 is replaced, so the run cannot end
before the recovery, and the rest of the run has steps enough to train the continued group.

Checks: each completion of the held group was trained beginning with exactly the piece generator
0 had returned (ids, logprobs and policy versions, piece by piece), those it had left unfinished
went on past it; the group was trained once; the summary counts the salvaged tokens and the
continued group; no prompt is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import pytest

import apps.grpo.main as grpo_main
from apps.grpo.main import run
from forge_rl.config import GRPOConfig, LogConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.run.lifecycle import Lifecycle
from tests.support.held_segments import HELD_FILE, HOLD_DIR_ENV, SegmentHoldingPool
from tests.support.helpers import HANG_S, assert_every_prompt_accounted_for

pytestmark = pytest.mark.integration

SEGMENT_TOKENS = 4
MAX_NEW_TOKENS = 12
STEPS = 30


def _kill_when_held(hold_dir, run_path, killed: dict, stop: threading.Event) -> None:
    """Kill generator 0's actor and engine processes once it holds (held.json written)."""
    while not stop.is_set():
        if (hold_dir / HELD_FILE).exists():
            for pid in json.loads((run_path / "processes.json").read_text())["generators"][0]:
                os.kill(pid, signal.SIGKILL)
            killed["done"] = True
            return
        stop.wait(0.05)


@pytest.fixture(scope="module")
def migrated_run(tmp_path_factory):
    hold_dir = tmp_path_factory.mktemp("hold")
    config = GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name="migration",
        steps=STEPS,
        num_generators=2,
        group_size=2,
        train_batch_size=8,
        prompts_in_flight_per_generator=4,
        generator=GeneratorConfig(max_new_tokens=MAX_NEW_TOKENS, segment_tokens=SEGMENT_TOKENS),
        # No token of a STEPS-step run can pass this bound, so the held group stays trainable however
        # many steps its continuation waits behind the live generator's groups (a busy machine
        # stretches that wait); the buffer, first in first out, then trains it a few steps after.
        buffer=BufferConfig(max_policy_age=STEPS, capacity_episodes=32),
        log=LogConfig(rollouts=True),
    )
    run_path = config.run_dir / config.run_name
    killed: dict = {}
    stop = threading.Event()
    after_step = Lifecycle.after_step

    async def after_step_waiting_for_the_replacement(lifecycle, pipeline):
        await after_step(lifecycle, pipeline)
        if killed.get("done") and "replaced_at_step" not in killed:
            pool = pipeline.actors.generators
            while not await pool.recovery_events.call_one():  # the pool has not seen the death yet
                await asyncio.sleep(0.1)
            await pool.wait_until_serving.call_one(0)
            killed["replaced_at_step"] = pipeline.step

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HOLD_DIR_ENV, str(hold_dir))
        patch.setattr(grpo_main, "GeneratorPool", SegmentHoldingPool)
        patch.setattr(Lifecycle, "after_step", after_step_waiting_for_the_replacement)
        killer = threading.Thread(target=_kill_when_held, args=(hold_dir, run_path, killed, stop), daemon=True)
        killer.start()
        try:
            summary = asyncio.run(run(config))
        finally:
            stop.set()
            killer.join(HANG_S)
    held = json.loads((hold_dir / HELD_FILE).read_text()) if (hold_dir / HELD_FILE).exists() else None
    records = [json.loads(line) for line in (run_path / "rollouts.jsonl").read_text().splitlines()]
    return summary, held, records, killed, config


def test_generator_zero_held_a_half_decoded_group_and_was_killed(migrated_run):
    summary, held, _, killed, _ = migrated_run
    assert held is not None, "generator 0 was never asked to continue a group: no completion outlived a segment"
    assert killed.get("replaced_at_step") is not None
    assert [event["generator"] for event in summary["generator_recoveries"]] == [0]
    assert any(len(head) == SEGMENT_TOKENS for head in held["heads"])


def test_the_held_group_was_trained_once_beginning_with_its_first_pieces(migrated_run):
    _, held, records, _, _ = migrated_run
    trained = [r for r in records if r["prompt_token_ids"] == held["prompt_token_ids"]]
    assert len(trained) == 1, f"the held prompt was trained {len(trained)} times"
    completions = trained[0]["completions"]
    assert len(completions) == len(held["first_pieces"])
    continued = 0
    for completion, first in zip(completions, held["first_pieces"]):
        n = len(first["token_ids"])
        assert completion["token_ids"][:n] == first["token_ids"]
        assert completion["logprobs"][:n] == first["logprobs"]
        assert completion["policy_versions"][:n] == first["policy_versions"]
        continued += len(completion["token_ids"]) > n
    # The heads generator 0 was asked to continue are the unfinished ones: each went on past its head.
    assert continued == len(held["heads"])


def test_the_summary_counts_what_was_salvaged(migrated_run):
    summary, held, *_ = migrated_run
    accounting = summary["accounting"]
    assert accounting["salvaged_tokens"] >= sum(len(head) for head in held["heads"]) > 0
    assert accounting["continued_after_generator_failure"] >= 1
    assert accounting["salvage_discarded_tokens"] == 0


def test_no_prompt_is_lost_or_trained_twice(migrated_run):
    summary, *_, config = migrated_run
    assert summary["steps"] == config.steps
    assert_every_prompt_accounted_for(summary["accounting"], trained=config.steps * config.prompts_per_step)
