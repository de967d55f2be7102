"""Python tool: the model runs code to answer a question; the code runs as untrusted code in
`forge_rl.envs.sandbox`, never in this process.

Chat messages, for models with a chat template:

    prompt          system: the two formats below; user: the question
    model           a ```python fenced block        -> the code runs in a fresh sandbox; the
                                                       observation is its output and how it ended
    model           "Answer: 42"                    -> closes the episode: 1.0 when the text after
                                                       "Answer:" is the expected answer, else 0.0
    model           anything else                   -> malformed: told the two formats again

A turn holding both a code block and an answer runs the code (the answer waits for its output).
Observations are user messages: every chat template knows that role, while "tool" needs a template
with tool support (and, in some, a tool-call id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from forge_rl.envs.environment import MalformedTurn, Message, StepResult
from forge_rl.envs.sandbox import SandboxConfig, run_python

INSTRUCTIONS = (
    "Solve the problem. To run Python, write one ```python code block; you will see its output. "
    "When you know the answer, reply with 'Answer: ' followed by it alone."
)
_CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_ANSWER = re.compile(r"Answer:\s*(.+)")


@dataclass
class PythonToolEnv:
    question: str
    answer: str
    """The expected answer, compared with the text after "Answer:" (surrounding space stripped)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    @property
    def max_step_s(self) -> float:
        """A step runs one sandbox, start-up included: EpisodeLimits.env_step_timeout_s must cover it."""
        return self.sandbox.max_run_s

    async def reset(self) -> list[Message]:
        return [Message("system", INSTRUCTIONS), Message("user", self.question)]

    async def step(self, turn_text: str) -> StepResult:
        if code := _CODE_BLOCK.search(turn_text):
            result = await run_python(code.group(1), self.sandbox)
            output = result.stdout + result.stderr + ("\n(output truncated)" if result.output_truncated else "")
            return StepResult(observation=[Message("user", f"Output:\n{output}\n({result.ended_by})")])
        if answer := _ANSWER.search(turn_text):
            return StepResult(done=True, final_reward=float(answer.group(1).strip() == self.answer))
        raise MalformedTurn([Message("user", f"Neither a ```python block nor 'Answer: ...'. {INSTRUCTIONS}")])
