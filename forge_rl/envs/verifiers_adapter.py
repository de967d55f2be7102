"""verifiers environments (`verifiers` 0.4, https://github.com/PrimeIntellect-ai/verifiers) as
forge_rl agent environments, in process and offline.

A verifiers environment is a taskset (`vf.Taskset` yielding `vf.Task`s: a prompt, and `@vf.reward`
methods that score the finished trace) played by a harness: a chat program written against the
OpenAI client, which verifiers normally installs with uv and runs in a sandbox, its model calls
going through verifiers' interception server to an inference endpoint. forge_rl keeps the task
and the program and removes the machinery between them: verifiers' own chat program (the text
its null harness ships, `verifiers.v1.harnesses.utils.launch.CHAT_PROGRAM_SOURCE`, unmodified)
runs in the rollout's process against forge_rl's in-process chat client
(`forge_rl.envs.chat_client`), which samples each call on the generator and records its ids,
logprobs and versions; then the task's own `score` computes the reward from the trace. No uv, no
sandbox, no socket, no network.

    make_env = verifiers_environment(MyTaskset(vf.TasksetConfig()))   # make_env(seed, index)

A verifiers `vf.Env` (a taskset plus how one task becomes an episode: `setup`, `run(task,
agents)`, `finalize`) is played by its own code too, with forge_rl's seat (`ChatSeat`) as its
agent: `agents.<seat>.run(task)` is the chat program on the task's prompt, and
`agents.<seat>.interaction(task)` holds the run open while the environment plays the user, one
`turn(message)` (one model call) at a time, as verifiers' OpenEnvEnv and TextArenaEnv do. The
seat's `max_turns` (verifiers' AgentConfig) ends a run as verifiers ends it, and the task's own
rewards score the trace when the interaction closes.

    make_env = verifiers_env_environment(OpenEnvEnv(OpenEnvEnvConfig(taskset=OpenEnvConfig(id="openenv", base_url=URL))))

An env with several seats (verifiers' user-sim, a judge seat) or a seat run several times
(best-of-n) is played with the policy in every seat: each run is an agent of an episode graph
(`forge_rl.envs.graph`), trained with credit per seat, except seats the env marks untrainable.
Seats played by other models (a fixed judge of its own weights) are not served yet.

What is not supported: tasks whose rewards or metrics need a runtime (a sandbox to run tests in:
use forge_rl's own sandbox, `forge_rl.envs.python_tool`), refused at construction rather than
silently skipped; and tool-calling harnesses (MCP toolsets, bash, edit): the chat program always
runs with no tools. The chat endpoint now serves tools (a chat template that renders them and
vLLM's tool parser: docs/environments.md), so the calls themselves would work; what is missing
is running the tools: MCP toolsets are HTTP servers verifiers starts beside each rollout, and
bash or edit run the model's commands on the host, which forge_rl runs only in its sandbox
(`forge_rl.envs.sandbox`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from forge_rl.envs.chat_client import ChatActivity, ChatAgentEnvironment, ChatSession, run_watched
from forge_rl.envs.chat_requests import MODEL_NAME
from forge_rl.envs.graph import EpisodeGraph, Seat, TurnNode
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.runner import EpisodeLimits, GenerateTurn
from forge_rl.envs.trajectory import Trajectory, TrajectoryStatus
from forge_rl.errors import ConfigError


def verifiers_environment(taskset: Any) -> Callable[[int, int], VerifiersEnvironment]:
    """make_env(seed, index) for `taskset` (a bounded `vf.Taskset`): the index-th task, cycling."""
    tasks = list(taskset)
    if not tasks:
        raise ConfigError(f"{type(taskset).__name__} yielded no task: nothing to play.")
    for task in tasks:
        check_offline(task)
    return lambda seed, index: VerifiersEnvironment(tasks[index % len(tasks)])


def check_offline(task: Any) -> None:
    """ConfigError when a reward or metric of `task` needs a runtime (verifiers would skip it
    without one, and the reward would be silently partial)."""
    needy = [
        fn.__name__
        for kind in ("reward", "metric")
        for fn in task.hooks(kind)
        if (p := inspect.signature(fn).parameters.get("runtime")) is not None and p.default is inspect.Parameter.empty
    ]
    if needy:
        raise ConfigError(
            f"{type(task).__name__}'s {', '.join(needy)} need a runtime (a sandbox), which forge_rl's verifiers "
            "adapter does not provide: the reward would be partial. Score in the task without one, or run the "
            "code in forge_rl's sandbox (forge_rl/envs/python_tool.py)."
        )


class VerifiersEnvironment(ChatAgentEnvironment):
    """One verifiers task, played by verifiers' chat program against forge_rl's generator: an
    agent environment whose agent is `rollout`."""

    def __init__(self, task: Any, model: str = MODEL_NAME):
        super().__init__(self.rollout)
        self.task, self.model = task, model

    async def rollout(self, client: Any) -> float:
        """verifiers' chat loop on the task's prompt with `client`, then the task's score: the reward."""
        trace = await ChatSeat(lambda: (client, None), self.model).run(self.task)
        return trace.reward


