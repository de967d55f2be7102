"""Episode graphs: several agents in one episode (self-play, proposer/solver, debate, a team).

An episode is a directed graph of turns. Each node is one model turn of one agent; an edge from
turn m to turn n says that what turn n was shown (its observation) came from the environment's
answer to turn m. Every agent has a view of its own: one token sequence built turn by turn as in
`forge_rl.envs.trajectory` (token-in/token-out, never re-tokenized), so each agent's view is a
`Trajectory` and trains as one row. A single-agent episode is the graph of one agent (the seat
`agent`): `forge_rl.envs.runner` plays a plain `Environment` as exactly that, so single-turn
prompts, multi-turn episodes and multi-agent episodes share one runner and one path to the loss.

A multi-agent environment declares its seats (the roles: proposer, solver) and speaks to agents by
id: a seat's name, or "seat/k" for the k-th of several agents in one seat. It is called one call
at a time (the runner serializes reset, step and agent_ended), while the turns of different agents
are sampled concurrently:

    observations = await env.reset()                  # {"proposer": "P="}: who speaks first, and what they read
    result = await env.step("proposer", "37")         # GraphStep(observations={"solver/0": "M37=", ...})
    result = await env.step("solver/0", "7")          # GraphStep() : nothing new for anyone yet
    ...
    result = await env.step("solver/3", "7")          # GraphStep(done=True, rewards={"proposer": 0.75, "solver/0": 1.0, ...})

An agent given an observation samples its next turn after it; an agent given nothing waits. The
episode ends when a step says done, with a reward for every agent that took a turn. An agent that
reaches one of its own limits (turns, tokens, malformed turns) stops taking turns; the environment
is told through `agent_ended` (optional: without it the agent's end is silent), so that it can
score what is left or close the episode.

What ends an episode, beside `done`: an environment call that raises or runs past
env_step_timeout_s (ENV_ERROR, ENV_TIMEOUT: every agent's view is counted, never trained), an
observation for an agent of an undeclared seat or for one that has ended, a done without a reward
for an agent that spoke, and agents that all wait on each other (nobody has anything to answer and
the episode is not closed: the graph's waits form a cycle). Each is an ENV_ERROR naming what
happened. An agent whose turn is not sampled within its seat's turn_timeout_s ends the episode as
ENV_TIMEOUT: no agent of it is trained, and the episode is counted.

Credit (`forge_rl.core.advantages`): each agent's view is a completion of its episode's group
(the group_size episodes of one prompt), and advantages are taken per baseline group: the agents
of the same seat over the whole group (`baseline="group"`), or the agents of the same seat in the
same episode (`baseline="episode"`: a solver against the other solvers of the same proposed task).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from forge_rl.envs.environment import Observation
from forge_rl.envs.trajectory import Trajectory
from forge_rl.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import TypeIs

SINGLE_AGENT = "agent"
"""The one seat (and agent) of a single-agent episode."""


@dataclass(frozen=True)
class Seat:
    """A role of a multi-agent environment."""

    name: str
    """How the environment addresses its agents: `name` alone, or `name/k`."""
    trainable: bool = True
    """Whether its agents' turns reach a loss. False: they are played by the policy and kept in
    the episode (the environment's world), never trained (a modeled user, a fixed opponent)."""
    baseline: Literal["group", "episode"] = "group"
    """Whom an agent's reward is compared with for its advantage: the agents of this seat in every
    episode of the prompt's group ("group", GRPO's baseline), or those of the same episode
    ("episode": several agents in one seat answering the same thing)."""
    max_turns: int | None = None
    """Turns one agent of this seat may take; unset: environment.limits.max_turns."""
    turn_timeout_s: float | None = None
    """Seconds one turn of this seat may take to be sampled; past it the episode ends ENV_TIMEOUT
    (counted, never trained). Unset: no bound beyond the generator's own."""
    player: Callable[[Any, Observation], Awaitable[str]] | None = None
    """Agent code that plays this seat instead of one sampled turn per observation, written
    against the OpenAI API: `await player(client, observation)` with an `openai.AsyncOpenAI`
    served by the seat's policy (`forge_rl.envs.chat_client`) and the observation (text, or chat
    messages), returns the text of the agent's turn, which goes to `step`. It may call the model any number of times
    (reason, call tools, revise); its calls are the agent's view, trained as an agent environment's
    are. None: each observation is answered by one sampled turn."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(
                f"Seat name {self.name!r} must be non-empty and hold no '/': agents are addressed as 'seat' or 'seat/k'."
            )
        if self.baseline not in ("group", "episode"):
            raise ConfigError(f"Seat {self.name!r}: baseline {self.baseline!r} must be 'group' or 'episode'.")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError(f"Seat {self.name!r}: max_turns ({self.max_turns}) must be >= 1.")
        if self.turn_timeout_s is not None and not 0 < self.turn_timeout_s < math.inf:
            raise ConfigError(f"Seat {self.name!r}: turn_timeout_s ({self.turn_timeout_s}) must be > 0 and finite.")


@dataclass(frozen=True)
class GraphStep:
    """What a multi-agent environment's `step` (or `agent_ended`) returns."""

    observations: Mapping[str, Observation] = field(default_factory=dict)
    """Agent id -> what that agent reads next; each one named then takes a turn. An agent named for
    the first time starts its view with it (its prompt)."""
    turn_reward: float | None = None
    """Reward of the turn just stepped alone (a process reward), or None."""
    done: bool = False
    """The episode is over; `rewards` closes it."""
    rewards: Mapping[str, float] | None = None
    """Agent id -> final reward: required when done (every agent that took a turn), only then."""

    def __post_init__(self) -> None:
        if self.done != (self.rewards is not None):
            raise ValueError(
                f"GraphStep(done={self.done}, rewards={self.rewards}): an episode closes with done=True and a "
                "reward per agent that spoke, and only then has rewards. Set both or neither."
            )
        values = {"turn_reward": self.turn_reward, **{f"rewards[{a!r}]": r for a, r in (self.rewards or {}).items()}}
        for name, value in values.items():
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"GraphStep.{name} ({value!r}) must be a finite number: it becomes an advantage.")


