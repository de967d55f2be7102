"""Environments get the data row: a factory with a `row` parameter is made with each prompt's row
(`EnvironmentConfig.make_env`, `Rollouts._play`), one taking (seed, index) works as before, and the
config refuses the pairings that would drop rows or lack them."""

from __future__ import annotations

import asyncio
import collections
import functools
import types

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.data.config import DataConfig
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import EnvironmentConfig, EnvWaitClock, reads_row
from forge_rl.envs.runner import SampledTurn
from forge_rl.errors import ConfigError
from forge_rl.observability.metrics import EpisodeStats
from forge_rl.observability.timeline import Timeline
from forge_rl.pipeline.rollouts import Rollouts
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.types import Episode
from tests.support import row_envs
from tests.support.fakes import FakeEndpoint

SECRET_ENV = "tests.support.row_envs:fake_secret_env"


def test_a_factory_says_whether_it_reads_a_row():
    assert reads_row(row_envs.fake_secret_env) == "required"
    assert reads_row(row_envs.fake_secret_env_or_default) == "optional"
    assert EnvironmentConfig(name="calculator").reads_row is None
    assert EnvironmentConfig().reads_row is None


def test_make_env_passes_the_row_to_a_factory_that_takes_one_and_not_to_one_that_does_not():
    row_envs.made_with.clear()
    make_env = EnvironmentConfig(name=SECRET_ENV).make_env()
    env = make_env(3, 5, row={"secret": 42, "other": "x"})
    assert env.secret == "42" and row_envs.made_with == [(3, 5, {"secret": 42, "other": "x"})]
    optional = EnvironmentConfig(name="tests.support.row_envs:fake_secret_env_or_default").make_env()
    assert optional(0, 1).secret == "7"
    calculator = EnvironmentConfig(name="calculator").make_env()
    assert calculator(0, 1) is not None  # the (seed, index) form, unchanged


def test_the_config_pairs_data_with_an_environment_only_when_it_reads_rows(tmp_path):
    data = DataConfig(path=str(tmp_path / "rows.jsonl"))  # opened by the preflight, not by the config
    config = GRPOConfig(data=data, environment=EnvironmentConfig(name=SECRET_ENV))
    assert config.environment.reads_row == "required"
    with pytest.raises(ConfigError, match=r"takes \(seed, index\) and no row.*def make_env\(seed, index, row\)"):
        GRPOConfig(data=data, environment=EnvironmentConfig(name="calculator"))
    with pytest.raises(ConfigError, match=r"takes a `row`.*data.path is unset.*--data.path.*row=None"):
        GRPOConfig(environment=EnvironmentConfig(name=SECRET_ENV))
    GRPOConfig(environment=EnvironmentConfig(name="tests.support.row_envs:fake_secret_env_or_default"))


def test_the_rollout_makes_each_episode_with_its_prompts_row(tmp_path):
    """`Rollouts._play` on a data prompt: every environment of the group is made with the row, and
    the row's secret, said back, is rewarded."""
    save_char_tokenizer(tmp_path)
    tokenizer = PromptTokenizer(tmp_path)
    config = GRPOConfig(
        data=DataConfig(path=str(tmp_path / "rows.jsonl")), environment=EnvironmentConfig(name=SECRET_ENV)
    )

    async def generate_turn(index, prefix_token_ids, max_new_tokens):
        ids = tokenizer.encode_text("42") + [tokenizer.eos_id]
        return SampledTurn(ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    rollouts = types.SimpleNamespace(
        config=config,
        make_env=config.environment.make_env(),
        env_waits=EnvWaitClock(1),
        timeline=Timeline(),
        calls=collections.Counter(),
        episode_stats=EpisodeStats(),
        actors=types.SimpleNamespace(
            generators=types.SimpleNamespace(generate_turn=FakeEndpoint(generate_turn)),
            renderer=PlainTextRenderer(tokenizer),
        ),
    )
    rollouts.brancher = None
    for method in ("_turns_on", "_envs", "_with_policies"):
        setattr(rollouts, method, functools.partial(getattr(Rollouts, method), rollouts))
    rollouts._row = Rollouts._row
    row = {"prompt": "say 42", "secret": 42}
    prompt = Episode(episode_id=9, prompt_text="say 42", answer="", prompt_token_ids=[1], columns=row)
    row_envs.made_with.clear()
    episode = asyncio.run(Rollouts._play(rollouts, 0, prompt))
    assert row_envs.made_with == [(config.task.seed, 9, row)] * config.group_size
    assert episode.rewards == [1.0] * config.group_size and episode.columns == row
