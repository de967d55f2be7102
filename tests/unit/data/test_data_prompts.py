"""A run's prompts from a data file (GRPOConfig.data through pipeline/prompts.py `PromptSource`): row
by row, each row once per epoch, a checkpoint's {cursor, reissue} resuming mid-epoch exactly, the
config's refusals, and `forge-rl data export` writing a task to a file that reads back as its
prompts."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from forge_rl import cli
from forge_rl.config import GRPOConfig
from forge_rl.data.config import DataConfig
from forge_rl.data.files import FileSource
from forge_rl.errors import ConfigError
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.pipeline.prompts import PromptSource
from forge_rl.tasks import TaskConfig, make_task_prompt

NUM_ROWS = 7
ROWS = [{"prompt": f"M{i}{9 - i}=", "answer": str(max(i, 9 - i)), "id": i} for i in range(NUM_ROWS)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    # The Arrow cache a file is converted into goes under the test's directory, not the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def source_of(config: GRPOConfig, model_dir: Path) -> PromptSource:
    """The prompts as the rollouts' actor builds them from the run's config."""
    return PromptSource(config.task, str(model_dir), config.generator.max_new_tokens, config.data, config.max_model_len)


def run_config(path: Path, **data) -> GRPOConfig:
    return GRPOConfig(data=DataConfig(path=str(path), answer_column="answer", **data))


def test_a_run_config_with_a_data_path_hands_out_each_row_once_per_epoch(tmp_path, tiny_model):
    source = source_of(run_config(write_rows(tmp_path)), tiny_model)
    episodes = source.next_episodes(2 * NUM_ROWS)
    assert [e.episode_id for e in episodes] == list(range(2 * NUM_ROWS))
    by_id = {row["id"]: row for row in ROWS}
    for episode in episodes:
        row = by_id[episode.columns["id"]]
        assert (episode.prompt_text, episode.answer, episode.columns) == (row["prompt"], row["answer"], row)
        assert episode.prompt_token_ids == source.tokenizer.encode_prompt(row["prompt"])
    for epoch in range(2):
        ids = sorted(e.columns["id"] for e in episodes[epoch * NUM_ROWS : (epoch + 1) * NUM_ROWS])
        assert ids == list(range(NUM_ROWS))
    assert source.state() == {"cursor": 2 * NUM_ROWS, "reissue": [], "data_fingerprint": source.file.fingerprint}


def test_a_source_loaded_from_a_mid_epoch_state_continues_with_exactly_the_remaining_rows(tmp_path, tiny_model):
    config = run_config(write_rows(tmp_path), seed=3)
    uninterrupted = [(e.episode_id, e.columns["id"]) for e in source_of(config, tiny_model).next_episodes(NUM_ROWS)]
    before = source_of(config, tiny_model)
    first = [(e.episode_id, e.columns["id"]) for e in before.next_episodes(3)]
    state = json.loads(json.dumps(before.state()))  # as a checkpoint stores it
    resumed = source_of(config, tiny_model)
    resumed.load_state(**state)
    rest = [(e.episode_id, e.columns["id"]) for e in resumed.next_episodes(NUM_ROWS - 3)]
    assert first + rest == uninterrupted
    assert sorted(row for _, row in first + rest) == list(range(NUM_ROWS))


def test_a_reissued_prompt_is_the_same_row_under_its_own_index(tmp_path, tiny_model):
    config = run_config(write_rows(tmp_path))
    handed_out = source_of(config, tiny_model).next_episodes(4)
    resumed = source_of(config, tiny_model)
    resumed.load_state(cursor=4, reissue=[1])
    again, new = resumed.next_episodes(2)
    assert (again.episode_id, again.columns) == (1, handed_out[1].columns)
    assert new.episode_id == 4 and resumed.state() == {
        "cursor": 5,
        "reissue": [],
        "data_fingerprint": resumed.file.fingerprint,
    }


@pytest.mark.parametrize(
    "task, named",
    [
        (TaskConfig(name="copy_digit"), ("task.name ('copy_digit')", "Unset --task.name")),
        (TaskConfig(seed=5), ("task.seed (5)", "--data.seed")),
    ],
)
def test_a_data_path_with_a_task_of_its_own_is_refused_naming_both_fields(tmp_path, task, named):
    with pytest.raises(ConfigError) as error:
        GRPOConfig(task=task, data=DataConfig(path=str(tmp_path / "rows.jsonl")))
    assert "data.path" in str(error.value) and all(fragment in str(error.value) for fragment in named)


def test_data_flags_choose_the_data_config_anywhere_on_the_command_line(tmp_path):
    path = str(write_rows(tmp_path))
    config = cli.parse_config(
        GRPOConfig, ["--data.path", path, "--steps", "3", "--data.answer-column=answer"], prog="forge-rl grpo"
    )
    assert (config.data, config.steps) == (DataConfig(path=path, answer_column="answer"), 3)
    assert cli.parse_config(GRPOConfig, ["--steps", "3"], prog="forge-rl grpo").data is None


def test_data_export_writes_a_task_that_reads_back_as_its_prompts(tmp_path, capsys):
    out = tmp_path / "max_of_two.jsonl"
    cli.run(["data", "export", "--task.name", "max_of_two", "--out", str(out), "--rows", "12"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 12 and summary["path"] == str(out)
    task = TaskConfig(name="max_of_two")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [
        {"prompt": p.text, "answer": p.answer} for p in map(lambda i: make_task_prompt(task, i), range(12))
    ]
    source = FileSource(DataConfig(path=str(out), answer_column="answer"))
    rows = [source.row(i) for i in range(12)]
    assert sorted(row.row_number for row in rows) == list(range(12))
    assert all(
        (row.prompt, row.answer) == (lines[row.row_number]["prompt"], lines[row.row_number]["answer"]) for row in rows
    )


def test_a_row_passed_over_as_too_long_is_not_handed_out_again_after_a_resume(tmp_path, tiny_model):
    path = tmp_path / "rows.jsonl"
    rows = [*ROWS, {"prompt": "1" * 200, "answer": "1", "id": NUM_ROWS}]  # 200 tokens: over the tiny model's 128
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = run_config(path)
    before = source_of(config, tiny_model)
    episodes = before.next_episodes(NUM_ROWS)
    assert sorted(e.columns["id"] for e in episodes) == list(range(NUM_ROWS))
    assert before.file.skipped_rows == [NUM_ROWS]
    passed_over = sorted(set(range(before.cursor)) - {e.episode_id for e in episodes})
    resumed = source_of(config, tiny_model)
    # A checkpoint lists every index below the cursor that was not trained, the passed-over one included.
    resumed.load_state(cursor=before.cursor, reissue=[*passed_over, episodes[0].episode_id])
    assert [e.episode_id for e in resumed.next_episodes(2)] == [episodes[0].episode_id, before.cursor]


def test_export_with_unique_and_exclude_writes_disjoint_files_of_distinct_prompts(tmp_path):
    """max_of_two has 100 distinct prompts: a held-out file of 30, then a training file of every
    other one (asked for more than exist, it stops when none is left), sharing none."""
    held_out, train = tmp_path / "held_out.jsonl", tmp_path / "train.jsonl"
    cli.run(
        [
            "data",
            "export",
            "--task.name",
            "max_of_two",
            "--task.seed",
            "1",
            "--out",
            str(held_out),
            "--rows",
            "30",
            "--unique",
        ]
    )
    cli.run(["data", "export", "--out", str(train), "--rows", "1000", "--unique", "--exclude", str(held_out)])
    held_prompts = [json.loads(line)["prompt"] for line in held_out.read_text().splitlines()]
    train_prompts = [json.loads(line)["prompt"] for line in train.read_text().splitlines()]
    assert len(set(held_prompts)) == len(held_prompts) == 30
    assert len(set(train_prompts)) == len(train_prompts) == 70
    assert not set(held_prompts) & set(train_prompts)


def test_a_reasoning_gym_task_exports_its_questions_with_answers_a_text_reward_scores(tmp_path):
    from forge_rl.tasks.rewards import resolve_reward_fn

    out = tmp_path / "sums.jsonl"
    cli.run(
        [
            "data",
            "export",
            "--task.name",
            "reasoning_gym",
            "--task.reward",
            "reasoning_gym",
            "--task.reasoning-gym-dataset",
            "chain_sum",
            "--task.reasoning-gym-options",
            "min_terms",
            "2",
            "max_terms",
            "2",
            "max_digits",
            "1",
            "--out",
            str(out),
            "--rows",
            "5",
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all("arithmetic problem" in row["prompt"] for row in rows)
    math_verify = resolve_reward_fn("math_verify")
    for row in rows:
        terms = row["prompt"].split(":")[-1].rstrip("= ").strip()
        assert str(eval(terms)) == row["answer"]  # the oracle answer, as text
        assert math_verify(f"The answer is {row['answer']}.", row["answer"]) == 1.0


def test_a_source_refuses_a_checkpoints_state_taken_on_another_file(tmp_path, tiny_model):
    before = source_of(run_config(write_rows(tmp_path)), tiny_model)
    before.next_episodes(3)
    state = before.state()
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(row) + "\n" for row in reversed(ROWS)))
    with pytest.raises(ConfigError, match="is not the file the checkpoint was taken on"):
        source_of(run_config(other), tiny_model).load_state(**state)


def test_a_file_sources_step_metrics_count_the_rows_passed_over_and_the_epoch(tmp_path, tiny_model):
    rows = [{"prompt": "M" + "1" * (200 if i == 2 else 1) + "=", "answer": "1"} for i in range(4)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = source_of(run_config(path), tiny_model)
    assert source.stats() == {"data/skipped_rows": 0, "data/epoch": 0}
    source.next_episodes(3 + 3)  # row 2's prompt is longer than the tiny model's context
    assert source.stats() == {"data/skipped_rows": 1, "data/epoch": 2}
    assert source_of(GRPOConfig(), tiny_model).stats() == {}
