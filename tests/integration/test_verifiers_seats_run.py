"""A verifiers env with two seats (verifiers' user-sim: a modeled user and the assistant) played
and trained through a whole run on the real engine and trainer: both seats sampled by the policy,
each run an agent of an episode graph, the user's seat (untrainable, as user-sim's setup marks it)
never trained, every prompt accounted for."""

from __future__ import annotations

import asyncio
import collections
import json

import pytest

pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4 (Python >= 3.11; make env-adapters)")

from apps.grpo.main import run  # noqa: E402
from forge_rl.config import GRPOConfig, LogConfig, ModelConfig  # noqa: E402
from forge_rl.core.buffer import BufferConfig  # noqa: E402
from forge_rl.engines.config import GeneratorConfig  # noqa: E402
from forge_rl.envs.rollout import EnvironmentConfig  # noqa: E402
from forge_rl.envs.runner import EpisodeLimits  # noqa: E402
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model  # noqa: E402
from tests.support.helpers import assert_every_prompt_accounted_for  # noqa: E402
from tests.support.openenv_server import PRINTABLE  # noqa: E402

pytestmark = pytest.mark.integration

NUM_STEPS = 3
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def seats_run(tmp_path_factory):
    # The user's greeting and the model's replies are printable ASCII: a tokenizer that spells it.
    model_dir = create_tiny_model(
        TinyModelConfig(max_position_embeddings=MAX_MODEL_LEN),
        tmp_path_factory.mktemp("ascii") / "model",
        alphabet=PRINTABLE,
    )
    config = GRPOConfig(
        run_dir=tmp_path_factory.mktemp("runs"),
        run_name="seats",
        steps=NUM_STEPS,
        train_batch_size=8,
        group_size=4,
        prompts_in_flight_per_generator=4,
        model=ModelConfig(path=model_dir),
        environment=EnvironmentConfig(
            name="tests.support.verifiers_seats:user_sim_sums",
            limits=EpisodeLimits(max_turns=4, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=6),
        ),
        generator=GeneratorConfig(kv_block_size=32),
        buffer=BufferConfig(max_policy_age=1, capacity_episodes=16),
        log=LogConfig(rollouts=True),
    )
    summary = asyncio.run(asyncio.wait_for(run(config), 600))
    run_path = config.run_dir / config.run_name
    metrics = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (run_path / "rollouts.jsonl").read_text().splitlines()]
    return summary, metrics, rollouts, config


def test_both_seats_play_every_episode_and_the_assistants_reward_is_its_own(seats_run):
    summary, metrics, rollouts, config = seats_run
    assert summary["steps"] == NUM_STEPS
    assert_every_prompt_accounted_for(summary["accounting"], trained=NUM_STEPS * config.prompts_per_step)
    for record in rollouts:
        agents = collections.Counter(c.get("agent") for c in record["completions"])
        assert agents == {"assistant": config.group_size, "user": config.group_size}, agents
    assert all("reward/by_seat/assistant" in step for step in metrics)


def test_the_untrainable_users_tokens_never_reach_the_loss(seats_run):
    summary, metrics, rollouts, config = seats_run
    by_step = collections.defaultdict(int)
    for record in rollouts:
        for completion in record["completions"]:
            if completion["agent"] == "user":
                assert completion["trained_tokens"] == 0 and len(completion["token_ids"]) > 0
            by_step[record["step"]] += completion["trained_tokens"]
    # Each step trained exactly its episodes' trainable tokens: the assistant's sampled ones.
    assert {step["step"]: int(step["num_tokens"]) for step in metrics} == dict(by_step)
    assert all(count > 0 for count in by_step.values())
