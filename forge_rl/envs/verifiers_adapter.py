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

What is not supported, and refused at construction rather than silently skipped: tasks whose
rewards or metrics need a runtime (a sandbox to run tests in: use forge_rl's own sandbox,
forge_rl/envs/python_tool.py), and tool-calling harnesses (MCP toolsets, bash): forge_rl's chat
endpoint serves no tools (it answers 400 naming `tools`).
"""

from __future__ import annotations

import argparse
import functools
import inspect
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
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.dialects.chat import message_to_wire, parse_message
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        program, data = _chat_program(), self.task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [message_to_wire(message) for message in data.prompt or []]
        # What the program's main() does with its argv, minus building its own client and MCP
        # servers: no local tools, no tool gate, no compaction.
        args = argparse.Namespace(tool_interception_url="", bash=False, edit=False, search=False)
        compactor = program["Compactor"](client, self.model, [], False, None)
        compactor.note_good(messages)
        num_prompt_messages = len(messages)
        await program["run_chat_loop"](args, compactor, messages, {}, {}, None)
        # The trace the task scores: the conversation as one branch of message nodes, the model's
        # replies marked sampled (their tokens live in forge_rl's trajectory, not here).
        trace = Trace(
            task=TraceTask(type=type(self.task).__name__, data=data, key=self.task.key, hash=self.task.hash),
            agent=AgentInfo(config=AgentConfig()),
        )
        for index, message in enumerate(messages):
            sampled = index >= num_prompt_messages and message.get("role") == "assistant"
            node = MessageNode(parent=index - 1 if index else None, message=parse_message(message), sampled=sampled)
            trace.nodes.append(node)
        await self.task.score(trace)
        return trace.reward


@functools.cache
def _chat_program() -> dict[str, Any]:
    """The namespace of verifiers' bundled chat program, executed as a module (not as __main__,
    so its entry point does not run): the functions its null harness runs in a sandbox."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    namespace: dict[str, Any] = {"__name__": "verifiers_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
    return namespace



def sums_environment(seed: int, index: int) -> VerifiersEnvironment:
    """A small verifiers environment for the tiny models, built with verifiers' own classes
    (forge_rl/envs/verifiers_sums.py): "3+4=" answered "7"."""
    from forge_rl.envs.verifiers_sums import make_sums_environment

    return make_sums_environment(seed)(seed, index)
