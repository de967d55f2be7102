"""Calculator tool: products of two-digit numbers, which the tiny from-scratch model cannot compute
alone but can learn to hand to a tool and copy back.

Plain text in the tiny char tokenizer's alphabet (digits, A-Z, = + - * / and space), so nothing
had to be added to its vocabulary:

    prompt                    "37*52="
    model: tool call          "C37*52"         C, then a number, an operator (+ - *), a number
    environment: its result   "R1924="         context, never trained
    model: answer             "1924"           a bare number; closes the episode
    environment: error        "E CALL=" (a call that does not parse), "E FORMAT=" (neither a call
                              nor a number), "E NOTOOL=" (a call in the no-tool baseline,
                              `calculator_no_tool`): a malformed turn, answered and counted

Reward: 1.0 when the answer is the product, else 0.0; the tool earns nothing by itself. One
episode with a call, as the tiny model reads it (25 tokens, within its 128):

    <bos>37*52=C37*52<eos>R1924=1924<eos>
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

from forge_rl.envs.environment import MalformedTurn, StepResult

_CALL = re.compile(r"C(\d{1,6})([+*-])(\d{1,6})")
"""A tool call. Operands are capped at 6 digits so a result always fits the context."""
_ANSWER = re.compile(r"-?\d{1,12}")
MALFORMED_CALL = "E CALL="
MALFORMED_TURN = "E FORMAT="
NO_TOOL = "E NOTOOL="


@dataclass
class CalculatorEnv:
    """One product to find: `left` * `right`."""

    left: int
    right: int
    tool: bool = True
    """False: the no-tool baseline, the same problem with every call refused (a malformed turn)."""
    replayable: ClassVar[bool] = True
    """Its answers depend on the problem and the turns alone: an episode can be forked by replaying
    its turns (`forge_rl.envs.forks`)."""

    async def reset(self) -> str:
        return f"{self.left}*{self.right}="

    def demonstration(self) -> list[str]:
        """A well-formed episode's turns: the call, then its result copied (the supervised warm-up's
        material, `forge_rl.envs.demonstrations`)."""
        answer = str(self.left * self.right)
        return [f"C{self.left}*{self.right}", answer] if self.tool else [answer]

    async def step(self, turn_text: str) -> StepResult:
        text = turn_text.strip()
        if text.startswith("C"):
            if not self.tool:
                raise MalformedTurn(NO_TOOL)
            return StepResult(observation=f"R{calculate(text)}=")
        if _ANSWER.fullmatch(text):
            return StepResult(done=True, final_reward=float(int(text) == self.left * self.right))
        raise MalformedTurn(MALFORMED_TURN)


def calculate(call: str) -> int:
    """The value of a tool call such as "C37*52"; MalformedTurn when it does not parse."""
    match = _CALL.fullmatch(call)
    if match is None:
        raise MalformedTurn(MALFORMED_CALL)
    left, operator, right = int(match.group(1)), match.group(2), int(match.group(3))
    return {"+": left + right, "-": left - right, "*": left * right}[operator]


def make_calculator_env(seed: int, index: int) -> CalculatorEnv:
    """The index-th problem under `seed`: two operands from 10 to 99, independent of any other
    index (as forge_rl/tasks/synthetic.make_prompt, so a dataset cursor replays exactly)."""
    rng = random.Random(f"calculator:{seed}:{index}")
    return CalculatorEnv(rng.randrange(10, 100), rng.randrange(10, 100))


def make_calculator_env_without_tool(seed: int, index: int) -> CalculatorEnv:
    """The same problem as `make_calculator_env(seed, index)`, to be answered without the tool: the
    baseline the calculator recipe is measured against (docs/environments.md)."""
    env = make_calculator_env(seed, index)
    env.tool = False
    return env
