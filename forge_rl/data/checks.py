"""The checks a data file passes when its source opens, so bad data stops a run before anything
expensive starts instead of when its row comes up: every column the config names exists, and no
row's prompt, template column, messages or answer is null or of the wrong kind. They read Arrow's
types and null counts and run vectorised over the memory-mapped columns: no row becomes a Python
object unless it is the one an error names. Rows are numbered from 0 in storage order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import datasets
import numpy
import pyarrow
import pyarrow.compute as pc

from forge_rl.errors import ConfigError

if TYPE_CHECKING:
    from forge_rl.data.config import DataConfig

ROLES = ("system", "user", "assistant", "tool")
"""The roles a prompt's chat message may have."""
_MESSAGES_SHAPE = 'a list of {"role": ..., "content": ...} objects, e.g. [{"role": "user", "content": "2+3?"}]'


def check_columns(dataset: datasets.Dataset, config: DataConfig, where: str) -> None:
    """Refuse `dataset` (described by `where`) unless every row gives a prompt and, when
    `answer_column` is set, an answer."""
    if dataset.num_rows == 0:
        raise ConfigError(
            f"{where} has no rows: there is nothing to train on. Add rows, or point --data.path (and "
            "--data.split) at data that has them."
        )
    for field, column in _named_columns(config):
        if column not in dataset.column_names:
            raise ConfigError(
                f"{field} ({column!r}) is not a column of {where}; its columns are: "
                f"{', '.join(map(repr, dataset.column_names))}. Set --{_flag(field)} to one of them."
            )
    if config.messages_column is not None:
        _check_messages(dataset, config.messages_column, where)
    elif config.template is None:
        _check_text(dataset, config.text_column, "data.prompt_column", where)
    for column in config.template_columns:
        _check_not_null(dataset, column, f"template column {column!r} (data.template)", where)
    if config.answer_column is not None:
        _check_answers(dataset, config.answer_column, where)


def _named_columns(config: DataConfig) -> list[tuple[str, str]]:
    named = [("data.answer_column", config.answer_column)]
    if config.messages_column is not None:
        named.append(("data.messages_column", config.messages_column))
    elif config.template is not None:
        named += [("data.template", column) for column in config.template_columns]
    else:
        named.append(("data.prompt_column", config.text_column))
    return [(field, column) for field, column in named if column is not None]


def _check_text(dataset: datasets.Dataset, column: str, field: str, where: str) -> None:
    feature = dataset.features[column]
    if isinstance(feature, datasets.Json):  # JSON rows whose values differ in kind
        row, value = _first_row(dataset, column, lambda value: not isinstance(value, str))
        if row is not None:
            raise ConfigError(
                f"row {row} of {where} has {field} {column!r} = {_shown(value)} ({type(value).__name__}), and a "
                f"prompt must be text. Fix that row (and any like it), or set --data.template '{{{column}}}' "
                "to format every value as text."
            )
        return
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        hint = (
            f"If it holds chat messages, set --data.messages-column {column} instead."
            if _is_list(dataset, column)
            else f"Set --data.template '{{{column}}}' to format its values as text, or point --{_flag(field)} "
            "at a text column."
        )
        raise ConfigError(
            f"{field} ({column!r}) of {where} holds {feature} values (row 0: {_shown(dataset[0][column])}), "
            f"and a prompt must be text. {hint}"
        )
    _check_not_null(dataset, column, f"{field} {column!r}", where)


def _check_not_null(dataset: datasets.Dataset, column: str, what: str, where: str) -> None:
    values = dataset.data.column(column)
    if values.null_count:
        first = pc.index(pc.is_null(values), True).as_py()
        raise ConfigError(
            f"row {first} of {where} has no value (null) in {what}, and {values.null_count} row(s) in all do. "
            "Drop those rows or fill them in."
        )


def _check_answers(dataset: datasets.Dataset, column: str, where: str) -> None:
    type_ = dataset.data.schema.field(column).type
    if not (pyarrow.types.is_string(type_) or pyarrow.types.is_large_string(type_) or _is_scalar(type_)):
        raise ConfigError(
            f"data.answer_column ({column!r}) of {where} holds {dataset.features[column]} values (row 0: "
            f"{_shown(dataset[0][column])}); an answer must be text or a number. Point --data.answer-column at "
            "such a column (a reward that reads other columns gets every column of the row by name)."
        )
    _check_not_null(dataset, column, f"data.answer_column {column!r}", where)


