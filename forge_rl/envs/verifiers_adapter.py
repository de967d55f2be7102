"""verifiers environments (`verifiers` 0.4, https://github.com/PrimeIntellect-ai/verifiers) as
forge_rl agent environments, in process and offline.

A verifiers environment is a taskset (`vf.Taskset` yielding `vf.Task`s: a prompt, and `@vf.reward`
methods that score the finished trace) played by a harness: a chat program written against the
OpenAI client, which verifiers normally installs with uv and runs in a sandbox, its model calls
going through verifiers' interception server to an inference endpoint. forge_rl keeps the task
and the program and removes the machinery between them: verifiers' own chat program (the text
its null harness ships, `verifiers.v1.harnesses.utils.launch.CHAT_PROGRAM_SOURCE`, unmodified)
runs in the rollout's process against forge_rl's in-process chat client
(forge_rl/envs/chat_client.py), which samples each call on the generator and records its ids,
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

What is not supported: tasks whose rewards or metrics need a runtime (a sandbox to run tests in:
use forge_rl's own sandbox, forge_rl/envs/python_tool.py) and envs with more than one seat (a
modeled user, a judge: each needs a model of its own), both refused at construction rather than
silently skipped; and tool-calling harnesses (MCP toolsets, bash, edit): the chat program always
runs with no tools. The chat endpoint now serves tools (a chat template that renders them and
vLLM's tool parser: docs/environments.md), so the calls themselves would work; what is missing
is running the tools: MCP toolsets are HTTP servers verifiers starts beside each rollout, and
bash or edit run the model's commands on the host, which forge_rl runs only in its sandbox
(forge_rl/envs/sandbox.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any

from forge_rl.envs.chat_client import MODEL_NAME, ChatAgentEnvironment
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
        fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind)
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
        trace = await ChatSeat(client, self.model).run(self.task)
        return trace.reward


def verifiers_env_environment(env: Any, max_tasks: int = 10_000) -> Callable[[int, int], VerifiersEnvEpisode]:
    """make_env(seed, index) for a verifiers `vf.Env`: the environment's own `run(task, agents)`
    plays each episode, the environment speaking as the user turn by turn (verifiers' OpenEnvEnv
    and TextArenaEnv do so); the index-th task of its taskset (the first `max_tasks` of an
    infinite one), cycling. One seat only: the policy's (an env with a modeled user or a judge
    seat needs a model per seat, which forge_rl does not serve)."""
    from verifiers.v1.configs.agent import agent_config_fields

    seats = list(agent_config_fields(env.config))
    if len(seats) != 1:
        raise ConfigError(
            f"{type(env).__name__} declares {len(seats)} agent seats ({', '.join(seats)}); forge_rl plays envs "
            "with one seat, the policy's. A modeled user or judge needs a model of its own."
        )
    taskset = env.taskset
    tasks = list(itertools.islice(taskset, max_tasks) if getattr(taskset, "INFINITE", False) else taskset)
    if not tasks:
        raise ConfigError(f"{type(taskset).__name__} yielded no task: nothing to play.")
    for task in tasks:
        check_offline(task)
    return lambda seed, index: VerifiersEnvEpisode(env, tasks[index % len(tasks)])


class VerifiersEnvEpisode(ChatAgentEnvironment):
    """One episode of a verifiers `vf.Env` on one task: `setup`, `run` and `finalize` as verifiers
    calls them, with forge_rl's seat (`ChatSeat`) as the environment's one agent."""

    def __init__(self, env: Any, task: Any, model: str = MODEL_NAME):
        super().__init__(self.rollout)
        self.env, self.task, self.model = env, task, model

    async def rollout(self, client: Any) -> float:
        from verifiers.v1 import Agents, Episode
        from verifiers.v1.episode import EnvInfo
        from verifiers.v1.trace import TraceTask

        seat = ChatSeat(client, self.model)

        def make(name: str, config: Any) -> ChatSeat:
            seat.max_turns = config.max_turns  # the seat's own turn cap (verifiers' --env.<seat>.max-turns)
            return seat

        agents = Agents(self.env.config, make)
        await self.env.setup(agents)
        await self.env.run(self.task, agents)
        if seat.trace is None:
            raise RuntimeError(f"{type(self.env).__name__}.run() ran no agent: every episode must carry a run")
        task = self.task
        episode = Episode(
            env=EnvInfo(id=self.env.config.env_id),
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            traces=[seat.trace],
        )
        await self.env.finalize(task, episode)
        return seat.trace.reward


LIMIT_CODES = frozenset({"max_turns_exceeded", "context_length_exceeded"})
"""The codes of forge_rl's chat endpoint's limit errors (forge_rl/envs/chat_client.py): the run
is over, as verifiers ends a run at a framework limit (a terminated segment)."""


class ChatSeat:
    """The policy's seat in a verifiers episode, in place of verifiers' `Agent` (a harness
    program in a sandbox behind an interception server): the same two arrows, `run(task)` (the
    task's prompt, one harness run) and `interaction(task)` (the caller plays the user, one
    `turn()` per segment), with verifiers' own chat program calling forge_rl's chat client."""

    trainable = True
    """verifiers' seat flag (an env's setup may read or set it); the one seat is the policy."""

    def __init__(self, client: Any, model: str = MODEL_NAME, max_turns: int | None = None):
        self.client, self.model = client, model
        self.max_turns = max_turns
        """verifiers' `AgentConfig.max_turns`: model turns per run, None for no cap. Reaching it
        ends the run as verifiers ends it (stop condition `max_turns`, the env goes on to score);
        forge_rl's `EpisodeLimits.max_turns` stays the hard cap, whose episodes end truncated."""
        self.trace: Any = None
        """The trace of the seat's run: one run per episode."""

    async def run(self, task: Any) -> Any:
        """The task's prompt, answered by one run of the chat program; the scored trace."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any):
        """The run held open turn by turn (`ChatInteraction`); leaving it closes the exchange as
        `user_closed` and scores the trace with the task's own rewards, as verifiers does."""
        if self.trace is not None:
            raise RuntimeError("forge_rl's verifiers seat plays one run per episode; this env started a second")
        interaction = ChatInteraction(task, self.client, self.model, self.max_turns)
        self.trace = interaction.trace
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

    def __init__(self, task: Any, client: Any, model: str, max_turns: int | None = None):
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
            agent=AgentInfo(config=AgentConfig()),
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
            nodes.append(MessageNode(parent=index - 1 if index else None, message=parse_message(message), sampled=sampled))


@functools.cache
def _chat_program() -> dict[str, Any]:
    """The namespace of verifiers' bundled chat program, executed as a module (not as __main__,
    so its entry point does not run): the functions its null harness runs in a sandbox."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    namespace: dict[str, Any] = {"__name__": "verifiers_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
    return namespace


