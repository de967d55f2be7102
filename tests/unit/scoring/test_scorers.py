"""The scorer interface: hooks, failures counted never raised, composition, process rewards placed
on exactly their steps' tokens."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from forge_rl.core.advantages import episode_advantages, place_on_steps, returns_to_go, token_advantages
from forge_rl.core.batching import make_train_batch
from forge_rl.errors import ScorerLost
from forge_rl.observability.metrics import batch_metrics
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import Score, ScoreFailure, Scorer, WeightedSum, boundary_token_ids, step_ends
from forge_rl.types import Completion, CompletionStatus, Episode
from tests.support.builders import make_episode

NEWLINE = 3
"""Token id of "\\n" in these fabricated completions."""


class FakeLengthScorer(Scorer):
    """A fake per-completion scorer: reward = number of tokens, with a component; fails on request."""

    name = "length"

    def __init__(self, fail_on: dict[int, object] | None = None):
        self.fail_on = fail_on or {}

    async def score_completion(self, episode: Episode, completion: Completion) -> Score | ScoreFailure:
        outcome = self.fail_on.get(completion.num_tokens)
        if isinstance(outcome, Exception):
            raise outcome
        if outcome is not None:
            return outcome
        return Score(float(completion.num_tokens), components={"tokens": float(completion.num_tokens)})


class FakeRankingJudge(Scorer):
    """A fake group judge: ranks the group's completions by length, the shortest best (1.0 ... 0.0)."""

    name = "judge"

    async def score_group(self, episode: Episode) -> list[Score]:
        order = sorted(range(len(episode.completions)), key=lambda i: episode.completions[i].num_tokens)
        worst = max(len(order) - 1, 1)
        return [Score(1.0 - order.index(i) / worst) for i in range(len(order))]


class FakeLineGrader(Scorer):
    """A fake process reward model: one step per line, each step's reward is its index + 1 (so
    every step's reward is distinct), outcome reward 0."""

    name = "lines"

    async def score_completion(self, episode: Episode, completion: Completion) -> Score:
        ends = step_ends(completion.token_ids, {NEWLINE})
        return Score(0.0, step_ends=tuple(ends), step_rewards=tuple(float(k + 1) for k in range(len(ends))))


def group(*lengths: int, answer: str = "7") -> Episode:
    completions = [Completion(token_ids=[5] * n, logprobs=[-1.0] * n, policy_versions=[0] * n) for n in lengths]
    return Episode(0, "M37=", answer, [1, 2], completions)


def run_stage(scorer: Scorer, episodes: list[Episode], **kwargs) -> tuple[list[Episode], dict]:
    stage = ScoreWriter(scorer, **kwargs)
    scored = asyncio.run(stage.score(episodes))
    return scored, stage.stats()


def test_a_per_completion_scorer_sets_rewards_and_components_that_reach_the_step_metrics():
    (episode,), stats = run_stage(FakeLengthScorer(), [group(2, 3)])
    assert episode.rewards == [2.0, 3.0]
    assert [c.reward_components for c in episode.completions] == [{"tokens": 2.0}, {"tokens": 3.0}]
    assert batch_metrics([episode], 0)["reward/components/tokens"] == 2.5
    assert stats["scorer/completions"] == 2 and stats["scorer/errored"] == 0


def test_a_group_judge_sees_the_whole_group():
    (episode,), _ = run_stage(FakeRankingJudge(), [group(4, 1, 2)])
    assert episode.rewards == [0.0, 1.0, 0.5]


@pytest.mark.parametrize(
    "outcome, error",
    [
        (ValueError("judge parse bug"), "ValueError: judge parse bug"),
        (ScoreFailure("reward model timed out", "timeout"), "reward model timed out"),
        (Score(math.nan), "non-finite reward (nan, or in its parts): a reward must be finite"),
        (Score(1.0, step_ends=(1,), step_rewards=(1.0,)), "malformed score: step_ends ([1]) must increase"),
    ],
    ids=["raises", "failure", "nan", "steps_not_covering_the_tokens"],
)
def test_every_scorer_failure_errors_that_completion_only_and_is_counted(outcome, error):
    (episode,), stats = run_stage(FakeLengthScorer(fail_on={3: outcome}), [group(2, 3)])
    ok, failed = episode.completions
    assert ok.status == CompletionStatus.OK and ok.reward == 2.0
    assert failed.status == CompletionStatus.ERRORED and failed.error.startswith(error)
    assert stats["scorer/errored"] == 1
    assert stats["scorer/timed_out"] == (error == "reward model timed out")


def test_a_scorer_that_raises_in_its_group_hook_errors_the_group_and_the_run_goes_on():
    class Broken(Scorer):
        async def score_group(self, episode):
            raise RuntimeError("reward model mesh is gone")

    episodes, stats = run_stage(Broken(), [group(1, 2), group(3)])
    assert all(c.status == CompletionStatus.ERRORED for e in episodes for c in e.completions)
    assert episodes[0].completions[0].error == "RuntimeError: reward model mesh is gone"
    assert stats["scorer/errored"] == 3


