"""Environment episodes as GRPO groups: what the rollout loop (`forge_rl.run.loop`) runs when
`environment.name` is set. Functional core: no Monarch, no vLLM.

One prompt hand-out (an episode id) becomes `group_size` episodes of the environment, each a fresh
instance made by `make_env(seed, episode_id)`, played concurrently by `forge_rl.envs.runner`. Each
turn is sampled on the rollout's generator (`generate`, the pool's `generate_turn` endpoint), so
while one episode waits on its environment (a tool, a sandbox) the engine decodes the others, and
those of every other rollout on that generator. The group is admitted once and counted in flight
until its last episode ends (`forge_rl.core.admission`), however many weight updates it spans; every
token keeps the version that decoded it, and the buffer's age bound reads the oldest generated one.

Each trajectory becomes one `Completion` (`forge_rl.types`): its token sequence with a
`generated` mask (prompt and observations are context, never in a loss), behaviour logprobs and
versions on generated tokens, the environment's final reward as its reward (the advantage's input,
`forge_rl.core.advantages.completion_reward`), its per-turn rewards recorded beside it, and
`end_reason` saying why it ended. A single-turn prompt is the same thing with one turn and no
context in the completion (its prompt is the episode's), which is why both reach the buffer, the
trainer and the loss through one path.

A trajectory that forked (its renderer re-rendered an earlier turn differently: see
`forge_rl.envs.trajectory`) trains its first sample only; the later samples are counted
(`episodes/forked_samples_dropped`), not trained. One row per trajectory keeps a group's rows at
group_size, which GRPO's per-group baseline and the trainer's even split of rows over
data-parallel ranks both rely on. The tiny models' plain renderer forks only when the model
samples a special token inside a turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

from forge_rl.envs.calculator import make_calculator_env, make_calculator_env_without_tool
from forge_rl.envs.demonstrations import WarmupConfig
from forge_rl.envs.environment import Environment, Observation, StepResult
from forge_rl.envs.graph import EpisodeGraph, GraphStep, MultiAgentEnvironment, is_multi_agent
from forge_rl.envs.long_tail import make_long_tail_env
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.runner import EpisodeLimits, GenerateTurn, run_episode, run_graph
from forge_rl.envs.selfplay import make_chat_selfplay_env, make_selfplay_env
from forge_rl.envs.trajectory import GeneratedSpan, Trajectory, TrajectorySample, TrajectoryStatus
from forge_rl.errors import ConfigError
from forge_rl.routing import RoutingRecord
from forge_rl.tasks.rewards import import_function
from forge_rl.types import Completion, CompletionStatus

if TYPE_CHECKING:
    from typing_extensions import TypeIs

T = TypeVar("T")

MakeEnvironment = Callable[..., "Environment | AgentEnvironment | MultiAgentEnvironment"]
"""make_env(seed, index) -> a fresh environment for the index-th prompt (one instance per episode);
a factory with a parameter named `row` is also given the data row the prompt came from
(`make_env(seed, index, row=columns)`, the row's columns by name), so a data file drives its episodes."""

ENVIRONMENTS: dict[str, MakeEnvironment] = {
    "selfplay": make_selfplay_env,
    "selfplay_chat": make_chat_selfplay_env,
    "calculator": make_calculator_env,
    "calculator_no_tool": make_calculator_env_without_tool,
    "long_tail": make_long_tail_env,
}
"""Environments known by name; any other is given as "package.module:function"."""


@dataclass(frozen=True)
class EnvironmentConfig:
    name: str | None = None
    """The environment every episode plays: a registered name (calculator) or
    "package.module:function" taking (seed, index) and returning a fresh Environment
    (`forge_rl.envs.environment`); seed is task.seed, index the prompt's episode id. A function
    that also takes `row` plays the rows of `data.path`: it gets each prompt's row, its columns by
    name (data.path is then required, unless `row` has a default). Unset: the single-turn prompts
    of `task`, scored by task.reward."""
    renderer: Literal["plain", "chat_template"] = "plain"
    """How observations become tokens: the tiny models' plain format, or the model's chat template."""
    tool_call_parser: str | None = None
    """vLLM's tool parser (its --tool-call-parser name: hermes for Qwen2.5, Qwen3, Hermes models)
    that reads tool calls out of sampled turns, for agents that pass `tools` to the chat endpoint
    (`forge_rl.envs.chat_client`). Needs renderer=chat_template. Unset: tools are refused."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Per-episode limits: turns, total tokens (at most the model's context), tokens per turn,
    malformed turns, seconds per environment call."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up of the from-scratch model on the environment's demonstrations before RL
    (`forge_rl.training.warmup`); off unless warmup.episodes > 0."""

    def __post_init__(self) -> None:
        if self.name is not None:
            resolve_environment(self.name)
        if self.tool_call_parser is not None and self.renderer != "chat_template":
            raise ConfigError(
                f"environment.tool_call_parser ({self.tool_call_parser!r}) reads tool calls written in a chat "
                f"model's format, and environment.renderer ({self.renderer!r}) has none. Set "
                "--environment.renderer chat_template, or unset --environment.tool-call-parser."
            )

    def make_env(self) -> MakeEnvironment:
        """The factory, called as make_env(seed, index) or, with a data row, make_env(seed, index, row)."""
        if self.name is None:
            raise ValueError("environment.name is unset: the run plays single-turn prompts, no environment")
        factory = resolve_environment(self.name)
        if reads_row(factory) is None:
            return factory

        def make_env(
            seed: int, index: int, row: dict | None = None
        ) -> Environment | AgentEnvironment | MultiAgentEnvironment:
            return factory(seed, index) if row is None else factory(seed, index, row=row)

        return make_env

    @property
    def reads_row(self) -> Literal["required", "optional"] | None:
        """Whether the factory takes a data row (`reads_row`); None without an environment."""
        return None if self.name is None else reads_row(resolve_environment(self.name))


def reads_row(factory: MakeEnvironment) -> Literal["required", "optional"] | None:
    """ "required" when `factory` has a parameter `row` without a default, "optional" with one,
    None when it takes no row (the (seed, index) form)."""
    try:
        parameter = inspect.signature(factory).parameters.get("row")
    except ValueError:  # no signature to read: the (seed, index) form
        return None
    if parameter is None:
        return None
    return "required" if parameter.default is inspect.Parameter.empty else "optional"


def resolve_environment(name: str) -> MakeEnvironment:
    """The environment factory `name` names; ConfigError naming the fix when there is none."""
    if ":" in name:
        return import_function(name, "environment.name")
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"environment.name ({name!r}) is not a registered environment. Set --environment.name to one of "
            f"{', '.join(sorted(ENVIRONMENTS))}, or to 'package.module:function' returning an Environment."
        )
    return ENVIRONMENTS[name]


