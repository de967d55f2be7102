"""Rewards that read the row: a reward function gets the completion, the row's answer and the
columns it names (TRL's convention), in the real worker processes; several functions with weights
train on their weighted sum and are logged one by one; math_verify; and the refusals of rewards
the data cannot feed, before anything starts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import datasets
import pytest

from forge_rl.config import GRPOConfig
from forge_rl.data.config import DataConfig
from forge_rl.errors import ConfigError
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.observability.metric_names import REWARD_COMPONENTS, REWARD_MEAN
from forge_rl.observability.metrics import batch_metrics
from forge_rl.run.preflight import check_data
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import RewardFunctionScorer, ScorerConfig, WeightedSum, build_scorer
from forge_rl.tasks import TaskConfig
from forge_rl.tasks.rewards import RewardColumns, math_verify_reward, resolve_reward_fn, reward_columns
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Completion, CompletionStatus, Episode
from tests.support import row_rewards

FAKES = "tests.support.row_rewards"
DIFFICULTY = f"{FAKES}:fake_difficulty_reward"
RAISING_ON_ROW = f"{FAKES}:fake_reward_raising_on_row"


def episode(episode_id: int, columns: dict | None, *texts: str, answer: str = "7") -> Episode:
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=t) for t in texts]
    return Episode(episode_id, "M37=", answer, [1, 2], completions, columns=columns)


def scored(scorer, episodes: list[Episode]) -> tuple[list[Episode], dict]:
    stage = ScoreWriter(scorer)
    try:
        return asyncio.run(stage.score(episodes)), stage.stats()
    finally:
        stage.close()


def test_a_signature_says_which_columns_a_reward_reads():
    assert reward_columns(resolve_reward_fn("exact_match")) == RewardColumns(positional=("completion_text", "answer"))
    assert reward_columns(row_rewards.fake_difficulty_reward).required == ("difficulty",)
    assert reward_columns(row_rewards.fake_hint_reward).optional == ("hint",)
    every = reward_columns(row_rewards.fake_every_column_reward)
    assert every.every
    # A column named like the answer parameter is not passed twice.
    assert every.select({"answer": "7", "difficulty": 2}) == {"difficulty": 2}
    wide = {"difficulty": 3, "solution": "x" * 10_000, "notes": "y" * 10_000}
    assert reward_columns(row_rewards.fake_difficulty_reward).select(wide) == {"difficulty": 3}
    assert reward_columns(row_rewards.fake_hint_reward).select(wide) == {}
    assert reward_columns(resolve_reward_fn("exact_match")).select(wide) == {}
    with pytest.raises(ConfigError, match="positional-only parameter 'difficulty'.*passed by name"):
        resolve_reward_fn(f"{FAKES}:fake_positional_only_reward")


def test_columns_reach_the_reward_function_in_its_worker_process():
    """Only the named column travels: the fake takes no other keyword, so a whole wide row would
    raise in the worker and error the completions."""
    wide = {"difficulty": 3, "solution": "x" * 10_000, "prompt": "M37="}
    scorer = RewardFunctionScorer(DIFFICULTY, ScorerConfig())
    (result,), stats = scored(scorer, [episode(0, wide, "7", "3")])
    assert [c.status for c in result.completions] == [CompletionStatus.OK] * 2, [c.error for c in result.completions]
    assert result.rewards == [3.0, 3.0]
    assert stats["scorer/errored"] == 0


def test_every_column_reaches_a_reward_taking_columns_by_keyword():
    (result,), _ = scored(
        RewardFunctionScorer(f"{FAKES}:fake_every_column_reward", ScorerConfig()),
        [episode(0, {"a": 1, "b": 2, "c": 3}, "7")],
    )
    assert result.rewards == [3.0]


def test_a_reward_that_raises_on_one_row_errors_that_rows_completions_only_and_counts_them():
    episodes = [episode(i, {"row_id": i}, "7", "3") for i in range(3)]
    scored_episodes, stats = scored(RewardFunctionScorer(RAISING_ON_ROW, ScorerConfig()), episodes)
    statuses = [[c.status for c in e.completions] for e in scored_episodes]
    assert statuses == [[CompletionStatus.OK] * 2, [CompletionStatus.ERRORED] * 2, [CompletionStatus.OK] * 2]
    assert scored_episodes[1].completions[0].error == "ValueError: no verdict for row 1"
    assert (stats["scorer/completions"], stats["scorer/errored"]) == (6, 2)
    assert batch_metrics(scored_episodes, train_version=0)["completions/errored"] == 2


def test_several_rewards_train_on_their_weighted_sum_and_each_is_logged_by_name():
    task = TaskConfig(rewards={"exact_match": 1.0, DIFFICULTY: 0.5})
    scorer = build_scorer(ScorerConfig(), task.reward_weights)
    assert isinstance(scorer, WeightedSum)
    (result,), stats = scored(scorer, [episode(0, {"difficulty": 2}, "7", "3")])
    assert result.rewards == [1.0 + 0.5 * 2, 0.0 + 0.5 * 2]
    assert [c.reward_components for c in result.completions] == [
        {"exact_match": 1.0, "fake_difficulty_reward": 2.0},
        {"exact_match": 0.0, "fake_difficulty_reward": 2.0},
    ]
    metrics = batch_metrics([result], train_version=0)
    assert metrics[REWARD_MEAN] == 1.5
    assert metrics[f"{REWARD_COMPONENTS}/exact_match"] == 0.5
    assert metrics[f"{REWARD_COMPONENTS}/fake_difficulty_reward"] == 2.0
    assert stats["scorer/exact_match/errored"] == stats["scorer/fake_difficulty_reward/errored"] == 0


def test_one_reward_is_one_way_to_say_it():
    assert TaskConfig().reward_weights == {"leading_number": 1.0}
    assert TaskConfig(reward="exact_match").reward_weights == {"exact_match": 1.0}
    with pytest.raises(ConfigError, match=r"task.reward \('exact_match'\) and task.rewards .* are both set"):
        TaskConfig(reward="exact_match", rewards={"math_verify": 1.0})
    with pytest.raises(ConfigError, match="two functions called 'exact_match'"):
        TaskConfig(
            rewards={"exact_match": 1.0, "forge_rl.tasks.rewards:exact_match_reward": 1.0, f"{FAKES}:exact_match": 1.0}
        )
    with pytest.raises(ConfigError, match=r"task.rewards\['exact_match'\] \(nan\) must be a finite number"):
        TaskConfig(rewards={"exact_match": float("nan")})
    with pytest.raises(ConfigError, match="task.rewards .* is not a registered reward function.*--task.rewards"):
        TaskConfig(rewards={"exact": 1.0})
    with pytest.raises(ConfigError, match="scores with one. Set --task.reward"):
        TaskConfig(rewards={"exact_match": 1.0, "math_verify": 1.0}).only_reward


@pytest.mark.parametrize(
    "answer,completion,reward",
    [
        ("0.5", "\\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("1/2", "The answer is $\\frac{1}{2}$.", 1.0),
        ("42", "so the total is \\boxed{42}", 1.0),
        ("2", "3", 0.0),
        ("0.5", "no number here", 0.0),
        ("no answer", "0.5", 0.0),
    ],
)
def test_math_verify_compares_answers_as_mathematics(answer, completion, reward):
    assert math_verify_reward(completion, answer) == reward


def test_math_verify_runs_in_the_worker_processes():
    (result,), _ = scored(
        RewardFunctionScorer("math_verify", ScorerConfig()), [episode(0, None, "\\frac{1}{2}", "0.4", answer="0.5")]
    )
    assert result.rewards == [1.0, 0.0]


# Refusals before anything starts: the preflight's check of the data against the rewards.


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer(create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def data_file(tmp_path: Path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"M{i}{9 - i}=", "answer": str(max(i, 9 - i))}) + "\n" for i in range(3))
    )
    return str(path)


def preflight(config: GRPOConfig, tokenizer: PromptTokenizer) -> None:
    check_data(config, tokenizer, config.max_model_len)


def test_a_reward_parameter_the_data_lacks_is_refused_naming_function_parameter_columns_and_fix(tmp_path, tokenizer):
    config = GRPOConfig(
        data=DataConfig(path=data_file(tmp_path), answer_column="answer"), task=TaskConfig(reward=DIFFICULTY)
    )
    with pytest.raises(ConfigError) as error:
        preflight(config, tokenizer)
    message = str(error.value)
    for fragment in (
        f"task.reward '{DIFFICULTY}'",
        "parameter(s) 'difficulty'",
        "its columns are: 'prompt', 'answer'",
        "give them a default (e.g. difficulty=None)",
    ):
        assert fragment in message, message
    # An optional column the data lacks is no refusal: the function runs without it.
    optional = TaskConfig(rewards={"exact_match": 1.0, f"{FAKES}:fake_hint_reward": 0.1})
    preflight(GRPOConfig(data=config.data, task=optional), tokenizer)


def test_a_reward_with_no_answer_column_or_a_missing_one_is_refused_listing_the_columns(tmp_path, tokenizer):
    with pytest.raises(
        ConfigError,
        match=r"task.reward \(math_verify\) compares each completion.*--data.answer-column.*'prompt', 'answer'",
    ):
        preflight(
            GRPOConfig(data=DataConfig(path=data_file(tmp_path)), task=TaskConfig(reward="math_verify")), tokenizer
        )
    with pytest.raises(ConfigError, match=r"data.answer_column.*'solution'.*'prompt', 'answer'"):
        preflight(GRPOConfig(data=DataConfig(path=data_file(tmp_path), answer_column="solution")), tokenizer)


def test_a_reward_reading_a_column_without_a_data_file_is_refused_when_the_config_is_built():
    with pytest.raises(ConfigError, match=r"parameter\(s\) 'difficulty'.*task 'max_of_two'.*no columns.*--data.path"):
        GRPOConfig(task=TaskConfig(reward=DIFFICULTY))


def test_the_rewards_example_of_the_data_docs_scores_a_row_of_its_file(tmp_path, monkeypatch):
    """docs/data.md "Rewards": its file, its reward module and its config, scored as a run would."""
    from forge_rl.yaml_config import load_yaml_config

    page = (Path(__file__).resolve().parents[3] / "docs" / "data.md").read_text()
    section = page.split("## Rewards")[1].split("\n## ")[0]

    def block(lang: str) -> str:
        return section.split(f"```{lang}\n")[1].split("```")[0]

    (tmp_path / "problems.jsonl").write_text(block("json"))
    (tmp_path / "my_rewards.py").write_text(block("python"))
    (tmp_path / "rewards.yaml").write_text(block("yaml"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=. of the command; the workers inherit it
    config = load_yaml_config(GRPOConfig, tmp_path / "rewards.yaml")
    rows = [json.loads(line) for line in block("json").splitlines()]
    completions = ["1/4 + 1/4 = 2/4 = $\\frac{1}{2}$", "0.4"]
    episodes = [episode(i, row, *completions, answer=row["solution"]) for i, row in enumerate(rows)]
    scored_episodes, _ = scored(build_scorer(config.scorer, config.task.reward_weights), episodes)
    first, second = ([c.reward_components for c in e.completions] for e in scored_episodes)
    assert first == [{"math_verify": 1.0, "shows_work": 1.0}, {"math_verify": 0.0, "shows_work": 0.0}]
    assert second == [{"math_verify": 1.0, "shows_work": 1.0}, {"math_verify": 0.0, "shows_work": 0.0}]
    assert scored_episodes[0].rewards == [1.0 + 0.2 * 1.0, 0.0]


@pytest.mark.parametrize("completion", ["$\\frac{1}{2}$", "\\boxed{0.5}", "\\frac{1}{2}"])
def test_the_math_verify_forms_the_docs_name_score_for_answer_one_half(completion):
    assert math_verify_reward(completion, "0.5") == 1.0
