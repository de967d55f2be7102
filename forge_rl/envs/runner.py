"""Plays one episode: reset, then generate a turn, step the environment, and so on, within the
episode's limits; returns the Trajectory (`run_episode`), or for a multi-agent environment the
episode graph of its agents (`run_graph`, `forge_rl.envs.graph`). A plain environment is played
as the graph of its one agent, so both go through the same loop: what follows holds per agent.

The runner knows no engine: `generate` is any coroutine that, given the token prefix and a token
budget, samples the next turn. On the real engine it is `VLLMEngine.generate_turn`
(`forge_rl.engines.vllm_engine`) with the tokenizer's eos bound; tests of the core pass a named
fake (tests/support/fakes.py). Each turn continues the same token sequence (vLLM's prefix cache serves
the earlier turns' whole KV blocks), and every token keeps the policy version that decoded it, so
an episode may span weight updates.

What ends an episode (TrajectoryStatus):
    reset raises, or runs past env_step_timeout_s          ENV_ERROR, ENV_TIMEOUT
    the prompt leaves no room for a turn                   TRUNCATED_TOKENS
  then, turn after turn:
    max_turns turns were taken                             TRUNCATED_TURNS
    generate raises ContextExhausted (the engine's own     TRUNCATED_TOKENS
      context is full, whatever max_total_tokens allows)
    the turn used the last of max_total_tokens             TRUNCATED_TOKENS (the environment never sees it)
    step raises, or runs past env_step_timeout_s           ENV_ERROR, ENV_TIMEOUT
    step raises MalformedTurn once more than allowed       PARSE_ERROR (until then: its observation is shown)
    step says done                                         DONE, with its final reward (every agent's)
    the observation cannot be rendered                     ENV_ERROR
    the observation leaves no room for a turn              TRUNCATED_TOKENS

Nothing an environment does crashes the caller: an exception or a hang in reset or step (or an
observation that cannot be rendered) ends that episode ERRORED with the reason. Two kinds of
exception do propagate: the fatal ones of `forge_rl.errors` (ConfigError, SandboxUnavailable: the
machine or config cannot run any episode, so the run must stop and say why), and whatever
`generate` raises (a lost generator is the rollout shell's to handle: it hands the episode out
again).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from forge_rl.envs.environment import Environment, MalformedTurn, Observation, StepResult
from forge_rl.envs.graph import (
    SINGLE_AGENT,
    EpisodeGraph,
    GraphStep,
    MultiAgentEnvironment,
    Seat,
    TurnNode,
    declared_seats,
    seat_of,
)
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.trajectory import GeneratedSpan, Trajectory, TrajectoryBuilder, TrajectoryStatus
from forge_rl.errors import ConfigError
from forge_rl.routing import RoutingRecord

if TYPE_CHECKING:
    from forge_rl.envs.chat_client import ChatSession

T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeLimits:
    """What bounds one episode. The two token limits follow the model and the generator unless set:
    a run resolves them against its config (`resolved`) before anything plays."""

    max_turns: int = 8
    """Model turns per episode; an episode the environment has not closed by then is TRUNCATED_TURNS."""
    max_total_tokens: int | None = None
    """Longest token sequence of a sample (prompt, turns and observations): the context budget. At
    most the model's context length; unset: all of it (max_model_len, 128 for the tiny models)."""
    max_tokens_per_turn: int | None = None
    """Tokens one turn may sample (the engine's max_tokens for that request). Unset:
    generator.max_new_tokens, the bound of a single-turn completion."""
    max_malformed_turns: int = 1
    """Malformed turns (MalformedTurn) answered with an error observation; one more ends the
    episode as PARSE_ERROR. 0: the first one ends it."""
    env_step_timeout_s: float = 30.0
    """Seconds one reset or step may take; past it the episode is ENV_TIMEOUT."""

    @property
    def is_resolved(self) -> bool:
        return self.max_total_tokens is not None and self.max_tokens_per_turn is not None

    def resolved(self, max_model_len: int, max_new_tokens: int) -> EpisodeLimits:
        """These limits with the unset token limits derived: max_total_tokens the model's context
        `max_model_len`, max_tokens_per_turn `max_new_tokens` (generator.max_new_tokens), within it."""
        return dataclasses.replace(
            self,
            max_total_tokens=max_model_len if self.max_total_tokens is None else self.max_total_tokens,
            max_tokens_per_turn=(
                min(max_new_tokens, self.max_total_tokens or max_model_len)
                if self.max_tokens_per_turn is None
                else self.max_tokens_per_turn
            ),
        )

    @property
    def max_generated_tokens(self) -> int:
        """Most tokens a trajectory can generate: max_turns turns of max_tokens_per_turn, within
        its max_total_tokens budget (which its context shares)."""
        self.require_resolved()
        assert self.max_tokens_per_turn is not None and self.max_total_tokens is not None  # checked just above
        return min(self.max_turns * self.max_tokens_per_turn, self.max_total_tokens)

    def require_resolved(self) -> None:
        """ValueError unless both token limits are known (set, or `resolved` against the model)."""
        if not self.is_resolved:
            raise ValueError(
                f"EpisodeLimits(max_total_tokens={self.max_total_tokens}, max_tokens_per_turn={self.max_tokens_per_turn}) "
                "has an unset token limit, which follows the model: call limits.resolved(max_model_len, "
                "max_new_tokens) first (a run's GRPOConfig does), or set both."
            )

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_tokens_per_turn"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"environment.limits.{name} ({value}) must be >= 1. Set --environment.limits.{name.replace('_', '-')}"
                    + (", or unset it to follow the model." if name != "max_turns" else ".")
                )
        if self.max_malformed_turns < 0:
            raise ValueError(f"EpisodeLimits.max_malformed_turns ({self.max_malformed_turns}) must be >= 0.")
        if not 0 < self.env_step_timeout_s < math.inf:
            raise ValueError(
                f"EpisodeLimits.env_step_timeout_s ({self.env_step_timeout_s}) must be > 0 and finite: a "
                "hung environment would otherwise hold its episode forever."
            )