def verifiers_env_environment(env: Any, max_tasks: int = 10_000) -> Callable[[int, int], VerifiersEnvEpisode]:
    """make_env(seed, index) for a verifiers `vf.Env`: the environment's own `run(task, agents)`
    plays each episode (the environment speaking as the user turn by turn, as verifiers' OpenEnvEnv
    and TextArenaEnv do, or relaying between seats, as its user-sim and best-of-n envs do); the
    index-th task of its taskset (the first `max_tasks` of an infinite one), cycling. Every seat is
    played by the policy (`VerifiersEnvEpisode`)."""
    taskset = env.taskset
    tasks = list(itertools.islice(taskset, max_tasks) if getattr(taskset, "INFINITE", False) else taskset)
    if not tasks:
        raise ConfigError(f"{type(taskset).__name__} yielded no task: nothing to play.")
    for task in tasks:
        check_offline(task)
    return lambda seed, index: VerifiersEnvEpisode(env, tasks[index % len(tasks)])


class VerifiersEnvEpisode:
    """One episode of a verifiers `vf.Env` on one task: `setup`, `run` and `finalize` as verifiers
    calls them, with forge_rl's seat (`ChatSeat`) as each of the environment's agents. Each run of
    a seat (an `agents.<seat>.run` or `.interaction`) is an agent of the episode with a chat session
    of its own (its own view, its own trajectory), its reward the task's score of its trace: a
    single run of a single seat is a single-agent episode (its trajectory), anything else an
    episode graph (`forge_rl.envs.graph`) whose agents are the seats, or `seat/k` for the k-th run
    of a seat that ran more than once. A seat the environment's setup marks untrainable
    (`agents.user.trainable = False`, a modeled user) is played by the policy and never trained.
    Runs are played as the environment's code orders them; their turns are chained per agent (the
    relays between seats are the environment's own code, not recorded as edges)."""

    def __init__(self, env: Any, task: Any, model: str = MODEL_NAME):
        self.env, self.task, self.model = env, task, model

    async def play(
        self, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits
    ) -> Trajectory | EpisodeGraph:
        from verifiers.v1 import Agents

        activity, clients, seats = ChatActivity(), [], {}

        def open_run() -> tuple[Any, ChatSession]:
            session = ChatSession(generate, renderer, limits, activity)
            clients.append(session.client())
            return clients[-1], session

        def make(name: str, config: Any) -> ChatSeat:
            seats[name] = ChatSeat(open_run, self.model, config.max_turns, name)  # the seat's own turn cap
            return seats[name]

        agents = Agents(self.env.config, make)
        episode = asyncio.ensure_future(self._episode(agents, seats))
        try:
            ended = await run_watched(episode, activity, limits.env_step_timeout_s)
        finally:
            for client in clients:
                await client.close()
        if ended is None and episode.exception() is not None:
            error = episode.exception()
            ended = (TrajectoryStatus.ENV_ERROR, f"{type(self.env).__name__} raised {type(error).__name__}: {error}")
        views = {}
        for name, seat in seats.items():
            runs: Sequence[tuple[ChatInteraction | None, ChatSession | None]] = (
                seat.runs or [(None, ChatSession(generate, renderer, limits))]  # a seat nobody played: its failure row
            )
            for k, (interaction, session) in enumerate(runs):
                assert session is not None  # open_run gives each run of this episode its session
                agent = name if len(runs) == 1 else f"{name}/{k}"
                views[agent] = _run_trajectory(interaction, session, ended)
        if len(views) == 1:
            return next(iter(views.values()))
        graph_seats = {name: Seat(name, trainable=bool(seat.trainable)) for name, seat in seats.items()}
        nodes: list[TurnNode] = []
        for agent, trajectory in views.items():
            first = len(nodes)
            nodes += [TurnNode(agent, k, (first + k - 1,) if k else ()) for k in range(trajectory.num_turns)]
        return EpisodeGraph(views, nodes, graph_seats, None if ended is None else ended[1])

    async def _episode(self, agents: Any, seats: dict[str, ChatSeat]) -> None:
        from verifiers.v1 import Episode
        from verifiers.v1.episode import EnvInfo
        from verifiers.v1.trace import TraceTask

        await self.env.setup(agents)
        await self.env.run(self.task, agents)
        traces = [interaction.trace for seat in seats.values() for interaction, _ in seat.runs]
        if not traces:
            raise RuntimeError(f"{type(self.env).__name__}.run() ran no agent: every episode must carry a run")
        task = self.task
        episode = Episode(
            env=EnvInfo(id=self.env.config.env_id),
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            traces=traces,
        )
        await self.env.finalize(task, episode)


