"""A seat of a multi-agent environment played by OpenAI-style agent code (`Seat.player`,
forge_rl/envs/runner.py): the player talks to the model through a real `openai.AsyncOpenAI` client
served in process, its calls are the agent's view, what it returns is the agent's turn, and a
player that fails, stalls or answers without the model ends the episode counted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

import pytest

from forge_rl.envs.graph import GraphStep, Seat
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.runner import run_graph
from forge_rl.envs.selfplay import ChatSolverSelfPlayEnv, ProposerSolverEnv
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from tests.support.helpers import episode_limits
from tests.unit.envs.test_episode_graphs import FakeAgentsGenerate


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


def play(env, generate, tokenizer, **limits):
    return asyncio.run(
        asyncio.wait_for(run_graph(env, generate, PlainTextRenderer(tokenizer), episode_limits(**limits)), 30)
    )


def test_an_openai_style_solver_plays_its_seat_and_its_calls_are_its_view(tokenizer):
    # The solver's first reply holds no digit, so the agent code asks again: two calls, one sample
    # (the second prompt continues the first), and its last reply is its turn.
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["M"], "M37=MM37=": ["7"]})
    graph = play(ChatSolverSelfPlayEnv(num_solvers=1), generate, tokenizer)
    assert graph.error is None
    assert {agent: t.final_reward for agent, t in graph.agents.items()} == {"proposer": 0.0, "solver/0": 1.0}
    solver = graph.agents["solver/0"]
    assert solver.status == TrajectoryStatus.DONE and solver.num_turns == 2
    (sample,) = solver.samples
    assert [type(span) for span in sample.spans] == [ContextSpan, GeneratedSpan, ContextSpan, GeneratedSpan]
    assert sample.spans[3].token_ids == tuple(tokenizer.encode_text("7") + [tokenizer.eos_id])
    # The graph's edges are the environment's: one node per turn the player returned.
    assert [(n.agent, n.shown) for n in graph.nodes] == [("proposer", ()), ("solver/0", (0,))]


def test_the_solvers_of_an_episode_play_concurrently_each_with_its_own_view(tokenizer):
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7"] * 3}, hold={"M37=": 3})
    graph = play(ChatSolverSelfPlayEnv(num_solvers=3), generate, tokenizer)
    assert graph.error is None and generate.arrived == {"M37=": 3}  # all three calls in flight at once
    assert [graph.agents[f"solver/{k}"].num_turns for k in range(3)] == [1, 1, 1]


async def raises(client, observation):
    raise RuntimeError("the agent's tool crashed")


async def answers_without_the_model(client, observation):
    return "7"


async def never_answers(client, observation):
    await asyncio.Event().wait()


async def returns_a_number(client, observation):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": observation}])
    return 7


@dataclass
class OnePlayedSolver(ProposerSolverEnv):
    player: ClassVar = None

    @property
    def seats(self):
        return (
            Seat("proposer", max_turns=1),
            Seat("solver", baseline="episode", player=self.player, turn_timeout_s=0.5),
        )


@pytest.mark.parametrize(
    "player, status, message",
    [
        (raises, TrajectoryStatus.ENV_ERROR, "the seat's player raised RuntimeError: the agent's tool crashed"),
        (answers_without_the_model, TrajectoryStatus.ENV_ERROR, "without a model call"),
        (never_answers, TrajectoryStatus.ENV_TIMEOUT, "turn_timeout_s (0.5 s)"),
        (returns_a_number, TrajectoryStatus.ENV_ERROR, "returned 7: it must return the turn's text"),
    ],
)
def test_a_player_that_fails_stalls_or_skips_the_model_ends_the_episode_counted(tokenizer, player, status, message):
    env = type("Env", (OnePlayedSolver,), {"player": staticmethod(player)})(num_solvers=1)
    graph = play(env, FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7"]}), tokenizer)
    assert message in graph.error
    assert {t.status for t in graph.agents.values()} == {status}


def test_a_player_past_its_seats_model_calls_ends_its_agent_truncated(tokenizer):
    # max_turns 1: the agent code's second call is refused by the endpoint (BadRequestError in the
    # agent); its agent ends TRUNCATED_TURNS and the environment scores it as failed.
    @dataclass
    class OneCall(ChatSolverSelfPlayEnv):
        seats: ClassVar = (
            Seat("proposer", max_turns=1),
            Seat("solver", baseline="episode", max_turns=1, player=ChatSolverSelfPlayEnv.seats[1].player),
        )

    graph = play(OneCall(num_solvers=1), FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["M"]}), tokenizer)
    assert graph.error is None
    assert graph.agents["solver/0"].status == TrajectoryStatus.TRUNCATED_TURNS
    assert graph.agents["solver/0"].final_reward == 0.0


def test_a_step_reward_for_a_played_seat_is_refused_naming_why(tokenizer):
    @dataclass
    class RewardsTurns(ChatSolverSelfPlayEnv):
        async def step(self, agent, turn_text):
            result = await super().step(agent, turn_text)
            return (
                GraphStep(result.observations, turn_reward=1.0) if agent != "proposer" and not result.done else result
            )

    graph = play(
        RewardsTurns(num_solvers=2), FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7", "7"]}), tokenizer
    )
    assert "gave a turn_reward to a seat its player plays" in graph.error
