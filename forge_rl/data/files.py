"""Prompts from data files, read through Hugging Face `datasets`.

`DataConfig` names the data and how a row becomes a prompt; `FileSource` opens it as one
memory-mapped Arrow split (`forge_rl.data.loading.open_dataset`), refuses bad data before a run
starts (`forge_rl.data.checks.check_columns`), and maps prompt index i to a row as
`forge_rl.data.order` says: row permute(i % N) of epoch i // N, so each row is used once per epoch
and prompt i is a pure function of (data, seed, i). A consumer keeps one cursor (the next index to
ask for) and asks `next_row(cursor)`; rows whose prompt does not fit the context are skipped there,
which moves the cursor past their index and changes no other index, so a resume at any cursor
replays exactly.

Worked example (a JSONL file of 3 rows {"question": ..., "answer": ...}, template
"Solve: {question}", answer_column "answer", seed 0): prompt 0 reads row permute(0, 3, 0, 0), prompt 4
reads row permute(1, 3, 0, 1) of epoch 1, and `row(4).columns` holds question and answer.

Importing this module imports neither `datasets` nor `pyarrow` (a config holding a `DataConfig`
stays cheap to import); opening a `FileSource` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forge_rl.data.config import DataConfig
from forge_rl.data.order import Position, locate
from forge_rl.data.rows import Message, Row, prompt_key
from forge_rl.errors import ConfigError
from forge_rl.yaml_config import flag

if TYPE_CHECKING:
    import datasets

_SHOWN_ROWS = 10
"""How many row numbers a message lists before it says how many more there are."""


@dataclass(frozen=True)
class LengthLimit:
    """What a prompt must fit: count_tokens(prompt) + max_new_tokens <= max_model_len."""

    count_tokens: Callable[[str | list[Message]], int]
    """The prompt's token count as the generator will see it (text, or chat messages rendered by
    the model's chat template with the assistant header)."""
    max_model_len: int
    """The model's context, in tokens (GRPOConfig.max_model_len: its max_position_embeddings)."""
    max_new_tokens: int
    """The most tokens a completion may add (generator.max_new_tokens)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.max_model_len <= self.max_new_tokens:
            raise ConfigError(
                f"generator.max_new_tokens ({self.max_new_tokens}) leaves no room for a prompt in "
                f"max_model_len ({self.max_model_len}, the model's max_position_embeddings): it must be >= 1 and "
                "below it. Lower --generator.max-new-tokens, or use a model with a longer context."
            )

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - self.max_new_tokens


@dataclass(frozen=True)
class LengthReport:
    """What `FileSource.check_lengths` found over every row."""

    num_rows: int
    num_too_long: int
    too_long_rows: list[int]
    """Row numbers whose prompt does not fit, ascending."""
    max_prompt_tokens: int
    """The longest prompt, in tokens."""


FINGERPRINT_ROWS = 64
"""Rows a file's fingerprint reads (`FileSource.fingerprint`), spread evenly over it."""


