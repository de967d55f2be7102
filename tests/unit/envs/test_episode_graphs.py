"""Episode graphs (forge_rl/envs/graph.py, forge_rl/envs/runner.py `run_graph`): several agents in
one episode, each with a view of its own, credit per seat, and the environment's mistakes ending
the episode with a reason instead of hanging or training on it."""

from __future__ import annotations

import asyncio

import pytest

from forge_rl.core.advantages import episode_advantages
from forge_rl.envs.graph import EpisodeGraph, GraphStep, Seat, declared_seats
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import group_completions, play_group
from forge_rl.envs.runner import SampledTurn, run_graph
from forge_rl.envs.selfplay import NO_TASK_REWARD, ProposerSolverEnv, proposer_reward
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus
from forge_rl.errors import ConfigError
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.types import Episode
from tests.support.helpers import episode_limits


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


@pytest.fixture(scope="module")
def renderer(tokenizer) -> PlainTextRenderer:
    return PlainTextRenderer(tokenizer)


class FakeAgentsGenerate:
    """A fake of a generator's turn sampler for several agents: the turn it returns is chosen by
    what the prefix says (each agent reads something else), from the scripted answers for that
    prompt, in order. `hold`: prompt -> n, hold each call after that prompt until n of them are in
    flight at once (proof that those turns are sampled concurrently); `hang_on`: a prompt whose
    turns never come."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        answers: dict[str, list[str]],
        hold: dict[str, int] | None = None,
        hang_on: str | None = None,
    ):
        self.tokenizer, self.answers = tokenizer, {k: list(v) for k, v in answers.items()}
        self.hold, self.hang_on = hold or {}, hang_on
        self.arrived: dict[str, int] = {}
        self.released = {prompt: asyncio.Event() for prompt in self.hold}

    async def __call__(self, prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        prompt = self.tokenizer.decode(prefix_token_ids, skip_special_tokens=True)
        if prompt == self.hang_on:
            await asyncio.Event().wait()
        if prompt in self.hold:
            self.arrived[prompt] = self.arrived.get(prompt, 0) + 1
            if self.arrived[prompt] == self.hold[prompt]:
                self.released[prompt].set()
            await self.released[prompt].wait()
        text = self.answers[prompt].pop(0)
        token_ids = (self.tokenizer.encode_text(text) + [self.tokenizer.eos_id])[:max_new_tokens]
        finish = "stop" if token_ids[-1] == self.tokenizer.eos_id else "length"
        return SampledTurn(token_ids, [-0.5] * len(token_ids), [3] * len(token_ids), finish)


def play_graph(env, generate, renderer, **limits) -> EpisodeGraph:
    return asyncio.run(asyncio.wait_for(run_graph(env, generate, renderer, episode_limits(**limits)), 30))


def test_a_proposer_solver_episode_gives_each_agent_its_own_view_and_its_reward(tokenizer, renderer):
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7", "7", "3", "7"]})
    graph = play_graph(ProposerSolverEnv(num_solvers=4), generate, renderer)

    assert graph.error is None
    assert list(graph.agents) == ["proposer", "solver/0", "solver/1", "solver/2", "solver/3"]
    proposer = graph.agents["proposer"]
    assert proposer.status == TrajectoryStatus.DONE
    # The proposer read "P=" and wrote its task; each solver read the task it wrote, as context.
    (sample,) = proposer.samples
    assert sample.spans[0] == ContextSpan(tuple(tokenizer.encode_prompt("P=")))
    assert sample.spans[1].token_ids == tuple(tokenizer.encode_text("37") + [tokenizer.eos_id])
    for k in range(4):
        spans = graph.agents[f"solver/{k}"].samples[0].spans
        assert spans[0] == ContextSpan(tuple(tokenizer.encode_prompt("M37=")))
        assert isinstance(spans[1], GeneratedSpan) and spans[1].policy_versions == (3, 3)
    rewards = {agent: t.final_reward for agent, t in graph.agents.items()}
    assert rewards == {"proposer": 0.25, "solver/0": 1.0, "solver/1": 1.0, "solver/2": 0.0, "solver/3": 1.0}
    # Edges: every solver's turn read what the proposer's turn produced.
    assert [(n.agent, n.shown) for n in graph.nodes] == [("proposer", ())] + [(f"solver/{k}", (0,)) for k in range(4)]


def test_the_solvers_turns_are_sampled_concurrently_and_the_environment_called_one_call_at_a_time(tokenizer, renderer):
    class CountsCalls(ProposerSolverEnv):
        in_call = max_in_call = 0

        async def step(self, agent, turn_text):
            self.in_call += 1
            self.max_in_call = max(self.max_in_call, self.in_call)
            await asyncio.sleep(0)  # a chance for another call to start, were calls not serialized
            self.in_call -= 1
            return await super().step(agent, turn_text)

    # Each solver's turn is held until all four are being sampled at once.
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7"] * 4}, hold={"M37=": 4})
    env = CountsCalls(num_solvers=4)
    graph = play_graph(env, generate, renderer)
    assert graph.error is None and generate.arrived["M37="] == 4
    assert env.max_in_call == 1


def test_advantages_are_per_seat_over_the_group_or_within_the_episode(tokenizer, renderer):
    envs = [ProposerSolverEnv(num_solvers=2) for _ in range(2)]
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37", "12"], "M37=": ["7", "3"], "M12=": ["2", "2"]})
    graphs = asyncio.run(play_group(envs, generate, renderer, episode_limits()))
    completions = group_completions(graphs)
    assert [(c.agent, c.baseline_group) for c in completions] == [
        ("proposer", "proposer"),
        ("solver/0", "solver@0"),
        ("solver/1", "solver@0"),
        ("proposer", "proposer"),
        ("solver/0", "solver@1"),
        ("solver/1", "solver@1"),
    ]
    # Rewards: task 37 solved once in two (learnability 0.5), task 12 always (0.0).
    assert [c.reward for c in completions] == [0.5, 1.0, 0.0, 0.0, 1.0, 1.0]
    advantages = episode_advantages(Episode(0, "", "", [], completions), normalize_std=False)
    # Proposers against each other (mean 0.25); solvers against their own episode's solvers.
    assert advantages == pytest.approx([0.25, 0.5, -0.5, -0.25, 0.0, 0.0])


def test_a_single_agent_episode_is_the_graph_of_one_agent_and_its_completion_names_no_agent(tokenizer, renderer):
    from forge_rl.envs.calculator import CalculatorEnv

    generate = FakeAgentsGenerate(tokenizer, {"37*52=": ["C37*52"], "37*52=C37*52R1924=": ["1924"]})
    (graph,) = asyncio.run(play_group([CalculatorEnv(37, 52)], generate, renderer, episode_limits()))
    assert graph.is_single_agent and list(graph.agents) == ["agent"]
    assert [(n.agent, n.turn, n.shown) for n in graph.nodes] == [("agent", 0, ()), ("agent", 1, (0,))]
    (completion,) = group_completions([graph])
    assert completion.agent is None and completion.baseline_group is None and completion.reward == 1.0


def test_a_proposal_that_is_no_task_closes_the_episode_with_the_format_penalty(tokenizer, renderer):
    graph = play_graph(ProposerSolverEnv(), FakeAgentsGenerate(tokenizer, {"P=": ["AB"]}), renderer)
    assert list(graph.agents) == ["proposer"]
    assert graph.agents["proposer"].final_reward == NO_TASK_REWARD


def test_the_learnability_reward_is_high_for_tasks_solved_sometimes_and_zero_for_always_or_never():
    assert proposer_reward(0.0) == proposer_reward(1.0) == 0.0
    assert proposer_reward(0.25) == 0.75 and proposer_reward(0.75) == 0.25
    assert proposer_reward(0.75, "solve_rate") == 0.75


def test_a_solver_out_of_tokens_is_told_to_the_environment_and_fails_its_task(tokenizer, renderer):
    # Turns of at most 1 token: "7<eos>" is cut to "7" ("length"), the last of a 5-token budget.
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7", "7"]})
    graph = play_graph(ProposerSolverEnv(num_solvers=2), generate, renderer, max_total_tokens=6)
    solver = graph.agents["solver/0"]
    assert solver.status == TrajectoryStatus.TRUNCATED_TOKENS and solver.final_reward == 0.0
    assert graph.agents["proposer"].status == TrajectoryStatus.DONE and graph.agents["proposer"].final_reward == 0.0


# ---------------------------------------------------------------------------------------------------
# The environment's mistakes
# ---------------------------------------------------------------------------------------------------


class Scripted:
    """A multi-agent fake environment: reset and each agent's steps return what the script says."""

    seats = (Seat("a"), Seat("b"))

    def __init__(self, first, steps: dict[str, list[GraphStep]]):
        self.first, self.steps = first, {agent: list(s) for agent, s in steps.items()}

    async def reset(self):
        return self.first

    async def step(self, agent, turn_text):
        return self.steps[agent].pop(0)