class FakeDeadModel(Scorer):
    """A fake model-backed scorer whose model's process died: each call raises ScorerLost."""

    name = "reward_model"

    async def score_completion(self, episode, completion):
        raise ScorerLost("the reward model's process died")


class FakeDeadGroupModel(FakeDeadModel):
    async def score_group(self, episode):
        raise ScorerLost("the reward model's process died")


@pytest.mark.parametrize("dead", [FakeDeadModel, FakeDeadGroupModel], ids=["per_completion", "per_group"])
def test_a_model_whose_process_died_loses_the_call_instead_of_erroring_its_completions(dead):
    """ScorerLost goes up through a weighted sum and the stage: the scorer's supervisor scores the
    episodes again after a restart (forge_rl/scoring/restarts.py), so none is ERRORED or counted."""
    stage = ScoreWriter(WeightedSum([(FakeLengthScorer(), 1.0), (dead(), 1.0)]))
    episodes = [group(1, 2)]
    with pytest.raises(ScorerLost, match="reward model's process died"):
        asyncio.run(stage.score(episodes))
    assert all(c.status == CompletionStatus.OK for c in episodes[0].completions)
    assert stage.stats()["scorer/completions"] == 0 and stage.stats()["scorer/errored"] == 0


def test_a_weighted_sum_adds_weighted_rewards_and_keeps_each_scorers_reward_and_errors():
    scorer = WeightedSum([(FakeLengthScorer(fail_on={5: ValueError("boom")}), 0.5), (FakeRankingJudge(), 2.0)])
    (episode,), stats = run_stage(scorer, [group(2, 4, 5)])
    short, long, failed = episode.completions
    assert short.reward == pytest.approx(0.5 * 2 + 2.0 * 1.0)
    assert long.reward == pytest.approx(0.5 * 4 + 2.0 * 0.5)
    assert long.reward_components == {"length": 4.0, "length/tokens": 4.0, "judge": 0.5}
    assert failed.status == CompletionStatus.ERRORED and failed.error == "length: ValueError: boom"
    assert stats["scorer/length/errored"] == 1 and stats["scorer/judge/errored"] == 0


def test_scorer_names_must_be_unique_in_a_sum():
    with pytest.raises(ValueError, match="unique"):
        WeightedSum([(FakeLengthScorer(), 1.0), (FakeLengthScorer(), 1.0)])


def test_the_overlong_penalty_applies_on_top_of_the_score():
    (episode,), stats = run_stage(FakeLengthScorer(), [group(2, 4)], overlong_buffer=2, max_new_tokens=4)
    assert episode.rewards == [2.0, 4.0 - 1.0]
    assert stats["scorer/overlong_penalized"] == 1


def test_steps_end_after_each_boundary_token_and_at_the_end():
    assert step_ends([5, 3, 5, 5, 3, 5], {3}) == [2, 5, 6]
    assert step_ends([5, 3, 5, 3], {3}) == [2, 4]  # a trailing delimiter ends the last step
    assert step_ends([5, 5], {3}) == [2]
    assert step_ends([], {3}) == []


def test_boundary_tokens_are_every_token_whose_text_holds_the_delimiter():
    vocabulary = {0: "a", 1: "\n", 2: ".\n", 3: "\n\n", 4: "b"}
    assert boundary_token_ids(vocabulary, "\n") == {1, 2, 3}
    with pytest.raises(ValueError, match="non-empty"):
        boundary_token_ids(vocabulary, "")


def test_each_steps_reward_reaches_exactly_that_steps_tokens():
    """Three lines (steps) of 2, 3 and 1 tokens; the grader gives them 1, 2, 3. With step_discount
    0 and equal outcome rewards (group advantage 0), the advantage of every token is its own
    step's normalized reward: the group's steps are [1, 2, 3] and [1, 2] (mean 1.8, std 0.748)."""
    lines = [5, NEWLINE, 5, 5, NEWLINE, 5]
    two_lines = [5, NEWLINE, 5]
    completions = [
        Completion(token_ids=t, logprobs=[-1.0] * len(t), policy_versions=[0] * len(t)) for t in (lines, two_lines)
    ]
    (episode,), _ = run_stage(FakeLineGrader(), [Episode(0, "p", "a", [1, 2], completions)])
    assert episode.completions[0].step_ends == [2, 5, 6]
    assert episode.completions[0].step_rewards == [1.0, 2.0, 3.0]

    batch = make_train_batch([episode], pad_id=0, step_discount=0.0)
    mean, std = 1.8, math.sqrt(((1 - 1.8) ** 2 * 2 + (2 - 1.8) ** 2 * 2 + (3 - 1.8) ** 2) / 5)
    step = [(r - mean) / (std + 1e-6) for r in (1.0, 2.0, 3.0)]
    prompt = [0.0, 0.0]
    assert batch.advantages_NL[0].tolist() == pytest.approx(prompt + [step[0]] * 2 + [step[1]] * 3 + [step[2]])
    assert batch.advantages_NL[1].tolist() == pytest.approx(prompt + [step[0]] * 2 + [step[1]] + [0.0] * 3)


