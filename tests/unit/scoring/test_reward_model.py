"""The reward model's core: requests batched across concurrent callers, NaN scores ERRORED and
counted, a tiny model trained from scratch reads prompt + completion."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from forge_rl.errors import ConfigError
from forge_rl.scoring.reward_model import RewardBatcher, RewardModelConfig, synthetic_reward_examples
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import RewardModelScorer, ScorerConfig, build_scorer
from forge_rl.types import Completion, CompletionStatus, Episode
from tests.support.helpers import wait_until_async


def group(prompt: str, *texts: str) -> Episode:
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=t) for t in texts]
    return Episode(0, prompt, "7", [1, 2], completions)


def test_concurrent_requests_share_forward_passes_up_to_the_batch_size():
    forwards: list[list[str]] = []

    def forward(texts):
        forwards.append(texts)
        return [float(len(t)) for t in texts]

    async def main():
        batcher = RewardBatcher(forward, max_batch_size=4, max_wait_s=0.01)
        return await asyncio.gather(*(batcher.score(["a" * i, "b"]) for i in range(1, 4)))

    results = asyncio.run(main())
    assert results == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
    assert [len(batch) for batch in forwards] == [4, 2]  # 6 texts from 3 callers, in 2 forwards


def test_a_forward_that_raises_fails_its_callers_and_the_batcher_serves_the_next():
    calls = iter([RuntimeError("CUDA error"), None])

    def forward(texts):
        error = next(calls)
        if error:
            raise error
        return [1.0] * len(texts)

    async def main():
        batcher = RewardBatcher(forward, max_batch_size=8, max_wait_s=0.0)
        with pytest.raises(RuntimeError, match="CUDA error"):
            await batcher.score(["x"])
        return await batcher.score(["y"])

    assert asyncio.run(main()) == [1.0]


def test_the_reward_model_reads_prompt_plus_completion_and_a_nan_score_errors_that_completion():
    seen = []

    async def client(texts):
        seen.extend(texts)
        return [math.nan if t.endswith("?") else 0.25 for t in texts]

    stage = ScoreWriter(RewardModelScorer(client))
    (episode,) = asyncio.run(stage.score([group("M37=", "7", "?")]))
    assert seen == ["M37=7", "M37=?"]
    assert episode.completions[0].reward == 0.25
    assert episode.completions[1].status == CompletionStatus.ERRORED
    assert "non-finite" in episode.completions[1].error
    assert stage.stats()["scorer/errored"] == 1


def test_with_a_reward_model_the_reward_is_the_weighted_sum_and_the_verifier_is_still_logged(tmp_path):
    async def client(texts):
        return [0.5] * len(texts)

    (tmp_path / "config.json").write_text("{}")  # the config checks for a model directory; the client fakes the model
    config = ScorerConfig(reward_fn_weight=0.0, reward_model=RewardModelConfig(path=tmp_path, weight=2.0))
    scorer = build_scorer(config, "leading_number", client)
    stage = ScoreWriter(scorer)
    try:
        (episode,) = asyncio.run(stage.score([group("M37=", "7", "3")]))
    finally:
        stage.close()
    assert episode.rewards == [1.0, 1.0]
    assert [c.reward_components for c in episode.completions] == [
        {"reward_fn": 1.0, "reward_model": 0.5},
        {"reward_fn": 0.0, "reward_model": 0.5},
    ]


def test_reward_model_config_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--scorer.reward-model.path"):
        RewardModelConfig(path=tmp_path)
    with pytest.raises(ValueError, match="--scorer.reward-model.max-batch-size"):
        RewardModelConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="nothing would train"):
        ScorerConfig(reward_fn_weight=0.0)


def test_synthetic_examples_are_labelled_by_the_tasks_verifier_about_forty_percent_correct():
    examples = synthetic_reward_examples("max_of_two", seed=0, count=2000)
    assert all(text.startswith("M") and text.index("=") == 3 for text, _ in examples)
    assert 0.35 < sum(label for _, label in examples) / len(examples) < 0.5


class FakeReplicaMesh:
    """Stands in for an actor mesh of replicas: `slice(procs=i).score.call_one(...)` answers once
    the test releases that replica's call, so calls stay in flight as long as the test wants."""

    def __init__(self, num_replicas: int):
        self.calls: list[tuple[int, asyncio.Future]] = []
        self.num_replicas = num_replicas

    def slice(self, procs: int):
        mesh = self

        class Endpoint:
            async def call_one(self, texts):
                answer = asyncio.get_running_loop().create_future()
                mesh.calls.append((procs, answer))
                return await answer

        return type("Replica", (), {"score": Endpoint()})()


async def reached(mesh: FakeReplicaMesh, num_calls: int) -> None:
    """Until `num_calls` calls have reached their replicas (each then awaits its answer)."""
    await wait_until_async(lambda: len(mesh.calls) >= num_calls, f"{num_calls} calls at their replicas")


def test_each_call_goes_to_the_least_busy_replica():
    from forge_rl.actors.reward_model import LeastBusyReplica

    async def main():
        mesh = FakeReplicaMesh(3)
        client = LeastBusyReplica(mesh, 3, "score")
        first = [asyncio.ensure_future(client(["t"])) for _ in range(4)]
        await reached(mesh, 4)
        picked = [replica for replica, _ in mesh.calls]
        mesh.calls[1][1].set_result([1.0])  # replica 1 answers: now the least busy
        await first[1]
        fifth = asyncio.ensure_future(client(["t"]))
        await reached(mesh, 5)
        for _, answer in mesh.calls:
            if not answer.done():
                answer.set_result([0.0])
        await asyncio.gather(*first, fifth)
        return picked, mesh.calls[-1][0], client.stats("scorer/reward_model")

    picked, fifth_replica, stats = asyncio.run(main())
    assert picked == [0, 1, 2, 0]  # the fewest in flight, the lowest index among equals
    assert fifth_replica == 1
    assert stats == {
        "scorer/reward_model/calls/replica0": 2.0,
        "scorer/reward_model/calls/replica1": 2.0,
        "scorer/reward_model/calls/replica2": 1.0,
    }


def test_the_machine_check_counts_the_reward_models_threads(tmp_path, monkeypatch):
    """Its replicas are compute threads like the generators': too many on this machine's cores is
    a ConfigError naming the setting, before any process starts."""
    from forge_rl.config import GRPOConfig
    from forge_rl.run import preflight

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: {0, 1})
    scorer = ScorerConfig(reward_model=RewardModelConfig(path=tmp_path, replicas=3, num_threads=2))
    config = GRPOConfig(scorer=scorer)
    assert sum(preflight.compute_threads(config).values()) == 1 + 1 + 6
    preflight._check_cpu_threads(config)  # 8 threads on 2 cores: at the limit
    crowded = dataclasses.replace(
        config, scorer=ScorerConfig(reward_model=RewardModelConfig(path=tmp_path, replicas=4))
    )
    assert sum(preflight.compute_threads(crowded).values()) == 6
    too_many = dataclasses.replace(
        config, scorer=ScorerConfig(reward_model=RewardModelConfig(path=tmp_path, replicas=4, num_threads=2))
    )
    with pytest.raises(
        ConfigError,
        match=r"scorer.reward_model.replicas \(4\) x scorer.reward_model.num_threads \(2\) = 10 compute threads on 2",
    ):
        preflight._check_cpu_threads(too_many)