def test_an_observation_for_an_undeclared_seat_ends_the_episode_naming_it(tokenizer, renderer):
    env = Scripted({"a": "X="}, {"a": [GraphStep({"judge": "Y="})]})
    graph = play_graph(env, FakeAgentsGenerate(tokenizer, {"X=": ["1"]}), renderer)
    assert graph.failed and "'judge'" in graph.error and "seats: a, b" in graph.error
    assert {t.status for t in graph.agents.values()} == {TrajectoryStatus.ENV_ERROR}
    assert set(graph.agents) == {"a", "b"}  # every seat has its (counted, untrained) row


def test_agents_that_wait_on_each_other_end_the_episode_instead_of_hanging(tokenizer, renderer):
    env = Scripted({"a": "X="}, {"a": [GraphStep()]})  # a's step gives nobody anything, and does not close
    graph = play_graph(env, FakeAgentsGenerate(tokenizer, {"X=": ["1"]}), renderer)
    assert graph.failed and "wait on each other (waiting: a)" in graph.error


def test_agents_that_all_ended_without_the_episode_closed_end_it_errored(tokenizer, renderer):
    env = Scripted({"a": "X="}, {"a": [GraphStep({"a": "Z="})]})
    env.seats = (Seat("a", max_turns=1), Seat("b"))  # a reads Z= and has no turn left; no agent_ended
    graph = play_graph(env, FakeAgentsGenerate(tokenizer, {"X=": ["1"]}), renderer)
    assert graph.failed and "every agent has ended (a: truncated_turns)" in graph.error