@dataclass(frozen=True)
class SampledTurn:
    """What `generate` returns: one turn, as sampled."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: Literal["stop", "length"]
    """"stop": it ended on a stop token (included in token_ids, as sampled); "length": it used its
    whole token budget."""
    sampling_support: list[list[int]] | None = None
    """Per token, the ids top-k/top-p kept when it was sampled (the trainer renormalizes its
    logprobs over them); None when nothing was filtered out or the generator does not record them."""
    routed_experts: RoutingRecord | None = None
    """Mixture-of-experts policies: the experts each token was sampled through, [T, layers, top_k]
    (`forge_rl.routing`); None when not recorded."""
    num_truncated_support: int = 0
    """Tokens whose kept set may be incomplete (`Completion.num_truncated_support`)."""


GenerateTurn = Callable[[list[int], int], Awaitable[SampledTurn]]
"""generate(prefix_token_ids, max_new_tokens) -> the turn sampled after exactly that prefix.
May sample fewer than max_new_tokens ("length") where its own context ends, and raises
ContextExhausted when that context has no room left for one token."""


class ContextExhausted(Exception):
    """Raised by `generate` when the prefix leaves no room in the generator's context (its
    max_model_len) for one more token, before anything is sent to the engine. The runner ends the
    episode TRUNCATED_TOKENS with this message: the model's context is full, as when
    max_total_tokens is, and the episode is trained with the reward it earned (none)."""


async def run_episode(
    env: Environment, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits
) -> Trajectory:
    """Play `env` to its end (or its limits) with turns from `generate`; see the module docstring.
    The episode is the graph of one agent (`run_graph` over the environment's one seat)."""
    graph = await run_graph(OneSeat(env), generate, renderer, limits)
    return graph.agents[SINGLE_AGENT]


class OneSeat:
    """A single-agent `Environment` as a multi-agent one with the seat `agent`: its observations
    go to that agent, and the agent's end on a limit closes the episode with no reward."""

    seats = (Seat(SINGLE_AGENT),)

    def __init__(self, env: Environment):
        self.env = env
        self.max_step_s = getattr(env, "max_step_s", None)

    async def reset(self) -> dict[str, Observation]:
        return {SINGLE_AGENT: await self.env.reset()}

    async def step(self, agent: str, turn_text: str) -> GraphStep:
        result = await self.env.step(turn_text)
        if not isinstance(result, StepResult):
            raise _EnvFailed(TrajectoryStatus.ENV_ERROR, f"returned {type(result).__name__}, not a StepResult")
        if result.done:
            assert result.final_reward is not None  # StepResult refuses done without a final_reward
            return GraphStep(turn_reward=result.turn_reward, done=True, rewards={SINGLE_AGENT: result.final_reward})
        return GraphStep({SINGLE_AGENT: result.observation}, result.turn_reward)

    async def agent_ended(self, agent: str, status: TrajectoryStatus) -> GraphStep:
        return GraphStep(done=True, rewards={SINGLE_AGENT: 0.0})


async def run_graph(
    env: MultiAgentEnvironment,
    generate: GenerateTurn,
    renderer: Renderer,
    limits: EpisodeLimits,
    seat_generate: Mapping[str, GenerateTurn] | None = None,
) -> EpisodeGraph:
    """Play a multi-agent episode (`forge_rl.envs.graph`) to its end: each agent's turns are
    sampled with `generate` (or its seat's own in `seat_generate`: the generators of the policy
    that plays it) within `limits` (and its seat's own max_turns and turn_timeout_s),
    concurrently with the other agents'; the environment is called one call at a time. Whatever
    a generate raises (a lost generator) cancels the episode's other turns and propagates."""
    limits.require_resolved()
    seats = declared_seats(env)
    unknown = sorted(set(seat_generate or {}) - set(seats))
    if unknown:
        raise ConfigError(
            f"{type(env).__name__} declares no seat {unknown} (its seats: {sorted(seats)}), which a policy plays"
        )
    return await _GraphPlay(env, seats, generate, renderer, limits, seat_generate or {}).play()


class _Agent:
    """One agent of an episode being played: its view (builder), its figures, what it has to answer."""

    def __init__(self, agent_id: str, seat: Seat, renderer: Renderer, limits: EpisodeLimits):
        self.id, self.seat = agent_id, seat
        assert limits.max_total_tokens is not None  # run_graph requires resolved limits
        self.builder = TrajectoryBuilder(renderer, limits.max_total_tokens)
        self.record = _Record()
        self.max_turns = seat.max_turns or limits.max_turns
        self.inbox: list[tuple[Observation, tuple[int, ...]]] = []
        """Observations to read before its next turn, each with the nodes whose steps produced it."""
        self.ended: tuple[TrajectoryStatus, str] | None = None
        """Set when it reached one of its own limits: its status, and why."""
        self.task: asyncio.Future | None = None
        self.reward = 0.0
        self.session: ChatSession | None = None
        """A player seat's agent (`Seat.player`): its chat session, whose calls are its view."""

    def trajectory(self, status: TrajectoryStatus, error: str | None) -> Trajectory:
        if self.session is not None:
            return dataclasses.replace(
                self.session.trajectory(status, error, self.reward), env_latencies_s=self.record.env_latencies_s
            )
        return Trajectory(
            samples=self.builder.samples,
            status=status,
            final_reward=self.reward,
            error=error,
            conversation=self.builder.conversation,
            turn_rewards=self.record.turn_rewards,
            num_turns=self.record.num_turns,
            num_malformed_turns=self.record.num_malformed_turns,
            env_latencies_s=self.record.env_latencies_s,
        )


class _GraphFailed(Exception):
    """The whole episode failed (the environment's doing): every agent's view is counted, not trained."""

    def __init__(self, status: TrajectoryStatus, reason: str):
        super().__init__(reason)
        self.status = status


class _GraphPlay:
    def __init__(
        self,
        env: MultiAgentEnvironment,
        seats: dict[str, Seat],
        generate: GenerateTurn,
        renderer: Renderer,
        limits: EpisodeLimits,
        seat_generate: Mapping[str, GenerateTurn],
    ):
        self.env, self.seats, self.generate, self.renderer, self.limits = env, seats, generate, renderer, limits
        self.seat_generate = seat_generate
        self.agents: dict[str, _Agent] = {}
        self.nodes: list[TurnNode] = []
        self.lock = asyncio.Lock()  # one environment call at a time
        self.closed = False
        self.single = isinstance(env, OneSeat)  # a plain Environment: messages name no agent

    def label(self, agent: _Agent) -> str:
        return "" if self.single else f"{agent.id}: "

    async def play(self) -> EpisodeGraph:
        reset_record = _Record()
        failure: _GraphFailed | None = None
        try:
            try:
                first = await _call_env(self.env.reset(), self.limits.env_step_timeout_s, reset_record)
            except MalformedTurn:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR, "reset raised MalformedTurn, which only step may raise"
                ) from None
            except _EnvFailed as reset_failure:
                raise _GraphFailed(reset_failure.status, f"reset: {reset_failure}") from None
            if not isinstance(first, Mapping) or not first:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"reset returned {first!r}: it must map the agents that speak first to their observations",
                )
            self._deliver(first, (), "reset")
            for agent in self.agents.values():
                agent.record.env_latencies_s += reset_record.env_latencies_s
            await self._run_agents()
        except _GraphFailed as failed:
            failure = failed
        finally:
            await self._cancel_all()  # turns still being sampled when the episode closed (or failed)
        return self._closed_graph() if failure is None else self._failed(failure)

    async def _run_agents(self) -> None:
        while not self.closed:
            for agent in self.agents.values():
                if agent.inbox and agent.task is None and agent.ended is None:
                    agent.task = asyncio.ensure_future(self._answer(agent))
            running = [agent.task for agent in self.agents.values() if agent.task is not None]
            if not running:
                raise _GraphFailed(TrajectoryStatus.ENV_ERROR, self._stalled())
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for agent in self.agents.values():
                if agent.task in finished:
                    task, agent.task = agent.task, None
                    task.result()  # raises _GraphFailed, or whatever generate raised

    def _stalled(self) -> str:
        """Why nothing can go on, in words: nobody has anything to answer, and the episode is open."""
        waiting = [a.id for a in self.agents.values() if a.ended is None]
        if waiting:
            return (
                f"no agent has anything to answer and the environment has not closed the episode: its agents wait on "
                f"each other (waiting: {', '.join(waiting)}). A step must give an observation to some agent, or say "
                "done with every agent's reward."
            )
        ended = ", ".join(f"{a.id}: {a.ended[0].value}" for a in self.agents.values() if a.ended is not None)
        return (
            f"every agent has ended ({ended}) and the environment has not closed the episode: close it (done, with "
            "every agent's reward) from agent_ended when the last one ends."
        )

    async def _cancel_all(self) -> None:
        tasks = [agent.task for agent in self.agents.values() if agent.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for agent in self.agents.values():
            agent.task = None

    async def _answer(self, agent: _Agent) -> None:
        """`agent` reads what it was sent and takes turns until it has nothing left to answer."""
        if agent.seat.player is not None:
            return await self._answer_played(agent)
        limits, record, builder = self.limits, agent.record, agent.builder
        assert limits.max_total_tokens is not None and limits.max_tokens_per_turn is not None  # run_graph resolved them
        label = self.label(agent)
        no_room = f"does not leave room for a turn within max_total_tokens ({limits.max_total_tokens})"
        while agent.inbox and not self.closed:
            observation, shown = agent.inbox.pop(0)
            started = bool(builder.samples)
            try:
                fits = _render(builder.add_observation if started else builder.start, observation)
            except _EnvFailed as failure:
                where = f"step {record.num_turns}" if started else ("reset" if not shown else "prompt")
                raise _GraphFailed(failure.status, f"{label}{where}: {failure}") from None
            if not fits:
                where = f"observation {record.num_turns}" if started else "the prompt"
                return await self._end(agent, TrajectoryStatus.TRUNCATED_TOKENS, f"{where} {no_room}")
            if record.num_turns == agent.max_turns:
                return await self._end(
                    agent, TrajectoryStatus.TRUNCATED_TURNS, f"max_turns ({agent.max_turns}) reached"
                )
            room = limits.max_total_tokens - builder.num_tokens
            max_new_tokens = min(limits.max_tokens_per_turn, room)
            try:
                turn = await self._sample(agent, builder.prefix, max_new_tokens)
            except ContextExhausted as full:
                return await self._end(agent, TrajectoryStatus.TRUNCATED_TOKENS, f"turn {record.num_turns + 1}: {full}")
            check_turn(turn, max_new_tokens)
            turn_text = builder.add_turn(turn_span(turn))
            node = len(self.nodes)
            self.nodes.append(TurnNode(agent.id, record.num_turns, shown))
            record.num_turns += 1
            if turn.finish_reason == "length" and max_new_tokens == room:
                reason = f"turn {record.num_turns} used the last of max_total_tokens ({limits.max_total_tokens})"
                return await self._end(agent, TrajectoryStatus.TRUNCATED_TOKENS, reason)
            await self._step(agent, turn_text, node)

    async def _answer_played(self, agent: _Agent) -> None:
        """`_answer` for a seat whose agent code plays it (`Seat.player`): each observation goes to
        the player with an OpenAI client of the agent's own chat session, and what it returns is
        the agent's turn. The session holds the agent to the limits (its model calls count as its
        turns); the player may take env_step_timeout_s between two calls, and its seat's
        turn_timeout_s for the whole turn (ENV_TIMEOUT either way). A player that raises, or
        returns no text, fails the episode ENV_ERROR (counted, never trained); one stopped by a
        limit ends its agent there, as a sampled turn's limit does."""
        # Imported here: the chat endpoint is built on this module's turns and limits.
        from forge_rl.envs.chat_client import ChatSession, run_watched

        record = agent.record
        player = agent.seat.player
        assert player is not None  # _answer hands over only a seat with a player
        if agent.session is None:
            generate = self.seat_generate.get(agent.seat.name, self.generate)
            limits = dataclasses.replace(self.limits, max_turns=agent.max_turns)
            agent.session = ChatSession(generate, self.renderer, limits)
        session = agent.session
        while agent.inbox and not self.closed:
            observation, shown = agent.inbox.pop(0)
            client, calls_before = session.client(), session.recorder.num_calls
            try:
                played = asyncio.ensure_future(player(client, observation))
                timeout_s = agent.seat.turn_timeout_s
                watched = run_watched(played, session.activity, self.limits.env_step_timeout_s)
                ended = await (watched if timeout_s is None else _player_within(watched, played, timeout_s))
            finally:
                await client.close()
            if ended is not None:
                status, reason = ended
                raise _GraphFailed(status, f"{agent.id}: turn {record.num_turns + 1}: {reason}")
            if session.truncation is not None:
                return await self._end(agent, *session.truncation)
            error = played.exception()
            if error is not None:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR, f"{agent.id}: the seat's player raised {type(error).__name__}: {error}"
                )
            turn_text = played.result()
            if session.recorder.num_calls == calls_before:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"{agent.id}: the seat's player answered turn {record.num_turns + 1} without a model call: a seat's "
                    "turns are the policy's, and a scripted one has nothing to train (make the seat untrainable, or the "
                    "answer the environment's own)",
                )
            if not isinstance(turn_text, str):
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"{agent.id}: the seat's player returned {turn_text!r}: it must return the turn's text",
                )
            node = len(self.nodes)
            self.nodes.append(TurnNode(agent.id, record.num_turns, shown))
            record.num_turns += 1
            await self._step(agent, turn_text, node)

    async def _step(self, agent: _Agent, turn_text: str, node: int) -> None:
        """The environment's step on `agent`'s turn (graph node `node`), applied: a MalformedTurn's
        observation goes back to the agent (too many end it PARSE_ERROR), a failed step fails the
        episode. A seat its player plays gets no turn reward (its model calls are its turns)."""
        record, label = agent.record, self.label(agent)
        async with self.lock:
            if self.closed:
                return
            try:
                result = await self._env_answer(self.env.step(agent.id, turn_text), record)
            except MalformedTurn as malformed:
                record.num_malformed_turns += 1
                if record.num_malformed_turns > self.limits.max_malformed_turns:
                    reason = f"turn {record.num_turns} malformed: {malformed.observation!r}"
                    return await self._end(agent, TrajectoryStatus.PARSE_ERROR, reason, locked=True)
                result = GraphStep({agent.id: malformed.observation})
            except _EnvFailed as failure:
                raise _GraphFailed(failure.status, f"{label}step {record.num_turns}: {failure}") from None
            if agent.session is not None and result.turn_reward is not None:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"{label}step {record.num_turns} gave a turn_reward to a seat its player plays: the player's "
                    "model calls are its turns, and a step's reward names none of them. Fold it into the final reward.",
                )
            record.turn_rewards.append(result.turn_reward)
            self._apply(result, (node,), f"{label}step {record.num_turns}")

    async def _sample(self, agent: _Agent, prefix: list[int], max_new_tokens: int) -> SampledTurn:
        timeout_s = agent.seat.turn_timeout_s
        generate = self.seat_generate.get(agent.seat.name, self.generate)
        if timeout_s is None:
            return await generate(prefix, max_new_tokens)
        task = await _within(generate(prefix, max_new_tokens), timeout_s)
        if task is None:
            raise _GraphFailed(
                TrajectoryStatus.ENV_TIMEOUT,
                f"{agent.id}: turn {agent.record.num_turns + 1} was not sampled within seat {agent.seat.name!r}'s "
                f"turn_timeout_s ({timeout_s:g} s)",
            )
        return task.result()

    async def _end(self, agent: _Agent, status: TrajectoryStatus, reason: str, locked: bool = False) -> None:
        """`agent` reached one of its own limits: it takes no more turns, and the environment is told."""
        agent.ended = (status, reason)
        agent.inbox.clear()
        ended = getattr(self.env, "agent_ended", None)
        if ended is None:
            return
        async with contextlib.nullcontext() if locked else self.lock:
            if self.closed:
                return
            try:
                result = await self._env_answer(ended(agent.id, status), None)
            except MalformedTurn:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"{agent.id}: agent_ended raised MalformedTurn, which only step may raise",
                ) from None
            except _EnvFailed as failure:
                raise _GraphFailed(failure.status, f"{agent.id}: agent_ended: {failure}") from None
            self._apply(result, (), f"{self.label(agent)}agent_ended")

    async def _env_answer(self, call: Awaitable[GraphStep], record: _Record | None) -> GraphStep:
        """A step's or agent_ended's answer (`_call_env`), refused unless it is a GraphStep."""
        result = await _call_env(call, self.limits.env_step_timeout_s, record)
        if not isinstance(result, GraphStep):
            raise _EnvFailed(TrajectoryStatus.ENV_ERROR, f"returned {type(result).__name__}, not a GraphStep")
        return result

    def _apply(self, result: GraphStep, shown: tuple[int, ...], where: str) -> None:
        """A step's answer: its observations to their agents, or the episode closed with its rewards."""
        if result.done:
            assert result.rewards is not None  # GraphStep refuses done without rewards
            self._close(result.rewards, where)
        else:
            self._deliver(result.observations, shown, where)

    def _deliver(self, observations: Mapping[str, Observation], shown: tuple[int, ...], where: str) -> None:
        for agent_id, observation in observations.items():
            seat = self.seats.get(seat_of(agent_id)) if isinstance(agent_id, str) else None
            if seat is None:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"{where} addressed agent {agent_id!r}, whose seat is not declared (seats: "
                    f"{', '.join(self.seats)}). Address agents as 'seat' or 'seat/k' of a declared seat.",
                )
            agent = self.agents.get(agent_id)
            if agent is None:
                agent = self.agents[agent_id] = _Agent(agent_id, seat, self.renderer, self.limits)
            elif agent.ended is not None:
                raise _GraphFailed(
                    TrajectoryStatus.ENV_ERROR,
                    f"{where} addressed agent {agent_id!r}, which has ended ({agent.ended[0].value}: {agent.ended[1]})",
                )
            agent.inbox.append((observation, shown))

    def _close(self, rewards: Mapping[str, float], where: str) -> None:
        unknown = [a for a in rewards if a not in self.agents]
        if unknown:
            raise _GraphFailed(
                TrajectoryStatus.ENV_ERROR,
                f"{where} closed the episode with rewards for agents that never spoke: {unknown}",
            )
        missing = [
            a.id for a in self.agents.values() if a.record.num_turns and a.seat.trainable and a.id not in rewards
        ]
        if missing:
            raise _GraphFailed(
                TrajectoryStatus.ENV_ERROR,
                f"{where} closed the episode without a reward for {', '.join(missing)}: done=True needs a reward for "
                "every agent that took a turn",
            )
        for agent_id, reward in rewards.items():
            self.agents[agent_id].reward = float(reward)
        self.closed = True

    def _closed_graph(self) -> EpisodeGraph:
        # An agent that never took a turn (the episode closed before it answered) has nothing to
        # train and no reward: it is left out, so it does not enter its seat's baseline as a 0.
        kept = {
            agent_id: agent.trajectory(*(agent.ended or (TrajectoryStatus.DONE, None)))
            for agent_id, agent in self.agents.items()
            if agent.record.num_turns or agent.ended or self.single
        }
        return EpisodeGraph(kept, self.nodes, self.seats)

    def _failed(self, failure: _GraphFailed) -> EpisodeGraph:
        error = str(failure)
        agents = {agent_id: agent.trajectory(failure.status, error) for agent_id, agent in self.agents.items()}
        for name, seat in self.seats.items():  # a row for a seat nobody played: the failure is counted there
            if not any(seat_of(agent_id) == name for agent_id in agents):
                agents[name] = _Agent(name, seat, self.renderer, self.limits).trajectory(failure.status, error)
        return EpisodeGraph(agents, self.nodes, self.seats, error)


