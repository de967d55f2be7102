"""forge_rl/envs/openenv_adapter.py: OpenEnv environments, unmodified, in process. The echo
environment is the one `openenv init` writes; the others are OpenEnv environments written in the
test as a user writes them (subclasses of OpenEnv's own Environment)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openenv.core.env_server.interfaces", reason="needs openenv (make env-adapters)")

from openenv.core.env_server.interfaces import Environment as OpenEnvBase  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from forge_rl.envs.environment import MalformedTurn, StepResult  # noqa: E402
from forge_rl.envs.openenv_adapter import OpenEnvEnvironment, observation_fields, openenv_echo_env  # noqa: E402
from forge_rl.envs.renderers import PlainTextRenderer  # noqa: E402
from forge_rl.envs.runner import SampledTurn, run_episode  # noqa: E402
from forge_rl.envs.trajectory import ContextSpan, TrajectoryStatus  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer  # noqa: E402
from tests.support.fakes import FakeGenerate  # noqa: E402
from tests.support.helpers import episode_limits


class GuessAction(Action):
    number: int


class GuessObservation(Observation):
    hint: str = ""


class GuessEnvironment(OpenEnvBase):
    """Guess 7: "HIGHER"/"LOWER" hints, reward 1.0 and done on the right number."""

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        return GuessObservation(hint="GUESS=")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.number == 7:
            return GuessObservation(done=True, reward=1.0)
        return GuessObservation(hint="HIGHER=" if action.number < 7 else "LOWER=", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class AsyncGuessEnvironment(GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        raise AssertionError("an environment with step_async is awaited, not run in a thread")

    async def step_async(self, action, timeout_s=None, **kwargs):
        return GuessEnvironment.step(self, action)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


def sampled(tokenizer, text: str) -> SampledTurn:
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [-0.25] * len(token_ids), [2] * len(token_ids), "stop")


def guess_env(cls=GuessEnvironment) -> OpenEnvEnvironment:
    return OpenEnvEnvironment(cls(), action=lambda text: GuessAction(number=text))


def test_openenvs_echo_environment_runs_unmodified_and_its_rewards_sum_into_the_episodes_return(tokenizer):
    turns = [sampled(tokenizer, "AB"), sampled(tokenizer, "HELLO"), sampled(tokenizer, "X")]
    trajectory = asyncio.run(
        run_episode(openenv_echo_env(0, 0), FakeGenerate(turns), PlainTextRenderer(tokenizer), episode_limits())
    )
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_turns == 3
    assert trajectory.final_reward == pytest.approx(0.1 * (2 + 5 + 1))  # the echo environment's own reward
    assert [m.content for m in trajectory.conversation] == [
        "ECHO ENV ENVIRONMENT READY=",
        "AB",
        "AB=",
        "HELLO",
        "HELLO=",
        "X",
    ]
    [sample] = trajectory.samples
    assert [span.token_ids for span in sample.generated_spans] == [tuple(t.token_ids) for t in turns]
    assert sample.spans[2] == ContextSpan(tuple(tokenizer.encode_text("AB=")))


def test_an_environment_that_says_done_closes_the_episode_with_its_reward(tokenizer):
    turns = [sampled(tokenizer, "3"), sampled(tokenizer, "9"), sampled(tokenizer, "7")]
    trajectory = asyncio.run(
        run_episode(guess_env(), FakeGenerate(turns), PlainTextRenderer(tokenizer), episode_limits())
    )
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    assert [m.content for m in trajectory.conversation] == ["GUESS=", "3", "HIGHER=", "9", "LOWER=", "7"]


def test_a_turn_that_is_not_a_valid_action_is_a_malformed_turn_naming_why():
    env = guess_env()
    asyncio.run(env.reset())
    with pytest.raises(MalformedTurn) as malformed:
        asyncio.run(env.step("SEVEN"))
    assert "valid integer" in str(malformed.value.observation)


def test_an_environment_with_step_async_is_awaited():
    env = guess_env(AsyncGuessEnvironment)
    asyncio.run(env.reset())
    assert asyncio.run(env.step("7")) == StepResult(done=True, final_reward=1.0)


def test_what_is_not_an_openenv_environment_is_refused_and_observations_default_to_their_fields():
    with pytest.raises(TypeError, match="not an openenv"):
        OpenEnvEnvironment(object(), action=str)
    assert observation_fields(GuessObservation(hint="HI", reward=0.5)) == "HI"
    assert observation_fields(State(step_count=2)) == '{"episode_id": null, "step_count": 2}'
