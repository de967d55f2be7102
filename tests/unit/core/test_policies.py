"""Several policies in one run (forge_rl/core/policies.py): the config that names them and is refused
before anything starts, the seats each one plays, the part of a batch each one trains, and the
buffer holding each completion to its own policy's age bound against its own version."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig, ReplayBuffer
from forge_rl.core.policies import MAIN_POLICY, Policies, PolicyConfig, episodes_of_policy
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.runner import run_graph
from forge_rl.envs.selfplay import ProposerSolverEnv
from forge_rl.errors import ConfigError
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.types import Completion, Episode
from forge_rl.yaml_config import load_yaml_config
from tests.support.helpers import episode_limits
from tests.support.workers import REPO
from tests.unit.envs.test_episode_graphs import FakeAgentsGenerate

TWO_POLICIES = REPO / "configs/selfplay_two_policies_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def two_policies() -> GRPOConfig:
    return load_yaml_config(GRPOConfig, TWO_POLICIES)


def test_the_two_policy_config_names_the_solver_seat_and_its_own_age_bound(two_policies):
    (solver,) = two_policies.policies
    assert (solver.name, solver.seats, solver.max_policy_age) == ("solver", ("solver",), 2)
    policies = two_policies.run_policies
    assert policies.names == [MAIN_POLICY, "solver"]
    assert policies.of_agent("solver/3") == "solver" and policies.of_agent("proposer") is None
    assert policies.max_ages == {None: 1, "solver": 2}
    assert two_policies.policy_trainer_config(solver) == two_policies.trainer  # lr unset: the run's
    faster = dataclasses.replace(solver, lr=1e-3)
    assert two_policies.policy_trainer_config(faster).lr == 1e-3


@pytest.mark.parametrize(
    "policy, message",
    [
        (dict(name="main", seats=("solver",)), "not 'main'"),
        (dict(name="Solver", seats=("solver",)), "lower-case letters"),
        (dict(name="solver", seats=()), "seats is empty"),
        (dict(name="solver", seats=("solver",), max_policy_age=-1), "must be >= 0"),
        (dict(name="solver", seats=("solver",), lr=0.0), "must be > 0"),
        (dict(name="solver", seats=("solver",), num_generators=0), "must be >= 1"),
    ],
)
def test_a_malformed_policy_is_refused_naming_the_field_and_the_fix(policy, message):
    with pytest.raises(ConfigError, match=message):
        PolicyConfig(**policy)


def test_two_policies_of_one_name_or_one_seat_are_refused():
    with pytest.raises(ConfigError, match=r"\['solver'\] named more than once"):
        Policies([PolicyConfig("solver", ("solver",)), PolicyConfig("solver", ("proposer",))], 1)
    with pytest.raises(ConfigError, match="seat 'solver' is named by both 'a' and 'b'"):
        Policies([PolicyConfig("a", ("solver",)), PolicyConfig("b", ("solver",))], 1)


def test_a_seat_the_environment_lacks_or_declares_untrainable_is_refused_before_the_run(two_policies):
    with pytest.raises(ConfigError, match=r"names \['solvr'\], which environment 'selfplay' does not declare"):
        dataclasses.replace(two_policies, policies=(PolicyConfig("solver", ("solvr",)),))
    policies = Policies([PolicyConfig("user", ("user",))], 1)
    with pytest.raises(ConfigError, match="declares untrainable"):
        policies.check_seats({"assistant": True, "user": False}, "user_sim")


def test_what_knows_one_policy_only_is_refused_with_several(two_policies):
    with pytest.raises(ConfigError, match="no environment.name"):
        dataclasses.replace(two_policies, environment=dataclasses.replace(two_policies.environment, name=None))
    simulated = dict(
        generator=dataclasses.replace(two_policies.generator, engine="sim"),
        trainer=dataclasses.replace(two_policies.trainer, engine="sim"),
    )
    with pytest.raises(ConfigError, match=r"policies \(\['solver'\]\) with a simulated engine or trainer"):
        dataclasses.replace(two_policies, **simulated)


def test_an_environment_of_one_agent_is_refused_with_policies(two_policies):
    calculator = dataclasses.replace(two_policies.environment, name="calculator")
    with pytest.raises(ConfigError, match="not a multi-agent environment"):
        dataclasses.replace(two_policies, environment=calculator)


def completion(policy: str | None, versions: list[int], agent: str) -> Completion:
    return Completion(
        [1] * len(versions), [-0.5] * len(versions), versions, agent=agent, policy=policy, baseline_group=agent
    )


def episode(episode_id: int, main_versions: list[int], solver_versions: list[int]) -> Episode:
    return Episode(
        episode_id,
        "P=",
        "",
        [1],
        completions=[completion(None, main_versions, "proposer"), completion("solver", solver_versions, "solver/0")],
    )


def test_each_policy_trains_its_own_completions_of_the_batch():
    batch = [episode(0, [3], [3, 3]), Episode(1, "P=", "", [1], completions=[completion(None, [3], "proposer")])]
    mine = episodes_of_policy(batch, "solver")
    assert [e.episode_id for e in mine] == [0]  # the episode whose proposer wrote no task has no solver
    assert [c.agent for c in mine[0].completions] == ["solver/0"]
    assert [c.agent for e in episodes_of_policy(batch, None) for c in e.completions] == ["proposer", "proposer"]


def test_the_buffer_holds_each_completion_to_its_own_policys_bound():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=0, drop_policy="mask_tokens", admission="drop"), {"solver": 1})
    # At trainer version 5: the proposer's tokens of version 4 are over its bound (0), the
    # solver's of version 4 within its own (1), its tokens of version 3 over it.
    assert buffer.put(episode(0, [5], [4, 4]), trainer_version=5)
    assert buffer.put(episode(1, [4], [4, 3]), trainer_version=5)
    kept = sorted(buffer.sample(2, trainer_version=5), key=lambda e: e.episode_id)
    first, second = ([c.trainable for c in e.completions] for e in kept)
    assert first == [[True], [True, True]]
    assert second == [[False], [True, False]]
    assert buffer.dropped.tokens == 2 and buffer.dropped.completions == 1  # the proposer whole, one solver token


def test_a_policy_a_version_behind_after_a_skipped_step_is_aged_by_its_own_version():
    buffer = ReplayBuffer(BufferConfig(max_policy_age=1), {"solver": 1})
    # The solver's step was skipped once: its trainer is at 4 while the run's own is at 5, so its
    # tokens of version 3 are 1 version old, not 2, and the episode is kept whole.
    buffer.set_policy_offsets({"solver": -1})
    assert buffer.put(episode(0, [4], [3]), trainer_version=5)
    # Caught up again: the same tokens are 2 versions old, and the episode is dropped.
    buffer.set_policy_offsets({"solver": 0})
    assert buffer.sample(1, trainer_version=5) is None
    assert buffer.dropped.episodes == 1


def test_a_seat_played_by_another_policy_is_sampled_by_that_policys_generate(tmp_path):
    save_char_tokenizer(tmp_path)
    tokenizer = PromptTokenizer(tmp_path)
    main = FakeAgentsGenerate(tokenizer, {"P=": ["37"]})
    solver = FakeAgentsGenerate(tokenizer, {"M37=": ["7", "7", "3", "7"]})
    graph = asyncio.run(
        asyncio.wait_for(
            run_graph(
                ProposerSolverEnv(num_solvers=4),
                main,
                PlainTextRenderer(tokenizer),
                episode_limits(),
                {"solver": solver},
            ),
            30,
        )
    )
    assert graph.error is None
    assert main.answers == {"P=": []} and solver.answers == {"M37=": []}  # each sampled its own seat's turns only
    with pytest.raises(ConfigError, match=r"declares no seat \['judge'\]"):
        asyncio.run(
            run_graph(
                ProposerSolverEnv(num_solvers=1),
                main,
                PlainTextRenderer(tokenizer),
                episode_limits(),
                {"judge": solver},
            )
        )
