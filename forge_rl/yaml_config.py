"""Strict YAML loading onto frozen config dataclasses.

An unknown key, a wrong type or a bad literal is an error naming the dotted field and the file, so a
typo in a config fails before anything expensive starts instead of being silently ignored.

`load_yaml_config(..., checked=False)` still checks keys, types and literals, but builds the
dataclasses without running their `__post_init__` checks: the file's values as defaults under
command-line flags (`forge_rl.cli.parse_config`), where a flag may fix what the file alone gets wrong
(`--model.path` on a machine where the file's model directory does not exist) and tyro builds the
whole config again, every check included.
"""

from __future__ import annotations

import contextvars
import dataclasses
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, cast

import yaml

from forge_rl.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("forge_rl_yaml_checked", default=True)


def load_yaml_config(cls: type[T], path: Path, checked: bool = True) -> T:
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {what}. Pass an existing YAML file to --config.")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error_message(path, text, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config fields, got {type(data).__name__}")
    token = _CHECKED.set(checked)
    try:
        return build_dataclass(cls, data, prefix="")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    finally:
        _CHECKED.reset(token)


def _yaml_error_message(path: Path, text: str, error: yaml.YAMLError) -> str:
    """Where the YAML breaks, in the file's own line and column numbers, and how to fix it."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    lines = text.splitlines()
    line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
    hint = (
        " YAML indents with spaces only: replace the tab(s)."
        if "\t" in line or "\t" in problem
        else " Fix the syntax there (mappings are `key: value`, nested ones indented with spaces)."
    )
    return f"{path} is not valid YAML: {problem}{where}: {line.strip()!r}.{hint}"


def build_dataclass(cls: type[T], data: dict[str, Any], prefix: str) -> T:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: {', '.join(sorted(known))}"
        )
    kwargs = {name: _convert(hints[name], value, prefix + name) for name, value in data.items()}
    if not _CHECKED.get():
        return _unchecked(cls, kwargs, prefix)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _unchecked(cls: type[T], kwargs: dict[str, Any], prefix: str) -> T:
    """`cls` with `kwargs` and its other fields' defaults, its `__post_init__` not run (module docstring)."""
    instance = object.__new__(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name in kwargs:
            value = kwargs[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            raise ConfigError(
                f"{prefix}{field.name} is required. Set it in the file or with {flag(prefix + field.name)}."
            )
        object.__setattr__(instance, field.name, value)
    return instance


def _convert(annotation: Any, value: Any, field: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(option, value, field)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(
                f"{field} ({value!r}) must be one of {', '.join(map(repr, allowed))}. Fix it in the file "
                f"or set {flag(field)}."
            )
        return value
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{field} must be a list, got {value!r}. Fix it in the file.")
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of X
            return tuple(_convert(args[0], item, f"{field}[{i}]") for i, item in enumerate(value))
        return tuple(value)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{field} must be a mapping of its fields, got {value!r}")
        # An annotation is a class: is_dataclass narrows it to an instance or a class.
        return build_dataclass(cast("type[DataclassInstance]", annotation), value, prefix=field + ".")
    if annotation is Path:
        if not isinstance(value, str):
            raise ConfigError(f"{field} must be a path string, got {value!r}")
        return Path(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise ConfigError(
            f"{field} must be {annotation.__name__}, got {value!r}. Fix it in the file or set {flag(field)}."
        )
    return value


def flag(field: str) -> str:
    """The command-line flag of a dotted config field: trainer.num_procs -> --trainer.num-procs;
    an item of a list field as tyro names it: eval.sets[0].data -> --eval.sets.0.data."""
    return "--" + field.replace("[", ".").replace("]", "").replace("_", "-")
