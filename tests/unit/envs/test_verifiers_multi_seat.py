"""verifiers environments with several seats or several runs of a seat (verifiers 0.4's own
user-sim and best-of-n envs, unmodified) through forge_rl's verifiers adapter: every run is an
agent of an episode graph (forge_rl/envs/graph.py) with a view of its own, its reward the task's
score of its trace, and a seat the env marks untrainable never trained. A fake generator stands
in for the engine (tests/integration/test_verifiers_openenv_engine.py plays one on vLLM)."""

from __future__ import annotations

import asyncio
import sys

import pytest

pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4 (Python >= 3.11; make env-adapters)")

import forge_rl.envs.verifiers_sums as verifiers_sums  # noqa: E402
from forge_rl.envs.graph import EpisodeGraph  # noqa: E402
from forge_rl.envs.renderers import PlainTextRenderer  # noqa: E402
from forge_rl.envs.rollout import group_completions, play_graph  # noqa: E402
from forge_rl.envs.runner import EpisodeLimits, SampledTurn  # noqa: E402
from forge_rl.envs.trajectory import TrajectoryStatus  # noqa: E402
from forge_rl.envs.verifiers_adapter import verifiers_env_environment  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer  # noqa: E402
from tests.support.fakes import FakeGenerate  # noqa: E402
from tests.support.openenv_server import PRINTABLE  # noqa: E402

LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=4096, max_tokens_per_turn=16)
TASKSET_ID = "forge_rl_verifiers_sums"
"""verifiers loads a taskset by the name of a top-level module exporting it; the sums taskset
lives in forge_rl's package, so the test names it under a top-level alias."""


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> PlainTextRenderer:
    model_dir = tmp_path_factory.mktemp("ascii_tokenizer")
    save_char_tokenizer(model_dir, alphabet=PRINTABLE)
    return PlainTextRenderer(PromptTokenizer(model_dir))


@pytest.fixture(scope="module", autouse=True)
def sums_taskset_id():
    sys.modules[TASKSET_ID] = verifiers_sums
    yield
    del sys.modules[TASKSET_ID]


def sums():
    return verifiers_sums.SumsTasksetConfig(id=TASKSET_ID, seed=0)


def sampled(renderer, text: str) -> SampledTurn:
    tokenizer = renderer.tokenizer
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [-0.5] * len(token_ids), [2] * len(token_ids), "stop")


def test_a_modeled_user_and_the_assistant_each_get_a_view_and_only_the_assistant_trains(renderer):
    from verifiers.v1.envs.user_sim.env import UserSimEnv, UserSimEnvConfig

    env = UserSimEnv(UserSimEnvConfig(taskset=sums(), persona="{scenario}", done_marker="DONE"))
    task = env.taskset.load().__next__()  # the first task: its answer is the assistant's right reply
    make_env = verifiers_env_environment(env)
    # The user asks, the assistant answers, the user closes the conversation with the marker.
    generate = FakeGenerate(
        [sampled(renderer, "WHAT IS IT"), sampled(renderer, task.data.answer), sampled(renderer, "DONE")]
    )
    graph = asyncio.run(play_graph(make_env(0, 0), generate, renderer, LIMITS))

    assert isinstance(graph, EpisodeGraph) and graph.error is None
    assert list(graph.agents) == ["assistant", "user"]
    assistant, user = graph.agents["assistant"], graph.agents["user"]
    assert assistant.status == user.status == TrajectoryStatus.DONE
    assert (assistant.num_turns, user.num_turns) == (1, 2)
    assert assistant.final_reward == 1.0  # the sums task scored the assistant's trace
    # Each view holds exactly the turns sampled for it: the assistant's one reply, the user's two.
    assert [span.token_ids for span in assistant.generated_spans] == [
        tuple(sampled(renderer, task.data.answer).token_ids)
    ]
    assert len(user.generated_spans) == 2
    assistant_row, user_row = group_completions([graph])
    assert (assistant_row.agent, user_row.agent) == ("assistant", "user")
    assert any(assistant_row.loss_mask) and not any(user_row.loss_mask)  # the user seat is untrainable


def test_best_of_n_attempts_are_agents_of_one_seat_each_scored_on_its_own(renderer):
    from verifiers.v1.envs.best_of_n.env import BestOfNEnv, BestOfNEnvConfig

    env = BestOfNEnv(BestOfNEnvConfig(taskset=sums(), n=3))
    answer = env.taskset.load().__next__().data.answer
    wrong = str((int(answer) + 1) % 10)
    generate = FakeGenerate([sampled(renderer, answer), sampled(renderer, wrong), sampled(renderer, answer)])
    graph = asyncio.run(play_graph(verifiers_env_environment(env)(0, 0), generate, renderer, LIMITS))
    assert list(graph.agents) == ["agent/0", "agent/1", "agent/2"]
    assert sorted(t.final_reward for t in graph.agents.values()) == [0.0, 1.0, 1.0]
    rows = group_completions([graph])
    assert {row.baseline_group for row in rows} == {"agent"}  # the attempts are baselined together


def test_an_env_that_raises_mid_episode_costs_the_episode_every_agent_counted(renderer):
    from verifiers.v1.envs.user_sim.env import UserSimEnv, UserSimEnvConfig

    class Breaks(UserSimEnv):
        async def finalize(self, task, episode):
            raise RuntimeError("finalize failed")

    env = Breaks(UserSimEnvConfig(taskset=sums(), persona="{scenario}", done_marker="DONE"))
    generate = FakeGenerate([sampled(renderer, "Q"), sampled(renderer, "1"), sampled(renderer, "DONE")])
    graph = asyncio.run(play_graph(verifiers_env_environment(env)(0, 0), generate, renderer, LIMITS))
    assert graph.failed and "finalize failed" in graph.error
    assert {t.status for t in graph.agents.values()} == {TrajectoryStatus.ENV_ERROR}
