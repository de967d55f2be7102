"""Reward functions by name: `task.reward` picks one, the scorer runs it in worker processes.

A reward function takes (completion_text, answer) and returns a float. `task.reward` is either a
registered name (below) or an import path "package.module:function" for a function of your own;
either way it is resolved when the config is built, so a typo fails before anything starts.

    task:
      reward: leading_number              # built in (also exact_match, reasoning_gym)
      reward: my_project.verifiers:math   # yours; importable in every process of the run
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from forge_rl.tasks.reasoning_gym import reasoning_gym_reward
from forge_rl.tasks.synthetic import leading_number_reward
from forge_rl.errors import ConfigError

RewardFn = Callable[[str, str], float]


def exact_match_reward(completion_text: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer."""
    return 1.0 if completion_text.strip() == answer else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "leading_number": leading_number_reward,
    "exact_match": exact_match_reward,
    # The verifiers of reasoning-gym (optional extra), for task.name "reasoning_gym" only.
    "reasoning_gym": reasoning_gym_reward,
}


def resolve_reward_fn(spec: str) -> RewardFn:
    """The reward function `spec` names; ConfigError naming the fix when there is none."""
    if ":" in spec:
        reward_fn = import_function(spec, "task.reward")
    elif spec in REWARD_FUNCTIONS:
        reward_fn = REWARD_FUNCTIONS[spec]
    else:
        raise ConfigError(
            f"task.reward ({spec!r}) is not a registered reward function. Set --task.reward to one of "
            f"{', '.join(sorted(REWARD_FUNCTIONS))}, or to 'package.module:function' for your own."
        )
    try:
        inspect.signature(reward_fn).bind("completion", "answer")
    except TypeError:
        raise ConfigError(
            f"task.reward ({spec!r}) must accept (completion_text, answer); its signature is "
            f"{inspect.signature(reward_fn)}. Wrap it in a two-argument function."
        ) from None
    except ValueError:  # builtins without a signature: accepted, checked when called
        pass
    return reward_fn


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
