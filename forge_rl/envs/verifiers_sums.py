"""A small verifiers environment written as a verifiers user writes one, with verifiers' own
classes (`vf.TaskData`, `vf.Task` with a `@vf.reward`, `vf.Taskset`) and no dataset download:
sums of two digits for the tiny models ("3+4=" -> "7", reward 1.0 when the reply is the sum).
Imported only when a run names it (`sums_environment`): it needs `verifiers`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

import verifiers.v1 as vf

from forge_rl.envs.verifiers_adapter import verifiers_environment

__all__ = ["SumsTaskset"]  # what verifiers loads a taskset id (this module's path) by

NUM_TASKS = 100


class SumsData(vf.TaskData):
    answer: str = ""


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)


class SumsTasksetConfig(vf.TasksetConfig):
    seed: int = 0


class SumsTaskset(vf.Taskset[SumsTask, SumsTasksetConfig]):
    def load(self) -> Iterator[SumsTask]:
        rng = random.Random(self.config.seed)
        for _ in range(NUM_TASKS):
            a, b = rng.randrange(10), rng.randrange(10)
            yield SumsTask(SumsData(prompt=f"{a}+{b}=", answer=str(a + b)))


@functools.cache
def make_sums_environment(seed: int):
    """make_env(seed, index) over the taskset of `seed` (built once per seed)."""
    return verifiers_environment(SumsTaskset(SumsTasksetConfig(seed=seed)))


def sums_environment(seed: int, index: int):
    """A small verifiers environment for the tiny models, built with verifiers' own classes:
    "3+4=" answered "7"."""
    return make_sums_environment(seed)(seed, index)
