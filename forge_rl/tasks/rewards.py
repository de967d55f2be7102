"""Reward functions by name: `task.reward` picks one, `task.rewards` several with weights; the
scorer runs each in worker processes.

A reward function takes the completion's text and the row's answer, and returns a float. It may
also read the row's other columns by name (the convention of TRL's reward functions): a parameter
after the first two is the column of that name, and `**columns` takes every column.

    def exact(completion, answer): ...                        # the two-argument form
    def graded(completion, answer, difficulty): ...           # column difficulty, required
    def hinted(completion, answer, hint=None): ...            # column hint where the data has one
    def anything(completion, answer, **columns): ...          # every column of the row

A named parameter without a default is a column the data must have: the preflight checks it against
the data file's columns before anything starts (`RewardColumns.check`). Only the columns a function
names travel to its worker process, so a wide row is not pickled for a reward that reads one column.

A spec is either a registered name (below) or an import path "package.module:function" for a
function of your own; either way it is resolved when the config is built, so a typo fails before
anything starts.

    task:
      reward: leading_number              # built in (also trailing_number, final_integer, exact_match, prefix_match, math_verify, reasoning_gym)
      reward: my_project.verifiers:math   # yours; importable in every process of the run
      rewards:                            # several, instead of reward: each spec with its weight
        math_verify: 1.0
        my_project.verifiers:format: 0.2
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forge_rl.errors import ConfigError
from forge_rl.tasks.reasoning_gym import reasoning_gym_reward
from forge_rl.tasks.synthetic import (
    final_integer_reward,
    leading_number_reward,
    prefix_match_reward,
    trailing_number_reward,
)

RewardFn = Callable[..., float]
"""reward_fn(completion_text, answer, **the columns it names) -> float."""


def exact_match_reward(completion_text: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer."""
    return 1.0 if completion_text.strip() == answer else 0.0


def math_verify_reward(completion_text: str, answer: str) -> float:
    """1.0 when Hugging Face math-verify finds the completion's answer mathematically equal to the
    row's: `verify(parse(answer), parse(completion_text))`, which reads LaTeX ("$\\frac{1}{2}$",
    "\\boxed{2}") and plain numbers and expressions ("0.5", "1/2"), so "\\frac{1}{2}" scores for
    answer "0.5". 0.0 when it does not, or when either side holds nothing it can parse."""
    from math_verify import parse, verify  # sympy is imported by the worker that scores, not by the config

    gold = parse(answer)
    return 1.0 if gold and verify(gold, parse(completion_text)) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "leading_number": leading_number_reward,
    "trailing_number": trailing_number_reward,
    "exact_match": exact_match_reward,
    "prefix_match": prefix_match_reward,
    "final_integer": final_integer_reward,
    "math_verify": math_verify_reward,
    # The verifiers of reasoning-gym (optional extra), for task.name "reasoning_gym" only.
    "reasoning_gym": reasoning_gym_reward,
}


@dataclass(frozen=True)
class RewardColumns:
    """The row columns a reward function reads, from its signature."""

    required: tuple[str, ...] = ()
    """Named parameters without a default: columns every row must have."""
    optional: tuple[str, ...] = ()
    """Named parameters with a default: passed where the row has the column."""
    every: bool = False
    """It takes `**columns`: every column of the row."""
    positional: tuple[str, ...] = ()
    """The names of its first two parameters, which take (completion_text, answer): a column of the
    same name is not passed again by name."""

    @property
    def any(self) -> bool:
        return self.every or bool(self.required or self.optional)

    def select(self, columns: Mapping[str, Any] | None) -> dict[str, Any]:
        """The part of a row's `columns` (None: a task's prompt, which has none) this function reads."""
        if not columns or not self.any:
            return {}
        if self.every:
            return {name: value for name, value in columns.items() if name not in self.positional}
        return {name: columns[name] for name in (*self.required, *self.optional) if name in columns}

    def check(self, spec: str, field: str, present: Sequence[str], where: str) -> None:
        """ConfigError naming the function, each parameter the data lacks, the columns present and
        the fix, unless every required column is among `present` (the columns of `where`)."""
        missing = [name for name in self.required if name not in present]
        if missing:
            names = ", ".join(map(repr, missing))
            raise ConfigError(
                f"{field} {spec!r} has parameter(s) {names}, which it reads as column(s) of each row, and {where} "
                f"has no such column; its columns are: {', '.join(map(repr, present)) or 'none'}. Rename the "
                f"parameter(s) to column(s) the data has, give them a default (e.g. {missing[0]}=None) to read them "
                "only where present, or add the column(s) to the data."
            )


