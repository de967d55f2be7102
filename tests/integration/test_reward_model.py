"""The reward model on its own proc mesh: concurrent requests are scored in shared batches with the
model's own values, and a model that returns NaN marks its completions ERRORED, counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from monarch.actor import this_host

from forge_rl.actors.reward_model import RewardModelActor
from forge_rl.actors.scorer import ScorerActor
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.scoring.reward_model import RewardModelConfig, RewardModelTraining, SequenceClassifier, train_reward_model
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.types import Completion, CompletionStatus, Episode

pytestmark = pytest.mark.integration


def untrained_reward_model(path: Path, nan_head: bool = False) -> Path:
    """A tiny classifier as `forge-rl train-reward-model` writes it, without the training; with
    `nan_head`, its score head is NaN, so every score is."""
    train_reward_model(RewardModelTraining(out=path, steps=0))
    if nan_head:
        from safetensors.torch import load_file, save_file

        weights = load_file(path / "model.safetensors")
        weights["score.weight"].fill_(float("nan"))
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def episode(episode_id: int, *texts: str) -> Episode:
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=text) for text in texts]
    return Episode(episode_id, "M37=", "7", [1, 2], completions)


def test_the_reward_model_actor_batches_requests_and_a_nan_model_errors_its_completions(tmp_path):
    good = untrained_reward_model(tmp_path / "good")
    nan = untrained_reward_model(tmp_path / "nan", nan_head=True)
    texts = [["M37=7", "M37=3"], ["M90=9"], ["M11=1K", "M45=", "M00=0"]]

    async def main():
        meshes = [spawn_procs(this_host(), name) for name in ("rm", "rm_nan", "scorer")]
        try:
            model = meshes[0].spawn("rm", RewardModelActor, RewardModelConfig(path=good, max_wait_ms=50))
            nan_model = meshes[1].spawn("rm", RewardModelActor, RewardModelConfig(path=nan))
            await asyncio.gather(model.setup.call_one(), nan_model.setup.call_one())
            scores = await asyncio.gather(*(model.score.call_one(batch) for batch in texts))
            model_stats = await model.stats.call_one()
            config = ScorerConfig(reward_model=RewardModelConfig(path=nan))
            scorer = meshes[2].spawn("scorer", ScorerActor, config, "leading_number", 0, nan_model)
            scored = await scorer.score.call_one([episode(0, "7", "3")])
            return scores, model_stats, scored, await scorer.stats.call_one()
        finally:
            for mesh in meshes:
                await mesh.stop()

    scores, model_stats, (scored,), stats = asyncio.run(main())
    direct = SequenceClassifier(good).forward([t for batch in texts for t in batch])
    assert [s for batch in scores for s in batch] == pytest.approx(direct, abs=1e-5)
    assert model_stats["texts"] == 6 and model_stats["batches"] < 3  # three callers, fewer forwards
    assert all(c.status == CompletionStatus.ERRORED for c in scored.completions)
    assert scored.completions[0].error.startswith("reward_model: non-finite reward (nan")
    assert stats["scorer/errored"] == 2 and stats["scorer/reward_model/errored"] == 2
    assert stats["scorer/reward_fn/errored"] == 0


def test_replicas_of_the_reward_model_share_a_scorers_calls(tmp_path):
    """scorer.reward_model.replicas 2: one process per replica; two groups scored at once go one to
    each (the least busy), with the model's own values."""
    good = untrained_reward_model(tmp_path / "good")
    config = ScorerConfig(reward_model=RewardModelConfig(path=good, replicas=2))

    async def main():
        meshes = [spawn_procs(this_host(), name, procs) for name, procs in (("rm", 2), ("scorer", 1))]
        try:
            model = meshes[0].spawn("rm", RewardModelActor, config.reward_model)
            setups = await model.setup.call()
            scorer = meshes[1].spawn("scorer", ScorerActor, config, "leading_number", 0, model)
            scored = await scorer.score.call_one([episode(0, "7", "3"), episode(1, "9")])
            stats = await model.stats.call()
            return [setups.get(i) for i in range(2)], scored, [stats.get(i) for i in range(2)]
        finally:
            for mesh in meshes:
                await mesh.stop()

    setups, scored, stats = asyncio.run(main())
    assert setups[0]["pid"] != setups[1]["pid"]
    assert sorted(s["texts"] for s in stats) == [1, 2]  # each replica served one group
    direct = SequenceClassifier(good).forward(["M37=7", "M37=3", "M37=9"])  # prompt + completion
    scores = [c.reward_components["reward_model"] for e in scored for c in e.completions]
    assert scores == pytest.approx(direct, abs=1e-5)


def test_a_killed_reward_model_is_restarted_with_its_scorer_until_max_restarts_then_the_run_stops(tmp_path):
    """The scorer's supervisor (forge_rl/actors/scorer_supervisor.py) owns the reward model's process
    too: SIGKILL it, and the next scoring call is served by a fresh scorer and reward model, with the
    same episodes scored; a death past scorer.max_restarts raises ScorerFailed naming the flag."""
    import os
    import signal

    from forge_rl.actors.scorer_supervisor import ScorerSupervisor
    from forge_rl.errors import ScorerFailed, raised_by_actor

    config = ScorerConfig(reward_model=RewardModelConfig(path=untrained_reward_model(tmp_path / "rm")), max_restarts=1)

    async def kill_reward_model(supervisor) -> int:
        scorer_pid, *others = await supervisor.processes.call_one()
        (reward_model_pid,) = others  # the scorer's process first, then the reward model's
        os.kill(reward_model_pid, signal.SIGKILL)
        return reward_model_pid

    async def main():
        procs = spawn_procs(this_host(), "supervisor")
        supervisor = procs.spawn("supervisor", ScorerSupervisor, config, "leading_number", 0)
        try:
            await supervisor.start.call_one()
            (before,) = await supervisor.score.call_one([episode(0, "7", "3")])
            killed = await kill_reward_model(supervisor)
            (after,) = await supervisor.score.call_one([episode(1, "7", "3")])  # waits for the restart
            restarts = await supervisor.wait_until_serving.call_one()
            pids_after = await supervisor.processes.call_one()
            await kill_reward_model(supervisor)
            with pytest.raises(Exception) as failed:
                await supervisor.score.call_one([episode(2, "7", "3")])
            return (
                before,
                after,
                restarts,
                killed,
                pids_after,
                await supervisor.recovery_events.call_one(),
                failed.value,
            )
        finally:
            await supervisor.shutdown.call_one()
            await procs.stop()

    before, after, restarts, killed, pids_after, events, failure = asyncio.run(main())
    assert [c.status for c in after.completions] == [CompletionStatus.OK] * 2
    assert [c.reward for c in after.completions] == pytest.approx([c.reward for c in before.completions])
    assert restarts == 1 and killed not in pids_after
    assert len(events) == 2  # the restart, then the death that exhausted scorer.max_restarts
    assert isinstance(raised_by_actor(failure), ScorerFailed), failure
    assert "scorer.max_restarts" in str(raised_by_actor(failure))
