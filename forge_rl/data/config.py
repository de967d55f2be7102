"""What data a run reads and how a row becomes a prompt (`DataConfig`), read by the source
(`forge_rl.data.files.FileSource`) and by the checks of the data (`forge_rl.data.checks`)."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from forge_rl.errors import ConfigError

TooLong = Literal["skip", "refuse"]


@dataclass(frozen=True)
class DataConfig:
    """Where a run's prompts come from when they come from data, and how a row becomes a prompt.

    A row's prompt is one of: the text of `prompt_column` (default "prompt"); `template` formatted
    over the row's columns; or the chat messages of `messages_column`. `system_prompt`, when set,
    makes it chat messages with that system message first."""

    path: str
    """A JSONL, JSON, Parquet, CSV or Arrow file; a directory of such files (splits named by file
    name, as `datasets` names them: train.jsonl, test.jsonl); or a directory written by
    `Dataset.save_to_disk` / `DatasetDict.save_to_disk`. A Hugging Face hub name ("org/name") loads
    from the hub where this machine reaches it and is refused offline (HF_DATASETS_OFFLINE)."""
    split: str = "train"
    """The split to read. A single file, or a saved `Dataset`, has one split: "train"."""
    prompt_column: str | None = None
    """Column holding each prompt's text. Unset, with `messages_column` and `template` unset too:
    "prompt" (TRL's name)."""
    messages_column: str | None = None
    """Column holding each prompt as chat messages, [{"role": ..., "content": ...}, ...] (roles
    system, user, assistant, tool); instead of `prompt_column` and `template`."""
    answer_column: str | None = None
    """Column holding each row's answer (text or a number), which a reward such as exact match or
    math_verify compares against; unset when the reward needs none. Every column reaches the reward
    by name either way."""
    system_prompt: str | None = None
    """A system message put before each prompt (which makes a text prompt chat messages); a row
    whose messages start with a system message of its own keeps that one."""
    template: str | None = None
    """A format string over the row's columns that builds the prompt text, e.g. "Solve: {question}"
    (str.format syntax: "{{" for a literal brace, "{n:03d}" for a format spec); instead of
    `prompt_column` and `messages_column`."""
    seed: int = 0
    """Seed of the order: epoch e reads the rows in the permutation of (seed, e)."""
    too_long: TooLong = "skip"
    """A row whose prompt tokens plus generator.max_new_tokens exceed the model's context: skip
    (skipped, counted, named by row number) or refuse (the run stops with the row named)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise ConfigError(
                f"data.path ({self.path!r}) is empty. Set --data.path to a JSONL, JSON, Parquet or CSV file, "
                "a directory of them, or a directory written by save_to_disk."
            )
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"data.split ({self.split!r}) is empty. Set --data.split (e.g. train).")
        for name in ("prompt_column", "messages_column", "answer_column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(
                    f"data.{name} ({value!r}) must be a column name. Set --data.{name.replace('_', '-')} or unset it."
                )
        chosen = [name for name in ("prompt_column", "messages_column", "template") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ConfigError(
                f"data.{chosen[0]} ({getattr(self, chosen[0])!r}) and data.{chosen[1]} ({getattr(self, chosen[1])!r}) "
                "are both set, and a prompt comes from one of them: a text column, a template over the columns "
                f"(which names its own), or a messages column. Unset --data.{chosen[1].replace('_', '-')}."
            )
        if self.template is not None:
            _template_columns(self.template)
        if self.system_prompt is not None and (not isinstance(self.system_prompt, str) or not self.system_prompt):
            raise ConfigError(
                f"data.system_prompt ({self.system_prompt!r}) would be an empty system message. Set "
                "--data.system-prompt to its text, or unset it."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"data.seed ({self.seed!r}) must be an integer. Set --data.seed.")
        if self.too_long not in ("skip", "refuse"):
            raise ConfigError(
                f"data.too_long ({self.too_long!r}) must be skip (drop rows whose prompt does not fit, counted and "
                "named) or refuse (stop the run at such a row). Set --data.too-long."
            )

    @property
    def text_column(self) -> str:
        """The column a text prompt is read from: `prompt_column`, else "prompt"."""
        return self.prompt_column if self.prompt_column is not None else "prompt"

    @property
    def template_columns(self) -> tuple[str, ...]:
        """The columns `template` names, in order of first use (none without a template)."""
        return _template_columns(self.template) if self.template is not None else ()


def _template_columns(template: str) -> tuple[str, ...]:
    """The column names a template's fields use ("{choices[0]}" uses choices), refusing a template
    str.format cannot parse, one with positional fields, and one that names no column."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ConfigError(
            f"data.template ({template!r}) is not a format string: {error}. Write columns as {{name}} and a "
            "literal brace as {{ or }}; set --data.template."
        ) from error
    columns = tuple(dict.fromkeys(name.split(".")[0].split("[")[0] for name in fields))
    if any(not column or column.isdigit() for column in columns):
        raise ConfigError(
            f"data.template ({template!r}) has a positional field ({{}} or {{0}}); fields name the row's columns, "
            "e.g. 'Solve: {question}'. Set --data.template."
        )
    if not columns:
        raise ConfigError(
            f"data.template ({template!r}) names no column, so every row would get the same prompt. Name the "
            "row's columns in braces, e.g. 'Solve: {question}'; set --data.template."
        )
    return columns