async def _player_within(
    watched: Awaitable, played: asyncio.Future, timeout_s: float
) -> tuple[TrajectoryStatus, str] | None:
    """`watched` (a player's `run_watched`), with the player's whole turn bounded by its seat's
    turn_timeout_s: past it the player is cancelled and its turn ends ENV_TIMEOUT."""
    finished = await _within(watched, timeout_s)
    if finished is not None:
        return finished.result()
    played.cancel()
    return TrajectoryStatus.ENV_TIMEOUT, f"the seat's player took more than its turn_timeout_s ({timeout_s:g} s)"


def _render(add: Callable[[Observation], bool], observation: Observation) -> bool:
    """`add(observation)`; an observation that cannot be rendered (characters the tokenizer cannot
    spell, a role the chat template rejects) is the environment's failure, not the model's."""
    try:
        return add(observation)
    except Exception as e:
        reason = f"its observation cannot be rendered: {type(e).__name__}: {e}"
        raise _EnvFailed(TrajectoryStatus.ENV_ERROR, reason) from e


@dataclass
class _Record:
    num_turns: int = 0
    num_malformed_turns: int = 0
    turn_rewards: list[float | None] = field(default_factory=list)
    env_latencies_s: list[float] = field(default_factory=list)


class _EnvFailed(Exception):
    def __init__(self, status: TrajectoryStatus, reason: str):
        super().__init__(reason)
        self.status = status