def test_a_close_without_a_reward_for_an_agent_that_spoke_ends_the_episode_errored(tokenizer, renderer):
    env = Scripted({"a": "X=", "b": "Y="}, {"a": [GraphStep()], "b": [GraphStep(done=True, rewards={"a": 1.0})]})
    graph = play_graph(env, FakeAgentsGenerate(tokenizer, {"X=": ["1"], "Y=": ["2"]}), renderer)
    assert graph.failed and "without a reward for b" in graph.error


def test_an_observation_for_an_agent_that_has_ended_is_refused(tokenizer, renderer):
    # a ends on its one turn (it reads Z= with no turn left); b's step then speaks to it.
    env = Scripted({"a": "X=", "b": "Y="}, {"a": [GraphStep({"a": "Z="})], "b": [GraphStep({"a": "W="})]})
    env.seats = (Seat("a", max_turns=1), Seat("b"))
    generate = FakeAgentsGenerate(tokenizer, {"X=": ["1"], "Y=": ["2"]}, hold={"Y=": 1})
    graph = play_graph(env, generate, renderer)
    assert graph.failed and "addressed agent 'a', which has ended (truncated_turns" in graph.error


def test_a_seat_whose_turn_is_never_sampled_times_out_and_the_episode_is_counted(tokenizer, renderer):
    class Slow(ProposerSolverEnv):
        seats = (Seat("proposer"), Seat("solver", baseline="episode", turn_timeout_s=0.2))

    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"]}, hang_on="M37=")
    graph = play_graph(Slow(num_solvers=2), generate, renderer)
    assert graph.failed and "turn_timeout_s (0.2 s)" in graph.error
    assert {t.status for t in graph.agents.values()} == {TrajectoryStatus.ENV_TIMEOUT}


@pytest.mark.parametrize(
    "seats,message",
    [((), "non-empty tuple"), (("proposer",), "not a forge_rl.envs.graph.Seat"), ((Seat("a"), Seat("a")), "twice")],
)
def test_a_malformed_seat_declaration_is_refused_before_any_episode(seats, message):
    class Declares:
        pass

    env = Declares()
    env.seats = seats
    with pytest.raises(ConfigError, match=message):
        declared_seats(env)


def test_seat_names_and_graph_steps_are_checked_where_they_are_made():
    with pytest.raises(ConfigError, match="hold no '/'"):
        Seat("solver/0")
    with pytest.raises(ValueError, match="Set both or neither"):
        GraphStep(done=True)
    with pytest.raises(ValueError, match="finite"):
        GraphStep(done=True, rewards={"a": float("nan")})


def test_the_multi_agent_environment_of_the_docs_runs(capsys):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "environments.md").read_text()
    code = next(block.split("```")[0] for block in page.split("```python\n")[1:] if "class Echo" in block)
    exec(compile(code, "docs/environments.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out == "{'speaker': 1.0, 'listener': 1.0}\n[('speaker', ()), ('listener', (0,))]\n"


def test_a_chain_of_roles_hands_each_answer_to_the_next_and_rewards_the_team_at_the_end(tokenizer, renderer):
    from forge_rl.envs.long_tail import ChainEnv, make_chain_env

    generate = FakeAgentsGenerate(tokenizer, {"L37=": ["7"], "7L37=": ["3"], "3L37=": ["7"]})
    graph = play_graph(ChainEnv(3, 7, [0.0, 0.0, 0.0]), generate, renderer)
    assert list(graph.agents) == ["role0", "role1", "role2"]
    assert [(n.agent, n.shown) for n in graph.nodes] == [("role0", ()), ("role1", (0,)), ("role2", (1,))]
    assert {t.final_reward for t in graph.agents.values()} == {1.0}  # the last role's answer is right
    chain = make_chain_env(seed=0, index=5, depth=3)
    assert len(chain.seats) == 3 and all(0.02 <= s <= 2.0 for s in chain.step_latencies_s)
    assert chain.step_latencies_s == make_chain_env(seed=0, index=5, depth=3).step_latencies_s  # per (seed, index)


def test_a_multi_agent_group_round_trips_through_a_checkpoint_with_its_agents_and_baselines(tokenizer, renderer):
    generate = FakeAgentsGenerate(tokenizer, {"P=": ["37"], "M37=": ["7", "3"]})
    graphs = asyncio.run(play_group([ProposerSolverEnv(num_solvers=2)], generate, renderer, episode_limits()))
    episode = Episode(4, "P=", "", [], group_completions(graphs))
    restored = Episode.from_dict(episode.to_dict())
    assert [(c.agent, c.baseline_group) for c in restored.completions] == [
        (c.agent, c.baseline_group) for c in episode.completions
    ]
    assert episode_advantages(restored, normalize_std=True) == episode_advantages(episode, normalize_std=True)
