"""A long-tail agentic workload for `forge-rl bench multi-turn`: heavy-tailed turn counts and
heavy-tailed environment latencies, in the tiny models' plain format.

Agentic episodes differ by orders of magnitude: most end after a turn or two on a tool that
answers at once, a few take many turns on tools that take seconds. Each episode here draws its
number of turns and each step's latency from Pareto distributions (deterministic per seed and
index), so a synchronous step waits on its slowest episode while an asynchronous loop keeps the
engine decoding other episodes:

    prompt          "L37="        the task: the larger digit, once the tool has been consulted
    model: turn     anything      every turn is accepted (this workload measures the system)
    environment     "R2="         after an awaited delay: turns still to take
    model: answer   "7"           the last turn; reward 1.0 when it starts with the larger digit

With the defaults (turns: alpha 1, 1 to 6; latency: alpha 1, 20 ms to 2 s) half the episodes take
one turn and one in six takes all six; half the steps answer within 40 ms and one in a hundred
takes two seconds. Any other shape is a `LongTailEnv` built by a factory of your own, named as
`environment.name: package.module:function`.

`ChainEnv` is the multi-agent form, the workload of `forge-rl bench multi-agent`: `depth` roles in
a chain (`forge_rl.envs.graph`), each taking one turn after the one before it, each turn's
environment step awaiting a Pareto latency, so one role's completion time is long-tailed and a
chain's is the sum of `depth` of them. Every role is rewarded when the last one's answer starts
with the larger digit (a team reward, known only when the chain has finished):

    role0           reads "L37=",  answers "7"       (its step awaits 20 ms to 2 s)
    role1           reads "7L37=", answers "7"       (the previous role's answer, then the task)
    ...
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from forge_rl.envs.environment import StepResult
from forge_rl.envs.graph import GraphStep, Seat


@dataclass
class LongTailEnv:
    left: int
    """Digits of the prompt; the answer is the larger."""
    right: int
    step_latencies_s: list[float]
    """Seconds each step awaits before answering; its length is the episode's number of turns."""

    async def reset(self) -> str:
        return f"L{self.left}{self.right}="

    async def step(self, turn_text: str) -> StepResult:
        await asyncio.sleep(self.step_latencies_s.pop(0))
        if self.step_latencies_s:
            return StepResult(observation=f"R{len(self.step_latencies_s)}=")
        return StepResult(done=True, final_reward=float(turn_text.strip()[:1] == str(max(self.left, self.right))))


def pareto(rng: random.Random, low: float, high: float, alpha: float) -> float:
    """A Pareto(alpha) draw scaled to start at `low`, capped at `high`: P(x > k * low) = k ** -alpha."""
    return min(high, low * rng.paretovariate(alpha))


def make_long_tail_env(
    seed: int,
    index: int,
    max_turns: int = 6,
    turns_alpha: float = 1.0,
    min_latency_s: float = 0.02,
    max_latency_s: float = 2.0,
    latency_alpha: float = 1.0,
) -> LongTailEnv:
    """The index-th episode under `seed` (independent of every other index, as the calculator's)."""
    rng = random.Random(f"long_tail:{seed}:{index}")
    num_turns = int(pareto(rng, 1.0, max_turns, turns_alpha))
    latencies_s = [pareto(rng, min_latency_s, max_latency_s, latency_alpha) for _ in range(num_turns)]
    return LongTailEnv(rng.randrange(10), rng.randrange(10), latencies_s)


@dataclass
class ChainEnv:
    """`len(step_latencies_s)` roles in a chain (module docstring)."""

    left: int
    right: int
    step_latencies_s: list[float]
    """Seconds each role's step awaits, role0 first; its length is the chain's depth."""

    def __post_init__(self) -> None:
        self.seats = tuple(Seat(f"role{k}", max_turns=1) for k in range(len(self.step_latencies_s)))

    async def reset(self) -> dict[str, str]:
        return {"role0": f"L{self.left}{self.right}="}

    async def step(self, agent: str, turn_text: str) -> GraphStep:
        role = int(agent.removeprefix("role"))
        await asyncio.sleep(self.step_latencies_s[role])
        answer = turn_text.strip()[:1]
        if role + 1 < len(self.step_latencies_s):
            return GraphStep({f"role{role + 1}": f"{answer}L{self.left}{self.right}="})
        reward = float(answer == str(max(self.left, self.right)))
        return GraphStep(done=True, rewards={seat.name: reward for seat in self.seats})

    async def agent_ended(self, agent: str, status) -> GraphStep:
        """A role that could not answer (out of tokens) breaks the chain: nobody earns anything."""
        return GraphStep(
            done=True, rewards={seat.name: 0.0 for seat in self.seats[: int(agent.removeprefix("role")) + 1]}
        )


def make_chain_env(
    seed: int,
    index: int,
    depth: int,
    min_latency_s: float = 0.02,
    max_latency_s: float = 2.0,
    latency_alpha: float = 1.0,
) -> ChainEnv:
    """The index-th chain of `depth` roles under `seed` (independent of every other index)."""
    rng = random.Random(f"long_tail_chain:{seed}:{index}")
    latencies_s = [pareto(rng, min_latency_s, max_latency_s, latency_alpha) for _ in range(depth)]
    return ChainEnv(rng.randrange(10), rng.randrange(10), latencies_s)


def chain_of_1(seed: int, index: int) -> ChainEnv:
    """`make_chain_env` of one role: `environment.name: forge_rl.envs.long_tail:chain_of_1`."""
    return make_chain_env(seed, index, 1)


def chain_of_2(seed: int, index: int) -> ChainEnv:
    return make_chain_env(seed, index, 2)


def chain_of_3(seed: int, index: int) -> ChainEnv:
    return make_chain_env(seed, index, 3)


def chain_of_4(seed: int, index: int) -> ChainEnv:
    return make_chain_env(seed, index, 4)


CHAINS = {1: chain_of_1, 2: chain_of_2, 3: chain_of_3, 4: chain_of_4}
"""The chain depths `forge-rl bench multi-agent` runs, by depth."""