def test_with_discount_one_a_token_is_credited_with_its_step_and_every_later_one():
    """DeepSeekMath's process supervision: A_t = sum of the normalized rewards of steps k >= k(t)."""
    completion = Completion(
        token_ids=[5, 5, 5], logprobs=[-1.0] * 3, policy_versions=[0] * 3, step_ends=[1, 3], step_rewards=[0.0, 1.0]
    )
    other = Completion(
        token_ids=[5, 5], logprobs=[-1.0] * 2, policy_versions=[0] * 2, step_ends=[2], step_rewards=[0.5]
    )
    episode = Episode(0, "p", "a", [1], [completion, other])
    (first, second) = token_advantages(episode, normalize_std=False, step_discount=1.0)
    # steps of the group: 0, 1, 0.5 (mean 0.5): centered -0.5, 0.5, 0.0
    assert first == pytest.approx([-0.5 + 0.5, 0.5, 0.5])
    assert second == pytest.approx([0.0, 0.0])


def test_token_rewards_add_to_the_group_advantage_of_their_token():
    episode = make_episode(rewards=(1.0, 0.0), num_tokens=2)
    episode.completions[0].token_rewards = [0.25, -0.5]
    first, second = token_advantages(episode, normalize_std=False)
    assert first == pytest.approx([0.5 + 0.25, 0.5 - 0.5])
    assert second == pytest.approx([-0.5, -0.5])


def test_errored_completions_and_their_steps_stay_out_of_the_statistics():
    episode = make_episode(rewards=(1.0, 0.0), num_tokens=2)
    episode.completions[0].step_ends, episode.completions[0].step_rewards = [2], [100.0]
    episode.completions[0].status = CompletionStatus.ERRORED
    episode.completions[1].step_ends, episode.completions[1].step_rewards = [1, 2], [1.0, 0.0]
    errored, usable = token_advantages(episode, normalize_std=False, step_discount=0.0)
    assert errored == [0.0, 0.0]
    assert usable == pytest.approx([0.5, -0.5])


def test_without_step_or_token_rewards_every_token_carries_the_group_advantage():
    episode = make_episode(rewards=(1.0, 0.0, 0.5), num_tokens=3)
    per_token = token_advantages(episode, normalize_std=True)
    assert per_token == [[a] * 3 for a in episode_advantages(episode, normalize_std=True)]


def test_returns_to_go_and_placement():
    assert returns_to_go([1.0, 2.0, 3.0], 0.5) == [1.0 + 0.5 * (2.0 + 0.5 * 3.0), 2.0 + 1.5, 3.0]
    assert returns_to_go([1.0, 2.0], 0.0) == [1.0, 2.0]
    assert place_on_steps([1, 3], [7.0, 8.0]) == [7.0, 8.0, 8.0]


def test_steps_that_do_not_cover_a_completion_are_refused_when_built():
    with pytest.raises(ValueError, match="every token belongs to exactly one step"):
        Completion(token_ids=[5, 5], logprobs=[-1.0] * 2, policy_versions=[0] * 2, step_ends=[1], step_rewards=[1.0])
    with pytest.raises(ValueError, match="one reward per step"):
        Completion(token_ids=[5, 5], logprobs=[-1.0] * 2, policy_versions=[0] * 2, step_ends=[1, 2], step_rewards=[1.0])


# The docs ----------------------------------------------------------------------------------------


def scoring_doc_examples() -> list[str]:
    """docs/scoring.md's complete examples: the python blocks that run something (asyncio.run)."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "scoring.md").read_text()
    return [block.split("```")[0] for block in page.split("```python\n")[1:] if "asyncio.run(" in block.split("```")[0]]


@pytest.mark.parametrize("index", range(3), ids=["scorer_class", "judge", "teacher"])
def test_the_examples_of_the_scoring_docs_print_what_they_say(index, capsys):
    """Each example ends with the output it prints as comments; it runs as written and prints that."""
    examples = scoring_doc_examples()
    assert len(examples) == 3
    lines = examples[index].rstrip().splitlines()
    expected = []
    while lines and lines[-1].startswith("# "):
        expected.insert(0, lines.pop()[2:])
    exec(compile("\n".join(lines), "docs/scoring.md", "exec"), {"__name__": "docs_example"})
    printed = " ".join(capsys.readouterr().out.split())
    assert expected and " ".join(" ".join(expected).split()) in printed
