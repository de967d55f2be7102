"""Prompt sources from data files (forge_rl/data): the config's checks, the order (each row once
per epoch, a pure function of seed and epoch), every format `datasets` reads for us, the refusals
of bad input (each naming the row, column or field and the fix), the length check, export, and a
million-row file that stays on disk."""

import csv
import gc
import json
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet as pq
import pytest

from forge_rl.data.config import DataConfig
from forge_rl.data.files import FileSource, LengthLimit
from forge_rl.data.order import locate, permute
from forge_rl.data.rows import Row, export_rows
from forge_rl.errors import ConfigError

ROWS = [{"question": f"what is {i} plus {i}", "answer": 2 * i, "topic": "sums"} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def open_source(tmp_path: Path, path, length_limit: LengthLimit | None = None, **fields) -> FileSource:
    return FileSource(DataConfig(path=str(path), **fields), length_limit, cache_dir=str(tmp_path / "cache"))


def count_words(prompt) -> int:
    text = prompt if isinstance(prompt, str) else " ".join(message["content"] for message in prompt)
    return len(text.split())


def take(source: FileSource, cursor: int, num_prompts: int) -> tuple[list[Row], int]:
    """What a consumer does: ask for the next row at its cursor, move the cursor past it."""
    rows = []
    for _ in range(num_prompts):
        row = source.next_row(cursor)
        rows.append(row)
        cursor = row.index + 1
    return rows, cursor


# --- the config ---------------------------------------------------------------------------------


def test_data_config_reads_the_prompt_column_by_default_and_lists_a_templates_columns():
    assert DataConfig(path="x.jsonl").text_column == "prompt"
    assert DataConfig(path="x.jsonl", prompt_column="question").text_column == "question"
    assert DataConfig(path="x.jsonl", template="{a} and {b.c} and {d[0]} and {a}").template_columns == ("a", "b", "d")


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"path": " "}, "data.path"),
        ({"path": "x.jsonl", "split": ""}, "data.split"),
        ({"path": "x.jsonl", "prompt_column": ""}, "data.prompt_column"),
        ({"path": "x.jsonl", "prompt_column": "q", "messages_column": "m"}, "--data.messages-column"),
        ({"path": "x.jsonl", "prompt_column": "q", "template": "{q}"}, "--data.template"),
        ({"path": "x.jsonl", "template": "Solve: {question"}, "not a format string"),
        ({"path": "x.jsonl", "template": "Solve: {}"}, "positional"),
        ({"path": "x.jsonl", "template": "Solve it"}, "names no column"),
        ({"path": "x.jsonl", "system_prompt": ""}, "--data.system-prompt"),
        ({"path": "x.jsonl", "seed": 1.5}, "data.seed"),
        ({"path": "x.jsonl", "too_long": "truncate"}, "--data.too-long"),
    ],
)
def test_data_config_refuses_bad_fields_naming_the_field_and_the_fix(fields, named):
    with pytest.raises(ConfigError, match="data") as raised:
        DataConfig(**fields)
    assert named in str(raised.value)


def test_a_length_limit_with_no_room_for_a_prompt_is_refused_naming_both_lengths():
    with pytest.raises(
        ConfigError, match=r"max_new_tokens \(128\).*max_model_len \(128, the model.s max_position_embeddings\)"
    ):
        LengthLimit(count_words, max_model_len=128, max_new_tokens=128)


# --- the order ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097])
def test_each_row_is_read_exactly_once_per_epoch(num_rows):
    for epoch in range(3):
        rows = [locate(epoch * num_rows + position, num_rows, seed=3).row_number for position in range(num_rows)]
        assert sorted(rows) == list(range(num_rows))


def test_the_order_is_a_pure_function_of_seed_and_epoch():
    def order(seed, epoch):
        return [permute(position, 100, seed, epoch) for position in range(100)]

    assert order(0, 0) == order(0, 0)
    assert len({tuple(order(seed, epoch)) for seed in range(3) for epoch in range(3)}) == 9
    assert order(0, 0) != list(range(100))


def test_the_first_row_of_an_epoch_is_spread_evenly_over_seeds():
    counts = Counter(permute(0, 10, seed, 0) for seed in range(2000))
    assert sorted(counts) == list(range(10))
    assert all(150 <= count <= 250 for count in counts.values()), counts


def test_a_prompt_index_is_an_epoch_and_a_position():
    position = locate(23, 10, seed=0)
    assert (position.epoch, position.position) == (2, 3)
    assert position.row_number == permute(3, 10, 0, 2)


