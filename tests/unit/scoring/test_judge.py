"""LLM-as-judge (forge_rl/scoring/judge.py, `JudgeScorer` in forge_rl/scoring/scorers.py) against a fake judge
engine: verdict parsing, unparsable verdicts and timeouts counted and excluded, never a crash."""

import asyncio
from pathlib import Path

import pytest

from forge_rl.scoring.judge import JudgeConfig, judge_client, parse_ranking, parse_verdict
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import JudgeScorer, WeightedSum
from forge_rl.types import Completion, CompletionStatus, Episode
from tests.unit.scoring.test_teacher import FakeOutcome

PATTERN = JudgeConfig().verdict_pattern


@pytest.mark.parametrize(
    "verdict,reward",
    [
        ("Score: 7", 0.7),
        ("score=10", 1.0),
        ("The scale is Score: 0 to Score: 10. I think it is right.\nScore: 8", 0.8),  # the last one counts
        ("SCORE : 2.5", 0.25),
        ("Score: 11", None),  # out of range
        ("Score: -1", None),
        ("I cannot tell.", None),
        ("", None),
    ],
)
def test_the_last_score_in_range_is_the_verdict(verdict, reward):
    parsed = parse_verdict(verdict, PATTERN, 0.0, 10.0)
    assert parsed == (None if reward is None else pytest.approx(reward))


def test_a_custom_pattern_and_scale():
    assert parse_verdict("VERDICT [[B]] rating 4/5", r"rating (\d)/5", 1, 5) == pytest.approx(0.75)


class FakeJudgeEngine:
    """A fake of the judge's GeneratorActor `generate`: answers from a script keyed by the graded
    completion's text (found in the rendered prompt); "HANG" never answers."""

    def __init__(self, script: dict[str, str]):
        self.script = script
        self.prompts: list[str] = []
        self.never = asyncio.Event()

    async def generate(self, episodes, group_size):
        (episode,) = episodes
        assert group_size == 1
        self.prompts.append(episode.prompt_text)
        answer = next(v for k, v in self.script.items() if f"Answer to grade: {k}\n" in episode.prompt_text)
        if answer == "HANG":
            await self.never.wait()  # never set: only the judge's timeout ends this call
        episode.completions = [Completion(token_ids=[1], logprobs=[0.0], policy_versions=[0], text=answer)]
        return [episode]


class FakeTokenizer:
    def encode_prompt(self, text):
        return [ord(c) % 50 for c in text]

    def encode_chat(self, messages):
        return self.encode_prompt(messages[0]["content"])


def group(*texts):
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=t) for t in texts]
    return Episode(0, "M37=", "7", [1, 2], completions)


def test_unparsable_verdicts_and_timeouts_are_counted_and_excluded_never_a_crash():
    engine = FakeJudgeEngine({"7": "Correct. Score: 10", "3": "Wrong. Score: 0", "X": "hmm, no idea", "K": "HANG"})
    config = JudgeConfig(timeout_s=0.05)
    scorer = JudgeScorer(config, judge_client(FakeTokenizer(), "chat", engine.generate))
    stage = ScoreWriter(scorer)
    (episode,) = asyncio.run(stage.score([group("7", "3", "X", "K")]))

    assert [c.status for c in episode.completions] == [CompletionStatus.OK] * 2 + [CompletionStatus.ERRORED] * 2
    assert [c.reward for c in episode.completions[:2]] == [1.0, 0.0]
    assert "unparsable verdict 'hmm, no idea'" in episode.completions[2].error
    assert "timeout_s" in episode.completions[3].error
    stats = stage.stats()
    assert stats["scorer/errored"] == 2 and stats["scorer/timed_out"] == 1
    assert (stats["scorer/verdicts"], stats["scorer/unparsable"]) == (3, 1)
    # The judge read the template with the episode's prompt, reference answer and the completion.
    assert "Question: M37=\nReference answer: 7\nAnswer to grade: 7\n" in engine.prompts[0]


def test_a_judge_composes_with_the_task_reward_and_its_counters_are_its_own():
    engine = FakeJudgeEngine({"7": "Score: 5", "3": "garbage"})
    judge = JudgeScorer(JudgeConfig(prompt_format="plain"), judge_client(FakeTokenizer(), "plain", engine.generate))
    stage = ScoreWriter(WeightedSum([(FakeOutcome([1.0, 0.0]), 1.0), (judge, 0.5)]))
    (episode,) = asyncio.run(stage.score([group("7", "3")]))
    assert episode.completions[0].reward == pytest.approx(1.0 + 0.5 * 0.5)
    assert episode.completions[0].reward_components["judge"] == pytest.approx(0.5)
    assert episode.completions[1].status == CompletionStatus.ERRORED  # a partial sum is not the reward
    assert stage.stats()["scorer/judge/unparsable"] == 1 and stage.stats()["scorer/judge/errored"] == 1


