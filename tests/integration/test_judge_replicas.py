"""scorer.judge.replicas: the judge served by several engines, each verdict request to the least busy.

Two real judge engines (vLLM on CPU, the tiny model as the judge) on a mesh of two processes, and a
real ScorerActor over them, as the scorer's supervisor wires them (forge_rl/actors/scorer_supervisor.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from monarch.actor import this_host

from forge_rl.actors.generator import GeneratorActor
from forge_rl.actors.scorer import ScorerActor
from forge_rl.engines.config import GeneratorConfig
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.scoring.judge import JudgeConfig
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.types import Completion, CompletionStatus, Episode

pytestmark = pytest.mark.integration

JUDGE = JudgeConfig(
    template="{prompt}{completion}=",  # the tiny model's characters
    prompt_format="plain",  # the tiny model has no chat template
    generator=GeneratorConfig(max_new_tokens=2),
    max_model_len=128,
    timeout_s=120,
    replicas=2,
)


def episode(episode_id: int, *texts: str) -> Episode:
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=text) for text in texts]
    return Episode(episode_id, "M37=", "7", [1, 2], completions)


def test_replicas_of_the_judge_share_a_scorers_verdicts(model_dir):
    """Two groups scored at once: every completion gets its verdict (the tiny random judge's hold
    no score, so each is ERRORED as unparsable and counted), and both engines decoded some."""
    config = ScorerConfig(judge=dataclasses.replace(JUDGE, path=model_dir), reward_fn_weight=0.0)

    async def main():
        judge_procs = spawn_procs(this_host(), "judge", JUDGE.replicas)
        scorer_procs = spawn_procs(this_host(), "scorer")
        judge = judge_procs.spawn(
            "judge", GeneratorActor, config.judge.generator, str(model_dir), JUDGE.max_model_len, None, "judge"
        )
        try:
            starts = await judge.start.call()
            scorer = scorer_procs.spawn("scorer", ScorerActor, config, "leading_number", 0, None, None, judge)
            scored = await asyncio.gather(
                scorer.score.call_one([episode(0, "7", "3", "9")]), scorer.score.call_one([episode(1, "1", "7", "5")])
            )
            forward = await judge.forward_time.call()
            return (
                [starts.get(i) for i in range(2)],
                scored,
                [forward.get(i) for i in range(2)],
                await scorer.stats.call_one(),
            )
        finally:
            await judge.shutdown.call()
            for procs in (judge_procs, scorer_procs):
                await procs.stop()

    starts, scored, forward, stats = asyncio.run(main())
    assert starts[0]["pid"] != starts[1]["pid"]
    completions = [c for group in scored for e in group for c in e.completions]
    assert len(completions) == 6 and all(c.status == CompletionStatus.ERRORED for c in completions)
    assert all(c.error.startswith("judge: unparsable verdict") for c in completions)
    assert stats["scorer/judge/verdicts"] == 6
    # Each engine ran forward passes: both served verdicts, and the scorer counts what it sent each.
    assert all(f and f["forward_s"] > 0 for f in forward), forward
    calls = [stats["scorer/judge/calls/replica0"], stats["scorer/judge/calls/replica1"]]
    assert min(calls) >= 1 and sum(calls) >= 2, calls