# --- formats ------------------------------------------------------------------------------------


def test_a_row_carries_every_column_plus_its_prompt_and_answer(tmp_path):
    source = open_source(
        tmp_path, write_jsonl(tmp_path / "q.jsonl", ROWS), prompt_column="question", answer_column="answer"
    )
    assert source.num_rows == 10
    row = source.row(13)
    assert (row.index, row.epoch, row.row_number) == (13, 1, locate(13, 10, 0).row_number)
    assert row.columns == ROWS[row.row_number]
    assert row.prompt == ROWS[row.row_number]["question"]
    assert row.answer == str(2 * row.row_number)  # a numeric answer reaches the reward as text


def write_as(fmt: str, path: Path, rows: list[dict]) -> Path:
    if fmt == "jsonl":
        return write_jsonl(path.with_suffix(".jsonl"), rows)
    if fmt == "json":
        path = path.with_suffix(".json")
        path.write_text(json.dumps(rows))
        return path
    if fmt == "parquet":
        path = path.with_suffix(".parquet")
        pq.write_table(pyarrow.Table.from_pylist(rows), path)
        return path
    path = path.with_suffix(".csv")
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_jsonl_json_parquet_and_csv_files_give_the_same_rows(tmp_path, fmt):
    source = open_source(
        tmp_path, write_as(fmt, tmp_path / "q", ROWS), template="Q: {question}", answer_column="answer"
    )
    rows = [source.row(i) for i in range(10)]
    assert sorted(row.row_number for row in rows) == list(range(10))
    assert {(row.prompt, row.answer) for row in rows} == {(f"Q: {r['question']}", str(r["answer"])) for r in ROWS}


def test_a_directory_of_files_is_split_by_file_name(tmp_path):
    directory = tmp_path / "data"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", ROWS[:6])
    write_jsonl(directory / "test.jsonl", ROWS[6:])
    train = open_source(tmp_path, directory, prompt_column="question")
    test = open_source(tmp_path, directory, prompt_column="question", split="test")
    assert (train.num_rows, test.num_rows) == (6, 4)
    assert {test.row(i).prompt for i in range(4)} == {row["question"] for row in ROWS[6:]}


def test_save_to_disk_directories_load_with_their_splits(tmp_path):
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset.select(range(7)), "test": dataset.select(range(7, 10))}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    assert open_source(tmp_path, tmp_path / "saved", prompt_column="question").num_rows == 10
    held_out = open_source(tmp_path, tmp_path / "saved_dict", prompt_column="question", split="test")
    assert held_out.num_rows == 3
    assert held_out.dataset.cache_files  # memory-mapped where it lies


def test_an_unknown_split_is_refused_listing_the_splits(tmp_path):
    with pytest.raises(ConfigError, match=r"data.split \('validation'\).*'train'.*--data.split"):
        open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", ROWS), prompt_column="question", split="validation")


def test_opening_a_local_file_makes_no_network_connection(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    directory = tmp_path / "data"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", ROWS)
    assert open_source(tmp_path, directory / "train.jsonl", prompt_column="question").num_rows == 10
    assert open_source(tmp_path, directory, prompt_column="question").num_rows == 10


@pytest.mark.parametrize("variable", ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"])
def test_a_hub_name_is_refused_offline_naming_the_fix(tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail("a network connection was attempted"))
    with pytest.raises(ConfigError, match=rf"'openai/gsm8k'.*{variable}=1.*save_to_disk"):
        open_source(tmp_path, "openai/gsm8k", prompt_column="question")


# --- bad input ----------------------------------------------------------------------------------


def test_a_missing_file_is_refused_naming_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path \('.*missing.jsonl'\): no file or directory.*--data.path"):
        open_source(tmp_path, tmp_path / "missing.jsonl")


def test_an_unknown_format_is_refused_listing_the_formats_read(tmp_path):
    path = tmp_path / "q.xlsx"
    path.write_text("not data")
    with pytest.raises(ConfigError, match=r"suffix '.xlsx'.*\.csv, \.json, \.jsonl, \.parquet.*--data.path"):
        open_source(tmp_path, path)


def test_a_directory_without_data_files_is_refused_naming_what_it_holds(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"no data files.*readme.txt"):
        open_source(tmp_path, tmp_path / "notes")


def test_a_directory_of_several_formats_is_refused_naming_them(tmp_path):
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ROWS)
    write_as("csv", tmp_path / "mixed" / "b", ROWS)
    with pytest.raises(ConfigError, match=r"several formats \(csv, json\).*one format"):
        open_source(tmp_path, tmp_path / "mixed")


def test_a_file_datasets_cannot_parse_is_refused_naming_the_path(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"broken.jsonl.*could not be read by datasets"):
        open_source(tmp_path, path)


def test_a_missing_column_is_refused_listing_the_columns_present(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"data.prompt_column \('prompt'\).*'question', 'answer', 'topic'"):
        open_source(tmp_path, path)
    with pytest.raises(ConfigError, match=r"data.template \('problem'\).*--data.template"):
        open_source(tmp_path, path, template="Solve {problem}")


@pytest.mark.parametrize("content", ["", "question,answer\n"])
def test_an_empty_dataset_is_refused(tmp_path, content):
    path = tmp_path / ("q.jsonl" if not content else "q.csv")
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"holds no rows: add rows|has no rows"):
        open_source(tmp_path, path, prompt_column="question")