def test_a_judge_that_raises_fails_its_completions_only():
    async def dead(episodes, group_size):
        raise ConnectionError("judge process died")

    stage = ScoreWriter(JudgeScorer(JudgeConfig(), judge_client(FakeTokenizer(), "chat", dead)))
    (episode,) = asyncio.run(stage.score([group("7", "3")]))
    assert [c.status for c in episode.completions] == [CompletionStatus.ERRORED] * 2
    assert "judge process died" in episode.completions[0].error


def test_a_judge_whose_vllm_engine_died_loses_the_scoring_call_instead_of_erroring_its_completions():
    """The judge's actor alive and its engine dead (killed for memory, say): the actor answers every
    call in flight with vLLM's EngineDeadError, often before the supervisor's poll sees the engine's
    pids gone. The scorer actor's judge client (forge_rl/actors/scorer.py) must turn that into
    ScorerLost, so the supervisor judges the episodes again on a replacement: the death is not the
    completions' failure. Any other error of the call stays theirs."""
    from forge_rl.actors.scorer import _lost_if_dead
    from forge_rl.errors import ScorerLost

    class EngineDeadError(RuntimeError):
        """A fake of vllm.v1.engine.exceptions.EngineDeadError, matched by name as the pool does."""

    async def engine_dead(episodes, group_size):
        raise EngineDeadError("EngineCore encountered an issue. See stack trace for the root cause.")

    async def prompt_too_long(episodes, group_size):
        raise ValueError("prompt longer than scorer.judge.max_model_len")

    def stage(generate):
        client = judge_client(FakeTokenizer(), "plain", _lost_if_dead(generate, "judge"))
        return ScoreWriter(JudgeScorer(JudgeConfig(prompt_format="plain"), client))

    lost = stage(engine_dead)
    with pytest.raises(ScorerLost, match="the judge's vLLM engine died"):
        asyncio.run(lost.score([group("7", "3")]))
    assert lost.stats()["scorer/errored"] == 0
    (episode,) = asyncio.run(stage(prompt_too_long).score([group("7", "3")]))
    assert [c.status for c in episode.completions] == [CompletionStatus.ERRORED] * 2


RANKING = JudgeConfig().ranking_pattern


@pytest.mark.parametrize(
    "verdict,rewards",
    [
        ("Ranking: 2 > 3 > 1", [0.0, 1.0, 0.5]),
        ("ranking=1>2>3", [1.0, 0.5, 0.0]),
        # The last ranking counts: a judge that reasons first may quote the format's example.
        ("Format is 'Ranking: 2 > 1 > 3'. Answer 3 is right.\nRanking: 3 > 1 > 2", [0.5, 0.0, 1.0]),
        ("Ranking: 2 > 1", None),  # one answer left out: the group is not ranked
        ("Ranking: 2 > 2 > 1", None),  # one answer twice
        ("Ranking: 4 > 2 > 1", None),  # no answer 4
        ("All three are wrong.", None),
    ],
)
def test_a_ranking_is_a_permutation_of_the_group_best_first(verdict, rewards):
    assert parse_ranking(verdict, RANKING, 3) == rewards


class FakeRankingJudgeEngine:
    """A fake of the judge's GeneratorActor `generate` for mode rank: answers each group prompt with
    `answer(prompt)`; records what it read."""

    def __init__(self, answer):
        self.answer = answer
        self.prompts: list[str] = []

    async def generate(self, episodes, group_size):
        (episode,) = episodes
        self.prompts.append(episode.prompt_text)
        text = await self.answer(episode.prompt_text)
        episode.completions = [Completion(token_ids=[1], logprobs=[0.0], policy_versions=[0], text=text)]
        return [episode]


