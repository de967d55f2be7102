"""The long-tail workload of `forge-rl bench multi-turn` (forge_rl/envs/long_tail.py)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from forge_rl.envs.long_tail import LongTailEnv, make_long_tail_env, pareto
from forge_rl.envs.runner import run_episode
from forge_rl.envs.trajectory import TrajectoryStatus
from tests.support.fakes import FakeGenerate
from tests.support.helpers import episode_limits
from tests.unit.envs.test_envs import renderer, sampled, tokenizer  # noqa: F401 (fixtures)


def test_turns_and_latencies_are_heavy_tailed_bounded_and_replayable():
    envs = [make_long_tail_env(0, index) for index in range(1000)]
    turns = Counter(len(env.step_latencies_s) for env in envs)
    assert set(turns) <= set(range(1, 7)) and turns[1] > 400 and turns[6] > 100  # P(>=k) = 1/k, capped at 6
    latencies = [s for env in envs for s in env.step_latencies_s]
    assert min(latencies) >= 0.02 and max(latencies) == 2.0
    assert make_long_tail_env(0, 7) == make_long_tail_env(0, 7) != make_long_tail_env(1, 7)
    assert pareto(random.Random(0), 1.0, 3.0, 1.0) <= 3.0


def test_an_episode_takes_its_drawn_turns_and_is_rewarded_on_the_last(tokenizer, renderer):  # noqa: F811
    env = LongTailEnv(3, 8, [0.0, 0.0, 0.0])
    turns = [sampled(tokenizer, "A"), sampled(tokenizer, "B"), sampled(tokenizer, "8")]
    trajectory = asyncio.run(run_episode(env, FakeGenerate(turns), renderer, episode_limits(max_turns=6)))
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    assert trajectory.num_turns == 3
    assert tokenizer.decode(trajectory.samples[0].token_ids) == "L38=AR2=BR1=8"