def reward_name(spec: str) -> str:
    """What a reward is called in metrics (`reward/components/<name>`): a registered name as it is,
    "package.module:function" by its function's name."""
    return spec.rpartition(":")[2] if ":" in spec else spec


def resolve_reward_fn(spec: str, field: str = "task.reward") -> RewardFn:
    """The reward function `spec` names; ConfigError naming `field` and the fix when there is none,
    or when its signature cannot take (completion, answer, **columns by name)."""
    flag = "--" + field.replace("_", "-")
    if ":" in spec:
        reward_fn = import_function(spec, field)
    elif spec in REWARD_FUNCTIONS:
        reward_fn = REWARD_FUNCTIONS[spec]
    else:
        raise ConfigError(
            f"{field} ({spec!r}) is not a registered reward function. Set {flag} to one of "
            f"{', '.join(sorted(REWARD_FUNCTIONS))}, or to 'package.module:function' for your own."
        )
    reward_columns(reward_fn, spec, field)
    return reward_fn


def reward_columns(reward_fn: RewardFn, spec: str = "", field: str = "task.reward") -> RewardColumns:
    """The columns `reward_fn` reads (module docstring). ConfigError when its first two parameters
    cannot take (completion_text, answer) positionally, or a further required parameter cannot be
    passed by name."""
    try:
        parameters = list(inspect.signature(reward_fn).parameters.values())
    except ValueError:  # builtins without a signature: taken as the two-argument form, checked when called
        return RewardColumns()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes_varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters)
    leading = [p for p in parameters if p.kind in positional][:2]
    if len(leading) < 2 and not takes_varargs:
        raise ConfigError(
            f"{field} ({spec!r}) must accept (completion_text, answer) as its first two arguments; its signature "
            f"is {inspect.signature(reward_fn)}. Give the function set in {'--' + field.replace('_', '-')} those two "
            "parameters first, e.g. def f(completion, answer, **columns)."
        )
    required, optional, every = [], [], False
    for parameter in parameters:
        if parameter in leading or parameter.kind == inspect.Parameter.VAR_POSITIONAL:
            continue
        if parameter.kind == inspect.Parameter.VAR_KEYWORD:
            every = True
        elif parameter.default is not inspect.Parameter.empty:
            optional.append(parameter.name)
        elif parameter.kind == inspect.Parameter.POSITIONAL_ONLY:
            raise ConfigError(
                f"{field} ({spec!r}) has a positional-only parameter {parameter.name!r} after (completion_text, "
                f"answer); columns are passed by name. Make it a normal parameter: {inspect.signature(reward_fn)} "
                "without the '/'."
            )
        else:
            required.append(parameter.name)
    return RewardColumns(tuple(required), tuple(optional), every, tuple(p.name for p in leading))


def import_function(spec: str, field: str):
    """The function `spec` ("package.module:function") names; ConfigError naming `field` (the
    config field that holds it, e.g. "task.reward") and the fix when there is none."""
    module_name, _, attribute = spec.partition(":")
    flag = "--" + field.replace("_", "-")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or anything the module raises while importing
        raise ConfigError(
            f"{field} ({spec!r}): module {module_name!r} cannot be imported ({type(e).__name__}: {e}). "
            "Make it importable (installed, or on PYTHONPATH) in every process of the run."
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(
            f"{field} ({spec!r}): module {module_name!r} has no function {attribute!r}. "
            f"Set {flag} to 'package.module:function'."
        )
    return function
