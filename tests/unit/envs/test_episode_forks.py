"""Episode forks (forge_rl/envs/forks.py, forge_rl/pipeline/branching.py `Brancher.fork`): an
environment episode continued from one of its turns on a fresh environment brought back there by
replay. The environment is the real calculator; turns come from `FakeGenerate` (tests/support/fakes.py),
scripted in the tiny models' char tokenizer."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.core.branches import BranchConfig, fork_completion, pick_turn_pivots, tree_token_advantages, turn_starts
from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.calculator import make_calculator_env
from forge_rl.envs.environment import StepResult
from forge_rl.envs.forks import ReplayDiverged, play_forks, refuse_unless_replayable
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import EnvironmentConfig, group_completions, play_group
from forge_rl.envs.runner import SampledTurn
from forge_rl.errors import ConfigError
from forge_rl.pipeline.branching import Brancher
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.types import Episode
from tests.support.fakes import FakeGenerate
from tests.support.helpers import episode_limits

LIMITS = episode_limits(max_turns=3)
TOKEN_PROB = BranchConfig(rule="token_prob", branches_per_pivot=2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


def turn(tokenizer, text: str, logprob: float = -0.5, version: int = 0) -> SampledTurn:
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [logprob] * len(token_ids), [version] * len(token_ids), "stop")


def calculator_episode(tokenizer, answer: str, call_logprob: float = -0.5, answer_logprob: float = -0.5):
    """Problem 0 of seed 0 played once: the tool call, then `answer`; (the env, its completion)."""
    env = make_calculator_env(0, 0)
    turns = [turn(tokenizer, f"C{env.left}*{env.right}", call_logprob), turn(tokenizer, answer, answer_logprob)]
    (graph,) = asyncio.run(play_group([env], FakeGenerate(turns), PlainTextRenderer(tokenizer), LIMITS))
    return env, group_completions([graph])[0]


def test_a_fork_replays_the_turns_before_its_pivot_and_samples_the_rest(tokenizer):
    env, parent = calculator_episode(tokenizer, "1")
    product = str(env.left * env.right)
    starts = turn_starts(parent)
    assert len(starts) == parent.num_turns == 2 and parent.reward == 0.0
    pivot = starts[1]  # the answer: the call is replayed, the answer sampled afresh
    generate = FakeGenerate([turn(tokenizer, product, version=1), turn(tokenizer, "2", version=1)])
    graphs = asyncio.run(
        play_forks(
            [make_calculator_env(0, 0), make_calculator_env(0, 0)],
            generate,
            parent,
            pivot,
            PlainTextRenderer(tokenizer),
            LIMITS,
        )
    )
    played = group_completions(graphs)
    # The generator was asked for the turn after the pivot only, after exactly the episode's prefix.
    assert [prefix for prefix, _ in generate.calls] == [parent.token_ids[:pivot]] * 2
    forks = [fork_completion(parent, 0, pivot, p) for p in played]
    assert sorted(f.reward for f in forks) == [0.0, 1.0]
    for fork in forks:
        assert fork.token_ids[:pivot] == parent.token_ids[:pivot]
        assert (fork.parent, fork.fork_at) == (0, pivot)
        assert fork.generated[:pivot] == [False] * pivot and all(fork.generated[pivot:])
        assert fork.logprobs[:pivot] == [0.0] * pivot
        assert fork.policy_versions == [1] * fork.num_tokens  # its context carries its first own token's version


def test_a_fork_takes_as_many_turns_of_its_own_as_the_episode_lets_it(tokenizer):
    env = make_calculator_env(0, 0)
    product = str(env.left * env.right)
    turns = [turn(tokenizer, f"C{env.left}*{env.right}"), turn(tokenizer, "?"), turn(tokenizer, "1")]
    (graph,) = asyncio.run(play_group([env], FakeGenerate(turns), PlainTextRenderer(tokenizer), LIMITS))
    parent = group_completions([graph])[0]
    pivot = turn_starts(parent)[1]  # the malformed turn: the fork writes one again, then the answer
    generate = FakeGenerate([turn(tokenizer, "?"), turn(tokenizer, product)])
    (played,) = group_completions(
        asyncio.run(
            play_forks([make_calculator_env(0, 0)], generate, parent, pivot, PlainTextRenderer(tokenizer), LIMITS)
        )
    )
    fork = fork_completion(parent, 0, pivot, played)
    assert (fork.num_turns, fork.reward) == (3, 1.0)
    assert [len(prefix) for prefix, _ in generate.calls][0] == pivot


def test_turn_pivots_are_turn_starts_after_the_first_the_least_likely_turn_first(tokenizer):
    _, parent = calculator_episode(tokenizer, "1", call_logprob=-0.1, answer_logprob=-3.0)
    starts = turn_starts(parent)
    assert pick_turn_pivots(parent, TOKEN_PROB) == [starts[1]]
    assert pick_turn_pivots(parent, BranchConfig(rule="token_prob", threshold=0.01)) == []  # exp(-3) > 0.01
    function_rule = BranchConfig(rule="function", function="tests.unit.envs.test_episode_forks:second_turn")
    assert pick_turn_pivots(parent, function_rule, second_turn) == [starts[1]]
    with pytest.raises(ValueError, match="start no turn but the first"):
        pick_turn_pivots(parent, function_rule, lambda completion, prompt: [starts[1] + 1])


def second_turn(completion, prompt_token_ids):
    return turn_starts(completion)[1:2]


def test_a_group_grows_by_forks_credited_on_the_tree(tokenizer):
    env, parent = calculator_episode(tokenizer, "1", answer_logprob=-3.0)
    product = str(env.left * env.right)
    episode = Episode(0, "p", "", [], [parent])
    brancher = Brancher(TOKEN_PROB)

    async def forks(parent, pivot, n):
        generate = FakeGenerate([turn(tokenizer, product), turn(tokenizer, "2")])
        graphs = await play_forks(
            [make_calculator_env(0, 0) for _ in range(n)], generate, parent, pivot, PlainTextRenderer(tokenizer), LIMITS
        )
        return group_completions(graphs)

    tree = asyncio.run(brancher.fork(episode, forks))
    assert len(tree.completions) == 3 and [c.parent for c in tree.completions] == [None, 0, 0]
    assert (brancher.counts.pivots, brancher.counts.branches, brancher.counts.pivot_errors) == (1, 2, 0)
    assert brancher.counts.branch_tokens == (len(product) + 1) + 2  # the two answers, eos included
    advantages = tree_token_advantages(tree, normalize_std=True, local_weight=1.0)
    right = next(i for i in (1, 2) if tree.completions[i].reward == 1.0)
    pivot = tree.completions[right].fork_at
    # The right answer's tokens win against the wrong ones; the shared call is trained in the parent.
    assert advantages[right][pivot] > 0 > advantages[3 - right][pivot]
    assert advantages[right][:pivot] == [0.0] * pivot


class UnsteadyCalculator:
    """Says it can be replayed, and answers the tool call differently each time."""

    replayable = True

    async def reset(self):
        return "12*34="

    async def step(self, turn_text):
        if turn_text.startswith("C"):
            return StepResult(observation=f"R{random.randrange(10**6)}=")
        return StepResult(done=True, final_reward=0.0)


def test_a_replay_that_reaches_another_state_drops_its_forks_counted_and_warned_once(tokenizer, caplog):
    (graph,) = asyncio.run(
        play_group(
            [UnsteadyCalculator()],
            FakeGenerate([turn(tokenizer, "C12*34"), turn(tokenizer, "408")]),
            PlainTextRenderer(tokenizer),
            LIMITS,
        )
    )
    parent = group_completions([graph])[0]
    brancher = Brancher(TOKEN_PROB)

    async def forks(parent, pivot, n):
        graphs = await play_forks(
            [UnsteadyCalculator() for _ in range(n)],
            FakeGenerate([]),
            parent,
            pivot,
            PlainTextRenderer(tokenizer),
            LIMITS,
        )
        return group_completions(graphs)

    episode = Episode(0, "p", "", [], [parent, parent])
    with caplog.at_level(logging.WARNING):
        tree = asyncio.run(brancher.fork(episode, forks))
    assert tree.completions == episode.completions
    assert (brancher.counts.pivots, brancher.counts.pivot_errors) == (0, 2)
    assert sum("did not" in r.getMessage() or "not the episode's" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ReplayDiverged, match="not the episode's"):
        asyncio.run(
            play_forks(
                [UnsteadyCalculator()],
                FakeGenerate([]),
                parent,
                turn_starts(parent)[1],
                PlainTextRenderer(tokenizer),
                LIMITS,
            )
        )


class StatefulCalculator:
    """Keeps a running total across episodes: it cannot be brought back to a turn."""

    async def reset(self):
        return "1+1="

    async def step(self, turn_text):
        return StepResult(done=True, final_reward=0.0)


def make_stateful(seed: int, index: int) -> StatefulCalculator:
    return StatefulCalculator()


def small(**overrides) -> GRPOConfig:
    return GRPOConfig(
        **{
            "train_batch_size": 8,
            "group_size": 4,
            "generator": GeneratorConfig(max_new_tokens=8),
            "environment": EnvironmentConfig(name="calculator"),
            **overrides,
        }
    )


def test_episode_forks_are_refused_for_environments_that_cannot_restore_their_state():
    assert small(branch=TOKEN_PROB).branch.enabled  # the calculator declares replayable
    with pytest.raises(ConfigError, match=r"StatefulCalculator cannot restore its state.*replayable = True"):
        small(branch=TOKEN_PROB, environment=EnvironmentConfig(name="tests.unit.envs.test_episode_forks:make_stateful"))
    with pytest.raises(
        ConfigError, match=r"branch.rule \(entropy\) with environment.name \('calculator'\).*token_prob or function"
    ):
        small(branch=BranchConfig(rule="entropy"))
    with pytest.raises(ConfigError, match=r"branch.depth \(2\) with environment.name"):
        small(branch=BranchConfig(rule="token_prob", depth=2))
    with pytest.raises(ConfigError, match="cannot restore its state"):
        refuse_unless_replayable(StatefulCalculator(), "x")


def test_the_buffer_bound_counts_every_fork_a_group_can_hold():
    config = small(branch=BranchConfig(rule="token_prob", pivots_per_sample=2, branches_per_pivot=3))
    assert config.max_episode_tokens == 4 * (1 + 6) * config.environment.limits.max_total_tokens
