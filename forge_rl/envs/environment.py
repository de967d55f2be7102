"""The environment interface: what a multi-turn episode is played against.

An environment is a core object: plain async Python, no Monarch, no vLLM. One instance plays one
episode; the rollout shell runs many of them concurrently beside the generators.

    observation = await env.reset()            # the prompt: raw text or chat messages
    while True:
        turn_text = <the model's next turn, sampled after everything so far>
        result = await env.step(turn_text)     # StepResult
        if result.done:                        # result.final_reward closes the episode
            break
        observation = result.observation       # tool output, the other player's move, ...

`forge_rl.envs.runner` plays this loop with the episode's limits and timeouts and records the
tokens; an environment never sees a token id, only text. A turn that does not follow the
environment's format is reported by raising `MalformedTurn` with the observation that tells the
model what was wrong (the runner shows it and counts it); any other exception, or a call that runs
past its timeout, ends the episode as an environment failure, never trained.

Example (`forge_rl.envs.calculator`, plain text for the tiny models):

    await env.reset()        -> "37*52="
    await env.step("C37*52") -> StepResult(observation="R1924=")
    await env.step("1924")   -> StepResult(done=True, final_reward=1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """A function call the model wrote in an assistant turn, as the OpenAI schema carries it:
    `arguments` is the JSON text of the arguments object (`forge_rl.envs.tool_calls` reads it out
    of the sampled text)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        """{"id", "type": "function", "function": {"name", "arguments"}}: the OpenAI message field."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    """One chat message. Roles are the chat template's: "system", "user", "assistant", and "tool"
    where the template knows it. An assistant message may carry the tool calls it made (its content
    then often empty); a tool message answers the call `tool_call_id` names."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


Observation = str | list[Message]
"""What the model reads next: raw text (the tiny models' plain format), or chat messages. Raw text
given to a chat template is one user message."""


def as_messages(observation: Observation) -> list[Message]:
    """The observation as chat messages (raw text becomes one user message)."""
    if isinstance(observation, str):
        return [Message("user", observation)]
    return list(observation)


@dataclass(frozen=True)
class StepResult:
    """What `Environment.step` returns: either the next observation, or the end of the episode."""

    observation: Observation = ""
    """What the model reads before its next turn; unused when done."""
    turn_reward: float | None = None
    """Reward of this turn alone (a process reward), or None. Optional, and kept apart from
    final_reward: how per-turn rewards become per-token advantages is the loss's choice."""
    done: bool = False
    """The episode is over; final_reward is its outcome."""
    final_reward: float | None = None
    """The reward that closes the episode: required when done, and only then."""

    def __post_init__(self) -> None:
        if self.done != (self.final_reward is not None):
            raise ValueError(
                f"StepResult(done={self.done}, final_reward={self.final_reward}): an episode closes with "
                "done=True and its final_reward (0.0 for a failure), and only then has one. Set both or neither."
            )
        for name in ("turn_reward", "final_reward"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"StepResult.{name} ({value}) must be finite: it becomes an advantage.")


class MalformedTurn(Exception):
    """Raised by `Environment.step` when the model's turn breaks the environment's format (a tool
    call that does not parse, an unknown tool). Not a failure of the environment: `observation`
    (the exception's argument) is shown to the model as the answer to its turn, and after
    `EpisodeLimits.max_malformed_turns` of them the episode ends as PARSE_ERROR."""

    def __init__(self, observation: Observation):
        super().__init__(observation)
        self.observation = observation


class Environment(Protocol):
    """One episode's world. Both methods are coroutines: an environment that waits (a tool, a
    sandbox, a remote service) awaits, so that other episodes decode meanwhile. Blocking code in
    them stalls every episode of the process and cannot be timed out: run it with
    asyncio.to_thread, or in the sandbox (`forge_rl.envs.sandbox`) if it is untrusted.

    Optional: an environment whose step may legitimately take long (it starts a sandbox, runs a
    test suite) says how long with a `max_step_s` attribute; the rollout refuses limits whose
    env_step_timeout_s would cut such a step short (`forge_rl.envs.rollout`), since the timeout
    would kill the sandbox mid-run and blame the environment. One whose reset and step depend on
    nothing but (seed, index) and the turns it is given says so with `replayable = True`: branch
    rollouts may then fork its episodes by replaying their turns (`forge_rl.envs.forks`)."""

    async def reset(self) -> Observation:
        """The first observation: the prompt."""
        ...

    async def step(self, turn_text: str) -> StepResult:
        """Take the model's turn (its text, special tokens removed); say what follows."""
        ...
