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
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from forge_rl.envs.environment import StepResult


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
