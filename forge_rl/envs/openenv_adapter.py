"""OpenEnv environments (`openenv`, formerly `openenv-core`; https://github.com/meta-pytorch/OpenEnv)
as forge_rl environments, in process and offline.

An OpenEnv environment is a Gym-style server object (`openenv.core.env_server.interfaces.Environment`:
`reset() -> Observation`, `step(Action) -> Observation`, each observation carrying `reward` and
`done`), usually served over HTTP or WebSocket from a container. forge_rl runs the same object in
the rollout's process instead: no container, no server, no socket, so an episode costs what the
environment's own code costs and nothing can time out on a network. What the adapter needs from
the user is the two conversions OpenEnv leaves to the agent:

    action(turn_text) -> Action               the model's turn as the environment's Action
    observation_text(Observation) -> text     what the model reads next (default: the observation's
                                              fields other than reward, done and metadata)

Rewards: OpenEnv gives a reward with every observation; the adapter sums them into the episode's
return, which is the trajectory's final reward (per-turn rewards are left unset: GRPO ranks the
group's returns). An environment that never sets `done` (the echo environment) is closed after
`max_steps` steps, or by the episode's max_turns (TRUNCATED_TURNS, no reward: set max_steps below
max_turns). An Action that the turn cannot become (pydantic rejects it) is a malformed turn: the
model is shown why (`MalformedTurn`). Environments that override `reset_async`/`step_async` are
awaited; others run in a worker thread, so a slow step never blocks other episodes' decoding.

    make_env = lambda seed, index: OpenEnvEnvironment(MyEnvironment(), action=lambda text: MyAction(text=text))

`openenv_echo_env` plays OpenEnv's own echo environment, the one `openenv init` writes, unmodified
(configs/grpo_openenv_echo_tiny_cpu.yaml).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge_rl.envs.environment import MalformedTurn, Observation, StepResult

_NOT_SHOWN = {"reward", "done", "metadata"}


def observation_fields(observation: Any) -> str:
    """The default text of an OpenEnv observation: its one text field, or its fields as JSON."""
    fields = {k: v for k, v in observation.model_dump().items() if k not in _NOT_SHOWN}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(fields) == 1 and texts else json.dumps(fields, sort_keys=True)


class OpenEnvEnvironment:
    """An OpenEnv `Environment` instance as a forge_rl Environment (module docstring)."""

    def __init__(
        self,
        env: Any,
        action: Callable[[str], Any],
        observation_text: Callable[[Any], Observation] = observation_fields,
        max_steps: int | None = None,
    ):
        from openenv.core.env_server.interfaces import Environment as OpenEnvBase

        if not isinstance(env, OpenEnvBase):
            raise TypeError(f"{type(env).__name__} is not an openenv.core.env_server.interfaces.Environment")
        self.env, self.action, self.observation_text, self.max_steps = env, action, observation_text, max_steps
        cls = type(env)
        self._async_reset = cls.reset_async is not OpenEnvBase.reset_async
        self._async_step = cls.step_async is not OpenEnvBase.step_async
        self.episode_return = 0.0
        self.num_steps = 0

    async def reset(self) -> Observation:
        self.episode_return, self.num_steps = 0.0, 0
        observation = await (self.env.reset_async() if self._async_reset else asyncio.to_thread(self.env.reset))
        return self.observation_text(observation)

    async def step(self, turn_text: str) -> StepResult:
        from pydantic import ValidationError

        try:
            action = self.action(turn_text)
        except ValidationError as invalid:
            raise MalformedTurn(f"not a valid action: {invalid.errors()[0]['msg']}") from invalid
        observation = await (
            self.env.step_async(action) if self._async_step else asyncio.to_thread(self.env.step, action)
        )
        self.num_steps += 1
        self.episode_return += float(observation.reward or 0.0)
        if observation.done or (self.max_steps is not None and self.num_steps >= self.max_steps):
            return StepResult(done=True, final_reward=self.episode_return)
        return StepResult(observation=self.observation_text(observation))


def openenv_echo_env(seed: int, index: int) -> OpenEnvEnvironment:
    """OpenEnv's echo environment as `openenv init` writes it (unmodified), for the tiny models'
    plain format: the model's turn is the message, the echo (upper-cased, kept to the tiny
    tokenizer's alphabet) is what it reads next, and 0.1 per character echoed is the reward
    (the environment's own). It never ends an episode itself: the adapter closes it after 3 steps."""
    from forge_rl.tasks.tokenizer import ALPHABET

    environment_class, action_class = _echo_env_classes()

    def spellable(observation) -> str:
        return "".join(c for c in observation.echoed_message.upper() if c in ALPHABET) + "="

    return OpenEnvEnvironment(environment_class(), lambda text: action_class(message=text), spellable, max_steps=3)


@functools.cache
def _echo_env_classes() -> tuple[type, type]:
    """EchoEnvironment and EchoAction from the package `openenv init echo_env` writes: once per
    process, into a temporary directory (OpenEnv ships the echo environment as its `init` template)."""
    directory = Path(tempfile.mkdtemp(prefix="forge_rl_openenv_"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # imported by then: only the files go
    # The `init` command itself (openenv.cli.commands.init), not `python -m openenv.cli`: the CLI's
    # entry point imports every command, some of them MCP server code that `init` does not need.
    init = "import sys; from openenv.cli.commands.init import init; init(sys.argv[1], output_dir=sys.argv[2])"
    command = [sys.executable, "-c", init, "echo_env", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if not (directory / "echo_env" / "server" / "echo_env_environment.py").is_file():
        raise RuntimeError(
            f"`{' '.join(command)}` did not write the echo environment:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    sys.path.insert(0, str(directory))
    from echo_env.models import EchoAction
    from echo_env.server.echo_env_environment import EchoEnvironment

    return EchoEnvironment, EchoAction