async def play_group(
    envs: Sequence[Environment | AgentEnvironment | MultiAgentEnvironment],
    generate: GenerateTurn,
    renderer: Renderer,
    limits: EpisodeLimits,
    seat_generate: Mapping[str, GenerateTurn] | None = None,
) -> list[EpisodeGraph]:
    """Play `envs` concurrently, one episode each; their episode graphs, in order. `seat_generate`:
    the seats whose turns another policy's generators sample (`run_graph`). An exception from a
    generate (a lost generator) cancels the others and propagates: the group is handed out again."""
    for env in envs:
        check_step_timeout(env, limits)
    return await gather_or_cancel([play_graph(env, generate, renderer, limits, seat_generate) for env in envs])


async def gather_or_cancel(episodes: list[Awaitable[T]]) -> list[T]:
    """The results of `episodes`, played concurrently, in order; the first exception cancels the
    others (waited for) and propagates."""
    tasks = [asyncio.ensure_future(episode) for episode in episodes]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class AgentEnvironment(Protocol):
    """An environment whose own code drives the model (an agent written against an OpenAI-style
    chat client: `forge_rl.envs.chat_client`, `forge_rl.envs.verifiers_adapter`). Instead of
    reset/step it plays the whole episode, sampling its turns with `generate`, and returns the
    trajectory, within the same limits; or, when it played several agents, their episode graph
    (`forge_rl.envs.graph`)."""

    async def play(
        self, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits
    ) -> Trajectory | EpisodeGraph: ...