class FileSource:
    """A data file as a prompt source: `row(i)` is prompt i's row, `next_row(i)` the first row at
    or after index i whose prompt fits `length_limit` (no limit: every row fits).

    `cache_dir` is where `datasets` keeps the Arrow conversion of a file (default
    HF_DATASETS_CACHE); the rows are memory-mapped from there, never read into memory whole."""

    def __init__(
        self,
        config: DataConfig,
        length_limit: LengthLimit | None = None,
        cache_dir: str | None = None,
        field: str = "data",
    ):
        # Imported here, not at the top, so importing DataConfig costs nothing (see the module docstring).
        from forge_rl.data.checks import check_columns
        from forge_rl.data.loading import open_dataset

        self.config = config
        self.length_limit = length_limit
        self.field = field
        self.where = f"{field}.path ({config.path!r}, split {config.split!r})"
        """How messages name the file: by the config field that holds its DataConfig (`field`:
        "data" for the run's, "eval.sets[0].data" for an eval set's)."""
        try:
            self.dataset: datasets.Dataset = open_dataset(config.path, config.split, cache_dir)
            check_columns(self.dataset, config, self.where)
            self._prompt(self.dataset[0], 0)  # a template that cannot format the rows fails here, not mid-run
        except ConfigError as error:
            if field == "data":
                raise
            # The loaders name the run's own fields (data.path, --data.path): this file's are field's.
            message = str(error).replace("--data.", flag(field) + ".")
            raise ConfigError(re.sub(r"(?<![\w.-])data\.", f"{field}.", message)) from None
        self._too_long: dict[int, int] = {}
        """Row number -> prompt tokens, for each row met that does not fit (too_long skip)."""

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a resume compares to know the file is the one its checkpoint counted rows of: a
        hash of the row count, the columns and FINGERPRINT_ROWS rows spread evenly over the file
        (a few reads of the memory-mapped rows, whatever the file's size). A change to rows between
        the sampled ones goes unseen."""
        step = max(self.num_rows // FINGERPRINT_ROWS, 1)
        sampled = [self.dataset[i] for i in range(0, self.num_rows, step)][:FINGERPRINT_ROWS]
        sampled.append(self.dataset[self.num_rows - 1])
        text = json.dumps([self.num_rows, self.column_names, sampled], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def num_rows(self) -> int:
        """Rows per epoch (N)."""
        return self.dataset.num_rows

    @property
    def column_names(self) -> list[str]:
        return list(self.dataset.column_names)

    @property
    def skipped_rows(self) -> list[int]:
        """Row numbers this source has skipped as too long so far, ascending (each counted once,
        however many epochs met it)."""
        return sorted(self._too_long)

    def locate(self, index: int) -> Position:
        """The epoch, position and row number of prompt `index`."""
        return locate(index, self.num_rows, self.config.seed)

    def row(self, index: int) -> Row:
        """Prompt `index`'s row, whether or not it fits (a resume hands out again indices that
        `next_row` gave before)."""
        epoch, _, row_number = self.locate(index)
        columns = self.dataset[row_number]
        return Row(
            index=index,
            row_number=row_number,
            epoch=epoch,
            columns=columns,
            prompt=self._prompt(columns, row_number),
            answer=self._answer(columns),
        )

    def next_row(self, index: int) -> Row:
        """The row of the first index >= `index` whose prompt fits; the indices of rows that do not
        are passed over (too_long skip) or refused (too_long refuse). The consumer's next cursor is
        `Row.index + 1`."""
        while True:
            row = self.row(index)
            if self._fits(row):
                return row
            if len(self._too_long) == self.num_rows:
                limit = self.length_limit
                assert limit is not None  # a row counts as too long only against a limit
                raise ConfigError(
                    f"no row of {self.where} fits: every prompt plus generator.max_new_tokens "
                    f"({limit.max_new_tokens}) exceeds max_model_len ({limit.max_model_len}), "
                    f"the shortest by {min(self._too_long.values()) - limit.max_prompt_tokens} tokens. "
                    "Lower --generator.max-new-tokens, shorten the prompts, or use a model with a longer context."
                )
            index += 1

    def first_rows(self, limit: int) -> list[Row]:
        """The first `limit` rows of the first epoch, in the seed's order, that fit (`next_row`):
        a fixed sample of the file (an eval set's prompts at every version)."""
        rows: list[Row] = []
        index = 0
        while len(rows) < limit:
            row = self.next_row(index)
            if row.epoch > 0:  # every row of the file is in
                break
            rows.append(row)
            index = row.index + 1
        return rows

    def count_prompts_among(self, prompts: list[str | list[Message]], batch_size: int = 1024) -> int:
        """How many of `prompts` are the prompt of some row of this file (an eval set's prompts among
        the training data's), counted over every row once, in storage order, never holding more
        than one batch of rows."""
        wanted = {prompt_key(prompt) for prompt in prompts}
        found: set[str] = set()
        row_number = 0
        for batch in self.dataset.iter(batch_size=batch_size):
            names = list(batch)
            for values in zip(*(batch[name] for name in names)):
                key = prompt_key(self._prompt(dict(zip(names, values)), row_number))
                if key in wanted:
                    found.add(key)
                row_number += 1
        return sum(prompt_key(prompt) in found for prompt in prompts)

    def check_lengths(self, batch_size: int = 1024) -> LengthReport:
        """Count every row's prompt tokens once, in storage order: the report a preflight shows
        (and, with too_long refuse, a ConfigError naming the rows before a run starts)."""
        if self.length_limit is None:
            raise ValueError("check_lengths needs the source's length_limit")
        longest, row_number = 0, 0
        for batch in self.dataset.iter(batch_size=batch_size):
            names = list(batch)
            for values in zip(*(batch[name] for name in names)):
                tokens = self.length_limit.count_tokens(self._prompt(dict(zip(names, values)), row_number))
                longest = max(longest, tokens)
                if tokens > self.length_limit.max_prompt_tokens:
                    self._too_long[row_number] = tokens
                row_number += 1
        too_long = sorted(self._too_long)
        if too_long and self.config.too_long == "refuse":
            raise ConfigError(self._too_long_message(too_long))
        return LengthReport(self.num_rows, len(too_long), too_long, longest)

    def require_columns(self, columns: list[str], needed_by: str) -> None:
        """Refuse unless every one of `columns` is a column of the data (`needed_by` reads them:
        a reward, an environment)."""
        missing = [column for column in columns if column not in self.dataset.column_names]
        if missing:
            raise ConfigError(
                f"{needed_by} reads column(s) {', '.join(map(repr, missing))}, which {self.where} lacks; its "
                f"columns are: {', '.join(map(repr, self.dataset.column_names))}. Add the column(s) to the data, "
                f"or configure {needed_by} to read columns it has."
            )

    def require_answer(self, needed_by: str) -> None:
        """Refuse unless rows have answers: `needed_by` (a reward) compares completions against them."""
        if self.config.answer_column is None:
            raise ConfigError(
                f"{needed_by} compares each completion with its row's answer, and {self.field}.answer_column is unset. "
                f"Set {flag(self.field)}.answer-column to the column of {self.where} that holds the answers (its columns: "
                f"{', '.join(map(repr, self.dataset.column_names))})."
            )

    def _prompt(self, columns: dict[str, Any], row_number: int) -> str | list[Message]:
        config = self.config
        if config.messages_column is not None:
            # Chat templates read role and content; a struct column fills keys a message lacks
            # with None, which some templates would render.
            messages = [{"role": m["role"], "content": m["content"]} for m in columns[config.messages_column]]
            if config.system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": config.system_prompt})
            return messages
        text = self._format(columns, row_number) if config.template is not None else columns[config.text_column]
        if config.system_prompt is not None:
            return [{"role": "system", "content": config.system_prompt}, {"role": "user", "content": text}]
        return text

    def _format(self, columns: dict[str, Any], row_number: int) -> str:
        template = self.config.template
        assert template is not None  # _prompt formats only with a template
        try:
            return template.format_map(columns)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise ConfigError(
                f"data.template ({self.config.template!r}) cannot format row {row_number} of {self.where}: "
                f"{type(error).__name__}: {error}. Fix the template's format specs or indices to fit every row's "
                "values (e.g. '{n}' rather than '{n:03d}' for a text column); set --data.template."
            ) from error

    def _answer(self, columns: dict[str, Any]) -> str | None:
        if self.config.answer_column is None:
            return None
        answer = columns[self.config.answer_column]
        return answer if isinstance(answer, str) else str(answer)

    def _fits(self, row: Row) -> bool:
        limit = self.length_limit
        if limit is None:
            return True
        if row.row_number in self._too_long:
            return False
        tokens = limit.count_tokens(row.prompt)
        if tokens <= limit.max_prompt_tokens:
            return True
        self._too_long[row.row_number] = tokens
        if self.config.too_long == "refuse":
            raise ConfigError(self._too_long_message([row.row_number]))
        return False

    def _too_long_message(self, rows: list[int]) -> str:
        limit = self.length_limit
        assert limit is not None  # a row counts as too long only against a limit
        shown = ", ".join(f"{row} ({self._too_long[row]} tokens)" for row in rows[:_SHOWN_ROWS])
        more = f" and {len(rows) - _SHOWN_ROWS} more" if len(rows) > _SHOWN_ROWS else ""
        return (
            f"{len(rows)} row(s) of {self.where} have a prompt longer than max_model_len ({limit.max_model_len}) minus "
            f"generator.max_new_tokens ({limit.max_new_tokens}) = {limit.max_prompt_tokens} tokens: row(s) "
            f"{shown}{more}, and data.too_long is refuse. Set --data.too-long skip to train without them, lower "
            "--generator.max-new-tokens, shorten those prompts, or use a model with a longer context."
        )
