"""verifiers' own OpenEnv environment (verifiers.v1.tasksets.openenv: `OpenEnvTaskset` and
`OpenEnvEnv`, where the environment plays the user turn by turn), unmodified, through forge_rl's
verifiers adapter (`verifiers_env_environment`), against OpenEnv's echo environment served on
127.0.0.1 (tests/support/openenv_server.py). A fake generator stands in for the engine
(tests/integration/test_verifiers_openenv_engine.py plays it on vLLM).

OpenEnvEnv shows the model, each turn, a JSON payload of the observation and the action schema;
the model's reply becomes the action (`{"message": reply}` for the echo environment) and OpenEnv's
per-step rewards sum into the trace's `openenv_reward`. The echo environment never ends an
episode: the seat's own turn cap (`player.max_turns`, verifiers' AgentConfig) does.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4 (Python >= 3.11; make env-adapters)")

import verifiers.v1 as vf  # noqa: E402

from forge_rl.envs.renderers import PlainTextRenderer  # noqa: E402
from forge_rl.envs.rollout import play_episode, trajectory_completion  # noqa: E402
from forge_rl.envs.runner import EpisodeLimits, SampledTurn  # noqa: E402
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus  # noqa: E402
from forge_rl.envs.verifiers_adapter import verifiers_env_environment  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer  # noqa: E402
from tests.support.fakes import FakeGenerate  # noqa: E402
from tests.support.openenv_server import PRINTABLE, echo_url, require_openenv_for_verifiers  # noqa: E402, F401 (a fixture)

LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=8192, max_tokens_per_turn=16)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> PlainTextRenderer:
    model_dir = tmp_path_factory.mktemp("ascii_tokenizer")
    save_char_tokenizer(model_dir, alphabet=PRINTABLE)
    return PlainTextRenderer(PromptTokenizer(model_dir))


def openenv_env(url: str, max_turns: int | None = 3):
    """verifiers' OpenEnv environment as a verifiers user configures it: the taskset by id, the
    server by base_url, the player's turn cap."""
    from verifiers.v1.tasksets.openenv import OpenEnvConfig, OpenEnvEnv, OpenEnvEnvConfig

    config = OpenEnvEnvConfig(
        taskset=OpenEnvConfig(id="openenv", base_url=url), player=vf.AgentConfig(max_turns=max_turns)
    )
    return OpenEnvEnv(config)


def sampled(renderer, text: str, version: int) -> SampledTurn:
    tokenizer = renderer.tokenizer
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [-0.5] * len(token_ids), [version] * len(token_ids), "stop")


def test_verifiers_openenv_environment_runs_unmodified_and_records_every_turn(echo_url, renderer):
    turns = [sampled(renderer, text, version) for text, version in (("hello", 3), ("abc", 3), ("xy", 4))]
    generate = FakeGenerate(turns)
    trajectory = asyncio.run(
        play_episode(verifiers_env_environment(openenv_env(echo_url))(0, 0), generate, renderer, LIMITS)
    )
    assert trajectory.status == TrajectoryStatus.DONE, trajectory.error
    # OpenEnv's rewards, summed by verifiers' OpenEnvEnv: 0.1 per character echoed.
    assert trajectory.final_reward == pytest.approx(0.5 + 0.3 + 0.2)
    assert trajectory.num_turns == 3
    [sample] = trajectory.samples
    contexts = [span for span in sample.spans if isinstance(span, ContextSpan)]
    generated = [span for span in sample.spans if isinstance(span, GeneratedSpan)]
    assert [span.token_ids for span in generated] == [tuple(turn.token_ids) for turn in turns]
    assert [span.policy_versions for span in generated] == [(3,) * 6, (3,) * 4, (4,) * 3]
    assert all(span.logprobs == (-0.5,) * len(span.token_ids) for span in generated)
    # The context is what OpenEnvEnv wrote: the observation after reset, then each echo.
    payloads = [json.loads(renderer.decode(list(span.token_ids))) for span in contexts]
    echoed = [payload["observation"]["echoed_message"] for payload in payloads]
    assert echoed == ["Echo Env environment ready!", "hello", "abc"]
    assert all(payload["action_schema"]["title"] == "EchoAction" for payload in payloads)
    # Each turn was sampled after exactly the tokens the trainer sees before it.
    for (prefix, _), span in zip(generate.calls, generated):
        position = sample.spans.index(span)
        assert prefix == [t for s in sample.spans[:position] for t in s.token_ids]
    completion = trajectory_completion(trajectory)
    assert completion.reward == trajectory.final_reward
    assert sum(completion.generated) == sum(len(turn.token_ids) for turn in turns)


def test_forge_rls_own_turn_limit_ends_the_episode_truncated(echo_url, renderer):
    # The player's cap (5) lies past forge_rl's (2): forge_rl's limit ends it, unrewarded.
    generate = FakeGenerate([sampled(renderer, "hi", 0), sampled(renderer, "yo", 0)])
    limits = EpisodeLimits(max_turns=2, max_total_tokens=8192, max_tokens_per_turn=16)
    env = verifiers_env_environment(openenv_env(echo_url, max_turns=5))(0, 0)
    trajectory = asyncio.run(play_episode(env, generate, renderer, limits))
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TURNS and trajectory.final_reward == 0.0
    assert trajectory.num_turns == 2


def test_an_unreachable_openenv_server_ends_the_episode_as_an_environment_error(renderer):
    require_openenv_for_verifiers()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = verifiers_env_environment(openenv_env(url))(0, 0)
    trajectory = asyncio.run(play_episode(env, FakeGenerate([]), renderer, LIMITS))
    assert trajectory.status == TrajectoryStatus.ENV_ERROR and "ConnectionError" in trajectory.error
    assert trajectory.num_turns == 0