def is_agent_environment(env: object) -> TypeIs[AgentEnvironment]:
    return callable(getattr(env, "play", None))


async def play_episode(
    env: Environment | AgentEnvironment, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits
) -> Trajectory | EpisodeGraph:
    """One episode: an agent environment plays itself (its trajectory, or its graph when it played
    several agents); any other runs under `run_episode`."""
    if is_agent_environment(env):
        return await env.play(generate, renderer, limits)
    return await run_episode(env, generate, renderer, limits)


async def play_graph(
    env: Environment | AgentEnvironment | MultiAgentEnvironment,
    generate: GenerateTurn,
    renderer: Renderer,
    limits: EpisodeLimits,
    seat_generate: Mapping[str, GenerateTurn] | None = None,
) -> EpisodeGraph:
    """One episode as its graph: a multi-agent environment's agents (`forge_rl.envs.graph`), an
    agent environment's own graph when it played several agents (verifiers' multi-seat envs), or
    the one agent of any other (`play_episode`). `seat_generate` (seats another policy plays)
    needs the first kind: the others' turns know no seat."""
    if is_multi_agent(env):
        return await run_graph(env, generate, renderer, limits, seat_generate)
    if seat_generate:
        raise ConfigError(
            f"{type(env).__name__} is not a multi-agent environment, so no policy can play its seats {sorted(seat_generate)}"
        )
    played = await play_episode(env, generate, renderer, limits)
    return played if isinstance(played, EpisodeGraph) else EpisodeGraph.of(played)


def check_step_timeout(env: Environment | AgentEnvironment | MultiAgentEnvironment, limits: EpisodeLimits) -> None:
    """ConfigError when env_step_timeout_s is below the environment's own `max_step_s` (a sandbox's
    start-up plus its whole run): every such step could be killed mid-run."""
    needed_s = getattr(env, "max_step_s", None)
    if needed_s is not None and limits.env_step_timeout_s < needed_s:
        raise ConfigError(
            f"environment.limits.env_step_timeout_s ({limits.env_step_timeout_s:g}) is below what one step of "
            f"{type(getattr(env, 'env', env)).__name__} may take ({needed_s:g} s: its sandbox's start-up and whole "
            "run), so a step could be timed out with its sandbox mid-run and the episode blamed on the "
            f"environment. Set --environment.limits.env-step-timeout-s to at least {needed_s:g}, or lower the "
            "sandbox's max_wall_time_s."
        )


_COMPLETION_STATUS = {
    TrajectoryStatus.TRUNCATED_TURNS: CompletionStatus.TRUNCATED,
    TrajectoryStatus.TRUNCATED_TOKENS: CompletionStatus.TRUNCATED,
    TrajectoryStatus.ENV_ERROR: CompletionStatus.ERRORED,
    TrajectoryStatus.ENV_TIMEOUT: CompletionStatus.ERRORED,
}
"""Every other end (DONE, PARSE_ERROR: the model's own doing, trained with its reward) is OK."""


def group_completions(graphs: list[EpisodeGraph]) -> list[Completion]:
    """One completion per agent of each episode of a group (`trajectory_completion`), in order;
    a single-agent episode's one completion is named by no agent.

    Each agent's completion says which others its advantage is baselined against
    (`Completion.baseline_group`): its seat's agents over the group, or over its own episode
    (`Seat.baseline`); an untrainable seat's tokens are all untrainable. Whether turns are
    process-reward steps is decided for the whole group: if the environment rewarded any turn of
    any trajectory, every trajectory's turns are steps (an unrewarded turn 0). A trajectory whose
    turns all went unrewarded then enters the group's step statistics with all-zero steps, against
    which the rewarded turns are judged; left without steps it would drop out of them, and the
    contrast between rewarded and unrewarded turns with it."""
    turns_are_steps = any(r is not None for graph in graphs for _, t in graph.trajectories() for r in t.turn_rewards)
    completions = []
    for index, graph in enumerate(graphs):
        for agent, trajectory in graph.trajectories():
            completion = trajectory_completion(trajectory, turns_are_steps)
            if not graph.is_single_agent:
                seat = graph.seat(agent)
                completion.agent = agent
                completion.baseline_group = seat.name if seat.baseline == "group" else f"{seat.name}@{index}"
                if not seat.trainable:
                    completion.trainable = [False] * completion.num_tokens
            completions.append(completion)
    return completions