def test_a_null_prompt_is_refused_naming_its_row(tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[7]["question"] = None
    rows[8]["question"] = None
    with pytest.raises(ConfigError, match=r"row 7 .*null.*'question'.*2 row"):
        open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", rows), prompt_column="question")


def test_a_null_in_a_template_column_is_refused_naming_its_row(tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[4]["topic"] = None
    with pytest.raises(ConfigError, match=r"row 4 .*template column 'topic'"):
        open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", rows), template="{topic}: {question}")


def test_a_non_string_prompt_is_refused_naming_the_column_and_a_fix(tmp_path):
    numbers = write_jsonl(tmp_path / "n.jsonl", [{"prompt": i} for i in range(3)])
    with pytest.raises(ConfigError, match=r"'prompt'.*int64.*must be text.*--data.template '\{prompt\}'"):
        open_source(tmp_path, numbers)
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": 3}])
    with pytest.raises(ConfigError, match=r"row 2 .*= 3 \(int\).*must be text"):
        open_source(tmp_path, mixed)
    chats = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match=r"--data.messages-column prompt"):
        open_source(tmp_path, chats)
    assert open_source(tmp_path, numbers, template="{prompt}").row(0).prompt in {"0", "1", "2"}


def test_a_template_that_cannot_format_a_row_is_refused_when_the_source_opens(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot format row 0.*--data.template"):
        open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", ROWS), template="{question:03d}")


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "bad, named",
    [
        ("hi", r"row 2 .*a str, not a list of messages"),
        (["hi"], r"row 2 .*a message that is a str"),
        ([{"role": "user"}], r"row 2 .*content is null"),
        ([], r"row 2 .*an empty list"),
        (None, r"row 2 .*no messages \(null\)"),
        ([{"role": "bot", "content": "hi"}], r"row 2 .*a role outside"),
        ([{"role": "user", "content": None}], r"row 2 .*content is null"),
        ([{"role": "user", "content": 5}], r"row 2 .*content is not text"),
    ],
)
def test_chat_messages_of_the_wrong_shape_are_refused_naming_the_row(tmp_path, bad, named):
    rows = [
        {"messages": CHAT},
        {"messages": CHAT + [{"role": "assistant", "content": "hello"}] + CHAT},
        {"messages": bad},
        {"messages": CHAT},
    ]
    with pytest.raises(ConfigError, match=r"data.messages_column|messages") as raised:
        open_source(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows), messages_column="messages")
    assert re.search(named, str(raised.value)), str(raised.value)


def test_an_answer_column_the_file_lacks_is_refused_listing_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": row["question"]} for row in ROWS])
    with pytest.raises(ConfigError, match=r"data.answer_column \('answer'\).*'question'.*--data.answer-column"):
        open_source(tmp_path, path, prompt_column="question", answer_column="answer")


def test_a_reward_that_needs_answers_or_columns_the_file_lacks_is_refused(tmp_path):
    source = open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", ROWS), prompt_column="question")
    with pytest.raises(ConfigError, match=r"reward exact_match .*data.answer_column is unset.*--data.answer-column"):
        source.require_answer("reward exact_match")
    with pytest.raises(ConfigError, match=r"reward units reads column\(s\) 'unit'.*'topic'"):
        source.require_columns(["topic", "unit"], "reward units")
    source.require_columns(["topic", "answer"], "reward units")


# --- building prompts ---------------------------------------------------------------------------