def test_a_ranking_judge_reads_the_whole_group_once_and_its_order_becomes_the_rewards():
    async def answer(prompt):  # ranks the answers that say 7 above the others
        return "Ranking: 2 > 3 > 1"

    engine = FakeRankingJudgeEngine(answer)
    stage = ScoreWriter(JudgeScorer(JudgeConfig(mode="rank"), judge_client(FakeTokenizer(), "chat", engine.generate)))
    (episode,) = asyncio.run(stage.score([group("3", "7", "7.0")]))
    assert [c.reward for c in episode.completions] == [0.0, 1.0, 0.5]
    assert len(engine.prompts) == 1  # one verdict for the group, not one per completion
    assert "Question: M37=\nReference answer: 7\nAnswers:\n[1] 3\n[2] 7\n[3] 7.0\n" in engine.prompts[0]
    assert stage.stats()["scorer/verdicts"] == 1


def test_an_unparsable_or_late_ranking_fails_its_group_only_counted_never_a_crash():
    never = asyncio.Event()

    async def answer(prompt):
        if "[1] late" in prompt:
            await never.wait()  # never set: only the judge's timeout ends this call
        return "Ranking: 1 > 2" if "[1] ok" in prompt else "They are all fine."

    engine = FakeRankingJudgeEngine(answer)
    scorer = JudgeScorer(
        JudgeConfig(mode="rank", timeout_s=0.05), judge_client(FakeTokenizer(), "chat", engine.generate)
    )
    stage = ScoreWriter(scorer)
    ok, garbled, late = asyncio.run(stage.score([group("ok", "b"), group("garbled", "b"), group("late", "b")]))
    assert [c.reward for c in ok.completions] == [1.0, 0.0]
    assert all(c.status == CompletionStatus.ERRORED for c in garbled.completions + late.completions)
    assert "unparsable ranking 'They are all fine.'" in garbled.completions[0].error
    assert "timeout_s" in late.completions[0].error
    stats = stage.stats()
    assert (stats["scorer/verdicts"], stats["scorer/unparsable"], stats["scorer/timed_out"]) == (2, 1, 1)
    assert stats["scorer/errored"] == 4


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"verdict_pattern": "Score: \\d+"}, "has no group"),
        ({"verdict_pattern": "Score: (\\d+"}, "not a regular expression"),
        ({"template": "Grade {prompt}"}, "lacks {completion}"),
        ({"template": "Grade {completion} {reasoning}"}, "placeholder other than"),
        ({"score_min": 10.0, "score_max": 0.0}, "must be below score_max"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"ranking_pattern": "Ranking: [0-9> ]+"}, "ranking_pattern .* has no group"),
        ({"rank_template": "Rank the answers to {prompt}"}, "rank_template lacks {completions}"),
        ({"rank_template": "Rank {completions} by {criterion}"}, "rank_template has a placeholder other than"),
    ],
)
def test_bad_judge_settings_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        JudgeConfig(**changes)


def test_a_judge_directory_that_is_not_a_model_or_lacks_a_chat_template_is_a_config_error(tmp_path):
    from forge_rl.config import GRPOConfig, ModelConfig
    from forge_rl.errors import ConfigError
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
    from forge_rl.run.preflight import check_model_inputs
    from forge_rl.scoring.scorers import ScorerConfig

    with pytest.raises(ConfigError, match=r"scorer.judge.path.*lacks config.json"):
        GRPOConfig(scorer=ScorerConfig(judge=JudgeConfig(path=tmp_path / "no-such-judge")))
    tiny = create_tiny_model(TinyModelConfig(), tmp_path / "tiny")  # a character tokenizer, no chat template
    with pytest.raises(ConfigError, match=r"scorer.judge.max_model_len \(2048\) exceeds the judge's context.*128"):
        GRPOConfig(scorer=ScorerConfig(judge=JudgeConfig(path=tiny)))

    def with_judge(**changes):
        judge = JudgeConfig(path=tiny, max_model_len=128, **changes)
        return GRPOConfig(model=ModelConfig(path=tiny), scorer=ScorerConfig(judge=judge))

    with pytest.raises(ConfigError, match="scorer.judge.prompt_format is chat, but the judge .* has no chat template"):
        check_model_inputs(with_judge(), tiny)
    check_model_inputs(with_judge(prompt_format="plain"), tiny)


def test_judge_replicas_are_checked_and_each_counts_its_engines_threads():
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.scoring.scorers import ScorerConfig

    with pytest.raises(ValueError, match=r"scorer.judge.replicas \(0\) must be >= 1. Set --scorer.judge.replicas"):
        JudgeConfig(replicas=0)
    config = ScorerConfig(judge=JudgeConfig(path=Path("judge"), replicas=3, generator=GeneratorConfig(cpu_threads=2)))
    assert config.model_threads() == {"scorer.judge.replicas (3) x scorer.judge.generator.cpu_threads (2)": 6}