def trajectory_completion(trajectory: Trajectory, turns_are_steps: bool | None = None) -> Completion:
    """The trajectory's first sample as one completion (module docstring): ids exactly as sampled
    and rendered, generated tokens marked, context tokens carrying logprob 0.0 and the version of
    the generated token before them (the first generated token's before any). `turns_are_steps`:
    whether its turns become process-reward steps, which its group decides (`group_completions`);
    None decides it from this trajectory's own turn rewards, as a group of one."""
    if turns_are_steps is None:
        turns_are_steps = any(r is not None for r in trajectory.turn_rewards)
    sample = trajectory.samples[0] if trajectory.samples else TrajectorySample()
    first_versions = [span.policy_versions[0] for span in sample.generated_spans if span.token_ids]
    version = first_versions[0] if first_versions else 0
    token_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    generated, supports = [], []
    routings = [span.routed_experts for span in sample.generated_spans]
    for span in sample.spans:
        num_tokens = len(span.token_ids)
        token_ids += span.token_ids
        if isinstance(span, GeneratedSpan):
            generated += [True] * num_tokens
            logprobs += span.logprobs
            versions += span.policy_versions
            supports += [list(kept) for kept in span.sampling_support] if span.sampling_support else [[]] * num_tokens
            version = span.policy_versions[-1] if num_tokens else version
        else:
            generated += [False] * num_tokens
            logprobs += [0.0] * num_tokens
            versions += [version] * num_tokens
            supports += [[]] * num_tokens
    last_turn = next((m.content for m in reversed(trajectory.conversation) if m.role == "assistant"), "")
    step_ends, step_rewards = turn_steps(sample, trajectory.turn_rewards) if turns_are_steps else (None, None)
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        policy_versions=versions,
        generated=generated,
        sampling_support=supports if any(supports) else None,
        num_truncated_support=sum(span.num_truncated_support for span in sample.generated_spans),
        # One record over every generated token, or none: a turn without one leaves the whole
        # trajectory to the trainer's own routing (counted as a completion without a record).
        routed_experts=(
            RoutingRecord.concat(cast("list[RoutingRecord]", routings))  # the all() below: none is None
            if routings and all(r is not None for r in routings)
            else None
        ),
        text=last_turn,
        reward=trajectory.final_reward,
        status=_COMPLETION_STATUS.get(trajectory.status, CompletionStatus.OK),
        error=trajectory.error,
        num_turns=trajectory.num_turns,
        num_malformed_turns=trajectory.num_malformed_turns,
        turn_rewards=list(trajectory.turn_rewards),
        step_ends=step_ends,
        step_rewards=step_rewards,
        env_latencies_s=list(trajectory.env_latencies_s),
        end_reason=trajectory.status.value,
    )


def turn_steps(
    sample: TrajectorySample, turn_rewards: list[float | None]
) -> tuple[list[int] | None, list[float] | None]:
    """Per-turn rewards as process rewards (`Completion.step_ends`/`step_rewards`, which
    `forge_rl.core.advantages.token_advantages` credits to each step's tokens): step k is turn k's
    generated tokens and the context after them, up to the next turn (step 0 also holds the
    prompt: context tokens are never in a loss, so only where generated tokens fall matters).
    A turn whose environment step gave no reward (None) counts as 0, all of them included: whether
    a trajectory has steps at all is its group's decision (`group_completions`); a group without
    any turn reward trains on its final rewards alone (plain GRPO). A forked trajectory's first
    sample holds only its first turns: it takes their rewards. No turn: no steps."""
    turns = [span for span in sample.generated_spans if span.token_ids]
    rewards = list(turn_rewards[: len(turns)])
    if not turns:
        return None, None
    turn_ids, starts, position = {id(span) for span in turns}, [], 0
    for span in sample.spans:
        if id(span) in turn_ids:
            starts.append(position)
        position += len(span.token_ids)
    rewards += [None] * (len(turns) - len(rewards))  # a last turn with no environment step after it
    return [*starts[1:], position], [0.0 if r is None else float(r) for r in rewards]