async def _call_env(call: Awaitable[T], timeout_s: float, record: _Record | None) -> T:
    """The environment call's result; _EnvFailed if it raised or ran past `timeout_s`.
    MalformedTurn and fatal errors (ConfigError) pass through."""
    started = time.monotonic()
    task = await _within(call, timeout_s)
    if task is None:
        raise _EnvFailed(TrajectoryStatus.ENV_TIMEOUT, f"no answer within env_step_timeout_s ({timeout_s} s)")
    if task.cancelled():
        raise _EnvFailed(TrajectoryStatus.ENV_ERROR, "the environment's call was cancelled from inside")
    error = task.exception()
    if isinstance(error, (MalformedTurn, ConfigError, _EnvFailed)):
        raise error
    if error is not None:
        raise _EnvFailed(TrajectoryStatus.ENV_ERROR, f"{type(error).__name__}: {error}") from error
    if record is not None:
        record.env_latencies_s.append(time.monotonic() - started)
    return task.result()


async def _within(call: Awaitable[T], timeout_s: float) -> asyncio.Future[T] | None:
    """`call` as a finished task, or None when it ran past `timeout_s` (then it is cancelled and
    abandoned: a call that ignores cancellation must not hold its episode, and retrieving its
    eventual exception keeps asyncio from logging it as lost). Cancelling the caller cancels it."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:  # the episode itself is being cancelled: take the call with it
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return None
    return task


def turn_span(turn: SampledTurn) -> GeneratedSpan:
    """The sampled turn as a trajectory span, its ids, logprobs and versions as `generate` returned them."""
    support = None if turn.sampling_support is None else tuple(tuple(kept) for kept in turn.sampling_support)
    return GeneratedSpan(
        tuple(turn.token_ids),
        tuple(turn.logprobs),
        tuple(turn.policy_versions),
        support,
        turn.routed_experts,
        turn.num_truncated_support,
    )


def check_turn(turn: SampledTurn, max_new_tokens: int) -> None:
    """A broken `generate` is a bug of the caller's, not an episode outcome: raise."""
    lengths = {len(turn.token_ids), len(turn.logprobs), len(turn.policy_versions)}
    num_supports = "no" if turn.sampling_support is None else len(turn.sampling_support)
    if turn.sampling_support is not None:
        lengths.add(len(turn.sampling_support))
    if len(lengths) > 1 or not 1 <= len(turn.token_ids) <= max_new_tokens:
        raise ValueError(
            f"generate returned {len(turn.token_ids)} token ids, {len(turn.logprobs)} logprobs, "
            f"{len(turn.policy_versions)} policy versions and {num_supports} kept sets for a turn of 1 to "
            f"{max_new_tokens} tokens: they must agree, within the budget it was given."
        )
