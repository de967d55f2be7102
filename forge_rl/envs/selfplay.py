"""Proposer/solver self-play on the tiny models' vocabulary: one policy writes tasks for itself.

One episode is a graph of 1 + num_solvers agents (`forge_rl.envs.graph`):

    proposer   reads "P=", writes a task: the first 2 to 4 digits of its turn ("37", "3791")
    solver/k   reads "M37=" ("M3791="), answers the largest digit: "7" ("9")

The longer the task, the harder for the solvers (the max-of-two task of
`forge_rl.tasks.synthetic` is the shortest), so a proposer rewarded for tasks solved only
sometimes has a direction to go once the short ones are solved every time.

Rewards, known once every solver has answered:

    solver/k   1.0 when its answer's leading number is the task's largest digit, else 0.0
    proposer   learnability of its task: with s the solvers' solve rate, 1 - s when 0 < s < 1,
               0.0 when s is 0 or 1 (a task always or never solved teaches nothing), as Absolute
               Zero's proposer reward (Zhao et al. 2025); or s itself under
               proposer_reward="solve_rate" (a cooperative proposer)
               -1.0 for a turn with fewer than two digits: no task (a format penalty below any
               task's reward, so the proposer learns to write one)

Credit: the proposers of a prompt's group are baselined against each other (seat baseline
"group"); each solver against the other solvers of its own episode (baseline "episode"), the GRPO
group of the task it answered. With `environment.name: selfplay` the same policy plays both seats;
`forge-rl grpo --config configs/selfplay_tiny_cpu.yaml` trains it from scratch on a CPU.

`environment.name: selfplay_chat` is the same game with each solver played by agent code written
against the OpenAI API (`chat_solver`, the seat's `Seat.player`): it asks the model through an
`openai.AsyncOpenAI` client and asks once more when the reply holds no digit, and both calls are
the solver's view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from forge_rl.envs.environment import Observation
from forge_rl.envs.graph import GraphStep, Seat
from forge_rl.envs.trajectory import TrajectoryStatus
from forge_rl.tasks.synthetic import leading_number_reward

PROPOSE = "P="
NO_TASK_REWARD = -1.0
MAX_TASK_DIGITS = 4
_DIGIT = re.compile(r"\d")


@dataclass
class ProposerSolverEnv:
    """One self-play episode (module docstring)."""

    num_solvers: int = 4
    proposer_reward: Literal["learnability", "solve_rate"] = "learnability"
    seats: ClassVar[tuple[Seat, ...]] = (
        Seat("proposer", baseline="group", max_turns=1),
        Seat("solver", baseline="episode", max_turns=1),
    )
    task: tuple[int, ...] | None = None
    solved: dict[str, float] = field(default_factory=dict)
    """Solver agent -> its reward, as they answer."""

    def __post_init__(self) -> None:
        if self.num_solvers < 1:
            raise ValueError(f"ProposerSolverEnv.num_solvers ({self.num_solvers}) must be >= 1")
        if self.proposer_reward not in ("learnability", "solve_rate"):
            raise ValueError(
                f"ProposerSolverEnv.proposer_reward ({self.proposer_reward!r}) must be 'learnability' or 'solve_rate'"
            )

    async def reset(self) -> dict[str, str]:
        return {"proposer": PROPOSE}

    async def step(self, agent: str, turn_text: str) -> GraphStep:
        if agent == "proposer":
            digits = _DIGIT.findall(turn_text)[:MAX_TASK_DIGITS]
            if len(digits) < 2:
                return GraphStep(done=True, rewards={"proposer": NO_TASK_REWARD})
            self.task = tuple(int(d) for d in digits)
            prompt = f"M{''.join(digits)}="
            return GraphStep({f"solver/{k}": prompt for k in range(self.num_solvers)})
        assert self.task is not None  # solvers are addressed only once the proposer has set the task
        self.solved[agent] = leading_number_reward(turn_text, str(max(self.task)))
        return self._close_when_answered()

    async def agent_ended(self, agent: str, status: TrajectoryStatus) -> GraphStep:
        """A solver out of tokens failed its task; a proposer that wrote nothing proposed none."""
        if agent == "proposer":
            return GraphStep(done=True, rewards={"proposer": NO_TASK_REWARD})
        self.solved[agent] = 0.0
        return self._close_when_answered()

    def _close_when_answered(self) -> GraphStep:
        if len(self.solved) < self.num_solvers:
            return GraphStep()
        rate = sum(self.solved.values()) / self.num_solvers
        return GraphStep(done=True, rewards={"proposer": proposer_reward(rate, self.proposer_reward), **self.solved})


async def chat_solver(client: Any, observation: Observation) -> str:
    """A solver as OpenAI-style agent code: the task as a user message; a reply without a digit
    is answered with the task again (the plain format's chat is the messages' texts in a row, so
    the second call continues the first's sample); the last reply is the turn."""
    messages = [{"role": "user", "content": observation}]
    reply = ""
    for _ in range(2):
        completion = await client.chat.completions.create(model="policy", messages=messages)
        reply = completion.choices[0].message.content or ""
        if _DIGIT.search(reply):
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
    return reply


@dataclass
class ChatSolverSelfPlayEnv(ProposerSolverEnv):
    """`ProposerSolverEnv` whose solvers are played by `chat_solver` (two model calls at most)."""

    seats: ClassVar[tuple[Seat, ...]] = (
        Seat("proposer", baseline="group", max_turns=1),
        Seat("solver", baseline="episode", max_turns=2, player=chat_solver),
    )


def proposer_reward(solve_rate: float, kind: Literal["learnability", "solve_rate"] = "learnability") -> float:
    """The proposer's reward for a task its solvers solved at `solve_rate` (module docstring)."""
    if kind == "solve_rate":
        return solve_rate
    return 0.0 if solve_rate in (0.0, 1.0) else 1.0 - solve_rate


def make_selfplay_env(seed: int, index: int) -> ProposerSolverEnv:
    """Every episode alike: the proposer's turn is the only source of tasks."""
    return ProposerSolverEnv()


def make_chat_selfplay_env(seed: int, index: int) -> ChatSolverSelfPlayEnv:
    """`make_selfplay_env` with the solvers played by OpenAI-style agent code (`chat_solver`)."""
    return ChatSolverSelfPlayEnv()
