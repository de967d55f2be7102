"""verifiers' own user-sim env (a modeled user and the assistant, two seats) over the small sums
taskset, as an environment factory a run names (`environment.name:
tests.support.verifiers_seats:user_sim_sums`). The persona is the bare scenario and the
user's turns are capped at two, for a tiny model's short context."""

from __future__ import annotations

import functools
import sys

import forge_rl.envs.verifiers_sums as verifiers_sums
from forge_rl.envs.verifiers_adapter import verifiers_env_environment

TASKSET_ID = "forge_rl_verifiers_sums"
"""verifiers loads a taskset by the name of a top-level module exporting it; the sums taskset
lives in forge_rl's package, so it is named under a top-level alias."""


@functools.cache
def _make_env():
    import verifiers.v1 as vf
    from verifiers.v1.envs.user_sim.env import UserSimEnv, UserSimEnvConfig

    sys.modules.setdefault(TASKSET_ID, verifiers_sums)
    config = UserSimEnvConfig(
        taskset=verifiers_sums.SumsTasksetConfig(id=TASKSET_ID, seed=0),
        persona="{scenario}",
        done_marker="DONE",
        user=vf.AgentConfig(harness={"id": "null"}, max_turns=2),
    )
    return verifiers_env_environment(UserSimEnv(config))


def user_sim_sums(seed: int, index: int):
    return _make_env()(seed, index)