def test_a_system_prompt_turns_a_text_prompt_into_chat_messages(tmp_path):
    source = open_source(
        tmp_path,
        write_jsonl(tmp_path / "q.jsonl", ROWS),
        template="Solve: {question}",
        system_prompt="Answer with a number.",
    )
    row = source.row(0)
    assert row.prompt == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": f"Solve: {ROWS[row.row_number]['question']}"},
    ]


def test_a_system_prompt_goes_before_messages_unless_the_row_has_its_own(tmp_path):
    own = [{"role": "system", "content": "Be brief.", "name": "house"}] + CHAT
    source = open_source(
        tmp_path,
        write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": own}]),
        messages_column="messages",
        system_prompt="Be kind.",
    )
    prompts = {source.row(i).row_number: source.row(i).prompt for i in range(2)}
    assert prompts[0] == [{"role": "system", "content": "Be kind."}] + CHAT
    assert prompts[1] == [{"role": "system", "content": "Be brief."}] + CHAT  # role and content only


# --- lengths ------------------------------------------------------------------------------------


def long_rows() -> list[dict]:
    """Rows 2, 5 and 6 have 8-word prompts; the others 2 words."""
    return [
        {"prompt": "one two three four five six seven eight" if i in (2, 5, 6) else f"short {i}"} for i in range(10)
    ]


def test_rows_that_do_not_fit_are_skipped_and_named_by_row_number(tmp_path):
    limit = LengthLimit(count_words, max_model_len=10, max_new_tokens=5)
    source = open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", long_rows()), limit)
    rows, cursor = take(source, 0, 7)
    assert sorted(row.row_number for row in rows) == [0, 1, 3, 4, 7, 8, 9]
    assert source.skipped_rows == [2, 5, 6]
    assert cursor <= 10 and all(row.epoch == 0 for row in rows)
    more, _ = take(source, cursor, 7)  # the next epoch: the same rows again, skipped ones counted once
    assert sorted(row.row_number for row in more) == [0, 1, 3, 4, 7, 8, 9]
    assert all(row.epoch == 1 for row in more) and source.skipped_rows == [2, 5, 6]