def _run_trajectory(interaction: Any, session: ChatSession, ended: tuple[TrajectoryStatus, str] | None) -> Trajectory:
    """One run's trajectory: the episode's failure (`ended`), else the run's own outcome with the
    task's score of its trace (`ChatSession.outcome`)."""
    if ended is not None:
        return session.trajectory(*ended)
    return session.outcome(None if interaction is None else interaction.trace.reward)


LIMIT_CODES = frozenset({"max_turns_exceeded", "context_length_exceeded"})
"""The codes of forge_rl's chat endpoint's limit errors (`forge_rl.envs.chat_client`): the run
is over, as verifiers ends a run at a framework limit (a terminated segment)."""


class ChatSeat:
    """The policy's seat in a verifiers episode, in place of verifiers' `Agent` (a harness
    program in a sandbox behind an interception server): the same two arrows, `run(task)` (the
    task's prompt, one harness run) and `interaction(task)` (the caller plays the user, one
    `turn()` per segment), with verifiers' own chat program calling forge_rl's chat client.
    `open_run()` gives each run its client, and the session recording it (None: the caller's own,
    which records one run only)."""

    trainable = True
    """verifiers' seat flag (an env's setup may read or set it): False keeps the seat's runs out
    of every loss (a modeled user)."""

    def __init__(
        self,
        open_run: Callable[[], tuple[Any, ChatSession | None]],
        model: str = MODEL_NAME,
        max_turns: int | None = None,
        name: str = "agent",
    ):
        self.open_run, self.model, self.name = open_run, model, name
        self.max_turns = max_turns
        """verifiers' `AgentConfig.max_turns`: model turns per run, None for no cap. Reaching it
        ends the run as verifiers ends it (stop condition `max_turns`, the env goes on to score);
        forge_rl's `EpisodeLimits.max_turns` stays the hard cap, whose episodes end truncated."""
        self.runs: list[tuple[ChatInteraction, ChatSession | None]] = []
        """Each run's interaction (its trace) and session, in the order they started."""

    async def run(self, task: Any) -> Any:
        """The task's prompt, answered by one run of the chat program; the scored trace."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any):
        """The run held open turn by turn (`ChatInteraction`); leaving it closes the exchange as
        `user_closed` and scores the trace with the task's own rewards, as verifiers does."""
        client, session = self.open_run()
        if session is None and self.runs:
            raise RuntimeError("this verifiers seat records one run on its one chat client; the task started a second")
        interaction = ChatInteraction(task, client, self.model, self.max_turns, self.name, self.trainable)
        self.runs.append((interaction, session))
        try:
            yield interaction
        finally:
            interaction.trace.stop("user_closed")
        await task.score(interaction.trace)


