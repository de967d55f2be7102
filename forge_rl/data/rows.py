"""The row every prompt source hands out, the protocol sources share, and `export_rows`, which
writes any source's first rows to a JSONL file that a `FileSource` reads back.

Worked example (a JSONL line {"question": "2+3?", "answer": 5}, template "Solve: {question}",
answer_column "answer"; it is row 4 of a 10-row file, which prompt 14 reads if the order of epoch 1
puts row 4 at position 4):

    Row(index=14, row_number=4, epoch=1, columns={"question": "2+3?", "answer": 5},
        prompt="Solve: 2+3?", answer="5")
"""

from __future__ import annotations

import datetime
import decimal
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forge_rl.errors import ConfigError

Message = dict[str, str]
"""One chat message: {"role": ..., "content": ...}."""


@dataclass(frozen=True)
class Row:
    """One prompt of a source, with everything its reward and its environment may read."""

    index: int
    """Prompt index: the place in the source's stream (for a file, epoch * num_rows + position)."""
    row_number: int
    """The row in the data, 0-based in storage order (line row_number + 1 of a JSONL file)."""
    epoch: int
    """How many times every row was read before this one (0 for an endless source)."""
    columns: dict[str, Any]
    """Every column of the row, by name, as `datasets` decodes it."""
    prompt: str | list[Message]
    """The built prompt: text, or chat messages when the source has them or a system prompt."""
    answer: str | None
    """The row's answer as text (numbers formatted with str), or None when the source has none."""

    @property
    def prompt_text(self) -> str:
        """The prompt as text for what reads it as text (a judge's template, a results file): the
        text itself, or a chat prompt's last message."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]


class RowSource(Protocol):
    """What every prompt source offers: a file (`FileSource`), a task, a reasoning-gym dataset."""

    @property
    def num_rows(self) -> int | None:
        """Rows per epoch; None for an endless source (a generated task)."""
        ...

    def next_row(self, index: int) -> Row:
        """The row of the first index >= `index` that the source hands out (a file skips rows
        whose prompt does not fit the context); `Row.index` says which index that is."""
        ...


MAX_PASSED_OVER = 100_000
"""With unique or exclude, an export stops after passing over this many prompts in a row: an
endless source whose distinct prompts are all written (or excluded) would otherwise never end."""


def export_rows(
    source: RowSource,
    path: str | os.PathLike,
    num_rows: int,
    unique: bool = False,
    exclude: str | os.PathLike | None = None,
) -> int:
    """Write the source's first `num_rows` rows (in its order, skipped rows left out) to the JSONL
    file `path`, one row a line, and return how many it wrote: fewer than asked when a finite
    source's first epoch ends first, since a second epoch would repeat rows. `unique` passes over a
    prompt written before; `exclude` (a JSONL file of prompts, another export) passes over its
    prompts, so the two files are disjoint; either stops after MAX_PASSED_OVER prompts in a row
    are passed over (every distinct prompt is in).

    Each line holds the row's columns, then the built prompt under "prompt" (text) or "messages"
    (chat), and the answer under "answer" when there is one; these replace columns of the same
    name. The file reads back with DataConfig(path, prompt_column="prompt" or
    messages_column="messages", answer_column="answer"). It is written beside `path` and renamed
    over it, so a reader never sees half a file."""
    if num_rows < 0:
        raise ConfigError(f"the number of rows to export ({num_rows}) must be >= 0.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    passed = set() if exclude is None else excluded_prompts(exclude)
    written, index, passed_over = 0, 0, 0
    with partial.open("w", encoding="utf-8") as file:
        while written < num_rows and passed_over < MAX_PASSED_OVER:
            row = source.next_row(index)
            if source.num_rows is not None and row.index >= source.num_rows:
                break
            index = row.index + 1
            key = prompt_key(row.prompt)
            if key in passed:
                passed_over += 1
                continue
            if unique:
                passed.add(key)
            file.write(_json_line(row) + "\n")
            written, passed_over = written + 1, 0
    partial.replace(path)
    return written


def prompt_key(prompt: str | list[Message]) -> str:
    """A prompt as one string that equals another's exactly when the prompts are the same."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def excluded_prompts(path: str | os.PathLike) -> set[str]:
    """The prompts of a JSONL file an export wrote (its "prompt" or "messages" on each line)."""
    keys = set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConfigError(
            f"--exclude ({str(path)!r}) cannot be read: {error}. Point it at a JSONL file an export wrote."
        ) from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            keys.add(prompt_key(record["messages"] if "messages" in record else record["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(
                f"--exclude ({str(path)!r}) line {number} is not a JSON object with a 'prompt' or 'messages': "
                f"{line[:80]!r}. Point it at a JSONL file an export wrote."
            ) from None
    return keys


def _json_line(row: Row) -> str:
    record = dict(row.columns)
    record["messages" if isinstance(row.prompt, list) else "prompt"] = row.prompt
    if row.answer is not None:
        record["answer"] = row.answer
    try:
        return json.dumps(record, ensure_ascii=False, default=_json_value)
    except TypeError as error:
        unwritable = [name for name, value in record.items() if not _writable(value)]
        raise ConfigError(
            f"row {row.row_number} (prompt {row.index}) cannot be written as JSON: column(s) "
            f"{', '.join(map(repr, unwritable))} hold values JSON has no form for ({error}). Drop or convert "
            "those columns before exporting."
        ) from error


def _json_value(value: Any) -> Any:
    """JSON forms of the non-JSON values `datasets` decodes Arrow columns to."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _writable(value: Any) -> bool:
    try:
        json.dumps(value, default=_json_value)
    except TypeError:
        return False
    return True