def test_skipping_keeps_the_stream_deterministic_across_a_resume(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", long_rows())
    limit = LengthLimit(count_words, max_model_len=10, max_new_tokens=5)
    straight, _ = take(open_source(tmp_path, path, limit, seed=4), 0, 25)
    first, cursor = take(open_source(tmp_path, path, limit, seed=4), 0, 11)  # stops mid-epoch 1
    resumed, _ = take(open_source(tmp_path, path, limit, seed=4), cursor, 14)  # a fresh process resumes
    assert [row.index for row in first + resumed] == [row.index for row in straight]
    assert [row.row_number for row in first + resumed] == [row.row_number for row in straight]
    other_seed, _ = take(open_source(tmp_path, path, limit, seed=5), 0, 25)
    assert [row.row_number for row in other_seed] != [row.row_number for row in straight]


def test_too_long_refuse_stops_at_the_row_naming_it_and_the_fixes(tmp_path):
    limit = LengthLimit(count_words, max_model_len=10, max_new_tokens=5)
    source = open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", long_rows()), limit, too_long="refuse")
    with pytest.raises(ConfigError, match=r"row\(s\) [256] \(8 tokens\).*--data.too-long skip.*--generator.max-new"):
        take(source, 0, 10)


def test_check_lengths_counts_every_row_that_does_not_fit(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", long_rows())
    limit = LengthLimit(count_words, max_model_len=10, max_new_tokens=5)
    report = open_source(tmp_path, path, limit).check_lengths(batch_size=3)
    assert (report.num_rows, report.num_too_long, report.too_long_rows, report.max_prompt_tokens) == (
        10,
        3,
        [2, 5, 6],
        8,
    )
    with pytest.raises(ConfigError, match=r"3 row\(s\) .*row\(s\) 2 \(8 tokens\), 5 \(8 tokens\), 6 \(8 tokens\)"):
        open_source(tmp_path, path, limit, too_long="refuse").check_lengths()


def test_a_source_where_no_row_fits_is_refused(tmp_path):
    limit = LengthLimit(count_words, max_model_len=6, max_new_tokens=5)
    source = open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", long_rows()), limit)
    with pytest.raises(ConfigError, match=r"no row .* fits.*shortest by 1 tokens"):
        source.next_row(0)


# --- export -------------------------------------------------------------------------------------


def test_export_writes_the_first_rows_and_they_read_back_as_a_file(tmp_path):
    source = open_source(
        tmp_path, write_jsonl(tmp_path / "q.jsonl", ROWS), template="Q: {question}", answer_column="answer"
    )
    assert export_rows(source, tmp_path / "out" / "first.jsonl", 4) == 4
    lines = [json.loads(line) for line in (tmp_path / "out" / "first.jsonl").read_text().splitlines()]
    expected = [source.row(i) for i in range(4)]
    assert [line["prompt"] for line in lines] == [row.prompt for row in expected]
    assert [line["answer"] for line in lines] == [row.answer for row in expected]
    assert [line["topic"] for line in lines] == ["sums"] * 4
    back = open_source(tmp_path, tmp_path / "out" / "first.jsonl", prompt_column="prompt", answer_column="answer")
    assert {back.row(i).prompt for i in range(4)} == {row.prompt for row in expected}


def test_export_stops_at_the_end_of_a_files_first_epoch_and_leaves_skipped_rows_out(tmp_path):
    limit = LengthLimit(count_words, max_model_len=10, max_new_tokens=5)
    source = open_source(tmp_path, write_jsonl(tmp_path / "q.jsonl", long_rows()), limit)
    assert export_rows(source, tmp_path / "all.jsonl", 100) == 7
    assert len(set((tmp_path / "all.jsonl").read_text().splitlines())) == 7


def test_export_writes_chat_prompts_as_messages(tmp_path):
    source = open_source(
        tmp_path, write_jsonl(tmp_path / "q.jsonl", ROWS), prompt_column="question", system_prompt="Be brief."
    )
    export_rows(source, tmp_path / "chat.jsonl", 2)
    back = open_source(tmp_path, tmp_path / "chat.jsonl", messages_column="messages")
    assert back.row(0).prompt[0] == {"role": "system", "content": "Be brief."}


class EndlessSource:
    """A generated task's shape: no epochs, every index a row."""

    num_rows = None

    def next_row(self, index: int) -> Row:
        return Row(
            index=index, row_number=index, epoch=0, columns={"a": index}, prompt=f"{index}+1=", answer=str(index + 1)
        )


def test_export_of_an_endless_source_writes_as_many_rows_as_asked(tmp_path):
    assert export_rows(EndlessSource(), tmp_path / "task.jsonl", 5) == 5
    lines = [json.loads(line) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    assert lines[4] == {"a": 4, "prompt": "4+1=", "answer": "5"}


# --- memory -------------------------------------------------------------------------------------


def anonymous_memory_bytes() -> int:
    """The process's resident memory that is not a mapped file: what reading data into memory grows
    (pages of a memory-mapped file are the page cache's, RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc/self/status (RssAnon)")
def test_a_million_row_file_is_memory_mapped_not_read_into_memory(tmp_path):
    num_rows, padding = 1_000_000, "x" * 150
    path = tmp_path / "big.parquet"
    schema = pyarrow.schema([("question", pyarrow.string()), ("answer", pyarrow.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, num_rows, 100_000):
            numbers = range(start, start + 100_000)
            writer.write_table(
                pyarrow.table(
                    {
                        "question": [f"what is {i % 977} plus {i % 613}? {padding}" for i in numbers],
                        "answer": [str(i % 977 + i % 613) for i in numbers],
                    },
                    schema=schema,
                )
            )
    gc.collect()
    pyarrow.default_memory_pool().release_unused()
    before = anonymous_memory_bytes()

    source = open_source(tmp_path, path, prompt_column="question", answer_column="answer")
    rows, _ = take(source, 0, 500)
    rows += [source.next_row(index) for index in range(999_000, 1_001_000, 4)]  # both sides of an epoch's end

    grown = anonymous_memory_bytes() - before
    data_bytes = source.dataset.data.nbytes
    print(f"{num_rows} rows, {data_bytes / 2**20:.0f} MiB of Arrow data: anonymous memory grew {grown / 2**20:.1f} MiB")
    assert source.num_rows == num_rows and source.dataset.cache_files
    assert data_bytes > 150 * 2**20
    assert grown < 48 * 2**20, f"anonymous memory grew {grown / 2**20:.0f} MiB for {data_bytes / 2**20:.0f} MiB of data"
    assert len({row.row_number for row in rows if row.epoch == 0}) == len([row for row in rows if row.epoch == 0])
    assert rows[0].answer == str(rows[0].row_number % 977 + rows[0].row_number % 613)


def test_importing_data_config_imports_neither_datasets_nor_pyarrow():
    code = "import sys, forge_rl.data.files; print(sorted({'datasets', 'pyarrow', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
