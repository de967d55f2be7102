"""Recipes by name: `forge-rl grpo` and the benchmarks run the recipe registered as "grpo".

A recipe is an `async def run(config) -> dict` (the summary) that a package registers under the
entry-point group "forge_rl.recipes" (pyproject.toml). forge_rl's own recipes live in apps/, on top
of the library, which never imports them: it finds them here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any

GROUP = "forge_rl.recipes"


def recipe(name: str) -> Callable[[Any], Awaitable[dict]]:
    """The `run` function of the recipe registered as `name`."""
    found = entry_points(group=GROUP, name=name)
    if not found:
        registered = sorted(ep.name for ep in entry_points(group=GROUP))
        raise LookupError(
            f"no recipe {name!r} is registered (entry-point group {GROUP!r} has {registered}). "
            "Reinstall forge_rl (`make venv`, or `pip install -e .`) so its recipes are registered."
        )
    return next(iter(found)).load()