class ChatInteraction:
    """verifiers' `Interaction` surface on forge_rl's chat client: `turn(message)` adds the user's
    message (none: a prompted task speaks first) and runs one segment of verifiers' chat program
    (one model call: the program is given no tools), returning verifiers' `Segment`; `trace` holds the
    conversation as verifiers' message nodes, the model's replies marked sampled (their tokens
    live in forge_rl's trajectory)."""

    def __init__(
        self,
        task: Any,
        client: Any,
        model: str,
        max_turns: int | None = None,
        agent: str = "agent",
        trainable: bool = True,
    ):
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.dialects.chat import message_to_wire
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        self.program, data = _chat_program(), task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [message_to_wire(message) for message in data.prompt or []]
        self.messages, self.num_prompt_messages = messages, len(messages)
        # What the program's main() builds from its argv, minus its own client and MCP servers:
        # no local tools, no tool gate, no compaction.
        self.args = argparse.Namespace(tool_interception_url="", bash=False, edit=False, search=False)
        self.compactor = self.program["Compactor"](client, model, [], False, None)
        self.compactor.note_good(messages)
        self.trace = Trace(
            task=TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=AgentConfig(), name=agent, trainable=trainable),
        )
        self.max_turns, self.over = max_turns, False

    async def turn(self, message: str | None = None) -> Any:
        from openai import BadRequestError
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects.chat import parse_message

        if self.max_turns is not None and self.trace.num_turns >= self.max_turns:
            self.trace.stop("max_turns")  # verifiers' RolloutLimits: the turn is refused, the run ends
            self.over = True
        if self.over:
            return Segment(messages=[], terminated=True)
        if message is not None:
            self.messages.append({"role": "user", "content": message})
        elif not self.messages or self.messages[-1].get("role") == "assistant":
            raise ValueError("turn() without a message: the task has no prompt to answer, or the model spoke last")
        before = len(self.messages)
        try:
            await self.program["run_chat_loop"](self.args, self.compactor, self.messages, {}, {}, None)
        except BadRequestError as error:
            if error.code not in LIMIT_CODES:
                raise
        self._record_nodes()
        replies = self.messages[before:]
        if not replies:  # a limit ended the run (the program returns on a context overflow)
            self.over = True
            return Segment(messages=[], terminated=True)
        return Segment(messages=[parse_message(reply) for reply in replies])

    def _record_nodes(self) -> None:
        from verifiers.v1.dialects.chat import parse_message
        from verifiers.v1.graph import MessageNode

        nodes = self.trace.nodes
        for index in range(len(nodes), len(self.messages)):
            message = self.messages[index]
            sampled = index >= self.num_prompt_messages and message.get("role") == "assistant"
            nodes.append(
                MessageNode(parent=index - 1 if index else None, message=parse_message(message), sampled=sampled)
            )


@functools.cache
def _chat_program() -> dict[str, Any]:
    """The namespace of verifiers' bundled chat program, executed as a module (not as __main__,
    so its entry point does not run): the functions its null harness runs in a sandbox."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    namespace: dict[str, Any] = {"__name__": "verifiers_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
    return namespace
