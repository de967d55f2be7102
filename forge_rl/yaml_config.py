"""Strict YAML loading onto frozen config dataclasses.

An unknown key, a wrong type or a bad literal is an error naming the dotted field and the file, so a
typo in a config fails before anything expensive starts instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from forge_rl.errors import ConfigError

T = TypeVar("T")


def load_yaml_config(cls: type[T], path: Path) -> T:
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
    try:
        return build_dataclass(cls, data, prefix="")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


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
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


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
                f"or set {_flag(field)}."
            )
        return value
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{field} must be a mapping of its fields, got {value!r}")
        return build_dataclass(annotation, value, prefix=field + ".")
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
            f"{field} must be {annotation.__name__}, got {value!r}. Fix it in the file or set {_flag(field)}."
        )
    return value


def _flag(field: str) -> str:
    """The command-line flag of a dotted config field: trainer.num_procs -> --trainer.num-procs."""
    return "--" + field.replace("_", "-")