class MultiAgentEnvironment(Protocol):
    """One episode's world, with several agents (module docstring). Coroutines, as `Environment`'s."""

    @property
    def seats(self) -> tuple[Seat, ...]:
        """Its roles; read only, so a class attribute (a dataclass's ClassVar) declares them as well."""
        ...

    async def reset(self) -> Mapping[str, Observation]:
        """Who speaks first, and what each of them reads: their prompts."""
        ...

    async def step(self, agent: str, turn_text: str) -> GraphStep:
        """Take `agent`'s turn (its text, special tokens removed); say what follows. May raise
        MalformedTurn, answered to that agent as `Environment.step`'s is."""
        ...


def is_multi_agent(env: object) -> TypeIs[MultiAgentEnvironment]:
    return getattr(env, "seats", None) is not None


def seat_of(agent: str) -> str:
    """The seat an agent id names: "solver/2" -> "solver"."""
    return agent.split("/", 1)[0]


def declared_seats(env: object) -> dict[str, Seat]:
    """The environment's seats by name; ConfigError when the declaration is malformed (no seat, a
    seat that is not a `Seat`, a name twice): no episode of it could be played."""
    seats = getattr(env, "seats", None)
    name = type(env).__name__
    if not seats or isinstance(seats, (str, Seat)):
        raise ConfigError(f"{name}.seats ({seats!r}) must be a non-empty tuple of forge_rl.envs.graph.Seat.")
    by_name: dict[str, Seat] = {}
    for seat in seats:
        if not isinstance(seat, Seat):
            raise ConfigError(f"{name}.seats holds {seat!r}, not a forge_rl.envs.graph.Seat.")
        if seat.name in by_name:
            raise ConfigError(f"{name}.seats declares the seat {seat.name!r} twice.")
        by_name[seat.name] = seat
    return by_name


@dataclass(frozen=True)
class TurnNode:
    """One model turn of an episode graph."""

    agent: str
    turn: int
    """Its index among the agent's turns (0 for the first)."""
    shown: tuple[int, ...]
    """Nodes whose environment steps produced what this turn read (the graph's edges into it: a
    malformed turn's answer comes from that turn's step); empty when it read only its prompt."""


@dataclass
class EpisodeGraph:
    """One episode: each agent's view as a trajectory, and the turns with their edges."""

    agents: dict[str, Trajectory]
    """Agent id -> its view, in the order agents first spoke. Every agent's status is the
    episode's when it failed (ENV_ERROR, ENV_TIMEOUT), its own when it reached a limit, else DONE."""
    nodes: list[TurnNode]
    """Turns in the order they were sampled (a node's `shown` points to earlier nodes only)."""
    seats: dict[str, Seat]
    error: str | None = None
    """What failed the whole episode (an environment failure), in words; None otherwise."""

    @classmethod
    def of(cls, trajectory: Trajectory) -> EpisodeGraph:
        """The graph of one agent: a single-agent episode (its turns a chain)."""
        nodes = [TurnNode(SINGLE_AGENT, k, (k - 1,) if k else ()) for k in range(trajectory.num_turns)]
        return cls({SINGLE_AGENT: trajectory}, nodes, {SINGLE_AGENT: Seat(SINGLE_AGENT)})

    @property
    def is_single_agent(self) -> bool:
        return list(self.seats) == [SINGLE_AGENT] and list(self.agents) == [SINGLE_AGENT]

    @property
    def failed(self) -> bool:
        return self.error is not None

    def seat(self, agent: str) -> Seat:
        return self.seats[seat_of(agent)]

    def trajectories(self) -> list[tuple[str, Trajectory]]:
        return list(self.agents.items())