class EnvWaitClock:
    """Per generator, the time it sat idle while episodes waited on their environments: no turn
    of this controller's in flight on it, and at least one environment call of its episodes running.
    That is the idle an agentic workload adds, and what concurrent episodes are there to fill."""

    def __init__(self, num_generators: int, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._turns = [0] * num_generators
        self._env_calls = [0] * num_generators
        self._since = [clock()] * num_generators
        self._idle_waiting_s = [0.0] * num_generators

    def add_generator(self) -> None:
        """Count one more generator (it joined the run: the next index)."""
        self._turns.append(0)
        self._env_calls.append(0)
        self._since.append(self.clock())
        self._idle_waiting_s.append(0.0)

    @contextlib.contextmanager
    def turn(self, index: int) -> Iterator[None]:
        """A turn being sampled on generator `index`."""
        with self._counted(self._turns, index):
            yield

    @contextlib.contextmanager
    def env_call(self, index: int) -> Iterator[None]:
        """An environment reset or step of an episode on generator `index`."""
        with self._counted(self._env_calls, index):
            yield

    def idle_waiting_s(self, index: int) -> float:
        self._advance(index)
        return self._idle_waiting_s[index]

    @contextlib.contextmanager
    def _counted(self, counts: list[int], index: int) -> Iterator[None]:
        self._advance(index)
        counts[index] += 1
        try:
            yield
        finally:
            self._advance(index)
            counts[index] -= 1

    def _advance(self, index: int) -> None:
        now = self.clock()
        if self._turns[index] == 0 and self._env_calls[index] > 0:
            self._idle_waiting_s[index] += now - self._since[index]
        self._since[index] = now


class TimedEnvironment:
    """`env` with each reset and step counted as an environment call of generator `index` (EnvWaitClock).
    An agent environment's whole `play` is one call: while its agent waits on a turn the generator
    is busy (the turn's own clock), and the rest of the time it is the environment's. A multi-agent
    environment keeps its seats, and its `agent_ended` is counted as a call too."""

    def __init__(self, env: Environment | AgentEnvironment | MultiAgentEnvironment, clock: EnvWaitClock, index: int):
        self.env, self.clock, self.index = env, clock, index
        self.max_step_s = getattr(env, "max_step_s", None)
        if is_agent_environment(env):
            self.play = self._play
        if is_multi_agent(env):
            self.seats = env.seats
            if callable(getattr(env, "agent_ended", None)):
                self.agent_ended = self._agent_ended

    async def _play(
        self, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits
    ) -> Trajectory | EpisodeGraph:
        # Set only for an agent environment (__init__).
        with self.clock.env_call(self.index):
            return await cast(AgentEnvironment, self.env).play(generate, renderer, limits)

    async def _agent_ended(self, agent: str, status: TrajectoryStatus) -> GraphStep:
        # Set only where the environment has agent_ended, which no protocol declares.
        with self.clock.env_call(self.index):
            return await cast(Any, self.env).agent_ended(agent, status)

    async def reset(self) -> Observation | Mapping[str, Observation]:
        # An agent environment plays itself (`play`): reset and step serve the other kinds.
        with self.clock.env_call(self.index):
            return await cast("Environment | MultiAgentEnvironment", self.env).reset()

    async def step(self, *turn: str) -> StepResult | GraphStep:
        """(turn_text), or (agent, turn_text) for a multi-agent environment."""
        with self.clock.env_call(self.index):
            return await cast("Environment | MultiAgentEnvironment", self.env).step(*turn)