def _check_messages(dataset: datasets.Dataset, column: str, where: str) -> None:
    if not _messages_type(dataset.data.schema.field(column).type):
        # Messages whose keys differ from row to row reach Arrow as JSON values, not one struct
        # type: check those rows one by one, decoded.
        row, value = _first_row(dataset, column, lambda value: _message_problem(value) is not None)
        if row is not None:
            problem = _message_problem(value)
            assert problem is not None  # _first_row picked this row because it has a problem
            _refuse_row(dataset, column, where, row, problem)
        return
    messages = dataset.data.column(column)
    lengths = pc.fill_null(pc.list_value_length(messages), 0)
    _refuse_first(dataset, column, where, pc.is_null(messages), "no messages (null)")
    _refuse_first(dataset, column, where, pc.equal(lengths, 0), "an empty list of messages")
    flat = pc.list_flatten(messages)
    roles, contents = pc.struct_field(flat, "role"), pc.struct_field(flat, "content")
    bad_role = pc.invert(pc.fill_null(pc.is_in(roles, value_set=pyarrow.array(ROLES)), False))
    ends = numpy.cumsum(lengths.to_numpy())
    for mask, what in (
        (pc.is_null(flat), "a null message"),
        (bad_role, f"a role outside {', '.join(ROLES)}"),
        (pc.is_null(contents), "a message whose content is null"),
    ):
        _refuse_first(dataset, column, where, mask, what, ends)


def _message_problem(value: Any) -> str | None:
    """What is wrong with one row's decoded messages, or None."""
    if value is None:
        return "no messages (null)"
    if not isinstance(value, list):
        return f"a {type(value).__name__}, not a list of messages,"
    if not value:
        return "an empty list of messages"
    for message in value:
        if not isinstance(message, dict):
            return f"a message that is a {type(message).__name__}, not an object,"
        if message.get("role") not in ROLES:
            return f"a role outside {', '.join(ROLES)}"
        if message.get("content") is None:
            return "a message whose content is null"
        if not isinstance(message["content"], str):
            return "a message whose content is not text"
    return None


def _refuse_row(dataset: datasets.Dataset, column: str, where: str, row: int, what: str) -> None:
    raise ConfigError(
        f"row {row} of {where} has {what} in data.messages_column ({column!r}): {_shown(dataset[row][column])}. "
        f"Each row's value must be {_MESSAGES_SHAPE}, roles among {', '.join(ROLES)}. Fix or drop that row "
        "(and any like it), or use --data.prompt-column for a text column."
    )


def _refuse_first(
    dataset: datasets.Dataset, column: str, where: str, mask: Any, what: str, ends: numpy.ndarray | None = None
) -> None:
    """Raise naming the first row where `mask` holds (per row, or per message when `ends`, the
    running total of messages per row, maps a message back to its row)."""
    if not pc.any(mask).as_py():
        return
    first = pc.index(mask, True).as_py()
    _refuse_row(
        dataset, column, where, first if ends is None else int(numpy.searchsorted(ends, first, side="right")), what
    )


def _first_row(dataset: datasets.Dataset, column: str, bad) -> tuple[int | None, Any]:
    """The first row whose decoded value is `bad`, read in batches (only on a way to an error)."""
    start = 0
    for batch in dataset.select_columns([column]).iter(batch_size=1024):
        for offset, value in enumerate(batch[column]):
            if bad(value):
                return start + offset, value
        start += len(batch[column])
    return None, None


def _messages_type(type_: pyarrow.DataType) -> bool:
    if not (pyarrow.types.is_list(type_) or pyarrow.types.is_large_list(type_)):
        return False
    item = type_.value_type
    if not pyarrow.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(
        name in names and (pyarrow.types.is_string(names[name]) or pyarrow.types.is_large_string(names[name]))
        for name in ("role", "content")
    )


def _is_list(dataset: datasets.Dataset, column: str) -> bool:
    type_ = dataset.data.schema.field(column).type
    return pyarrow.types.is_list(type_) or pyarrow.types.is_large_list(type_)


def _is_scalar(type_: pyarrow.DataType) -> bool:
    return pyarrow.types.is_integer(type_) or pyarrow.types.is_floating(type_) or pyarrow.types.is_boolean(type_)


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flag(field: str) -> str:
    return field.replace("_", "-")
