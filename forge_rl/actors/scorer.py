"""Scores completions: the actor shell around `forge_rl.scoring.score_writer.ScoreWriter`.

The scorer is the task's reward function, run in sandboxed worker processes
(`RewardFunctionScorer`), weighted with a reward model's score when scorer.reward_model.path is set
(`RewardModelScorer`, calling the RewardModelActor on its own mesh) and with a distillation
teacher's per-token rewards when scorer.teacher is enabled (`TeacherScorer`, calling the
supervisor of the FrozenModelActor that serves the teacher, which restarts it if it dies) and an
LLM judge's verdicts when scorer.judge.path is set (`JudgeScorer`, calling the judge's own
GeneratorActor). A reward function that raises, returns a non-finite value, exceeds
`scorer.reward_timeout_s` or crashes its process marks that completion ERRORED (never trained,
counted in `stats`), logs the reason on stderr, and the run goes on. With `scorer.overlong_buffer`
set, DAPO's soft overlong penalty is added to each reward.

It runs on a process of its own, owned by the ScorerSupervisor (`forge_rl.actors.scorer_supervisor`),
which restarts it, with its reward model and judge, when one of their processes dies. A reward
model or judge call that fails because that model's process died raises ScorerLost out of `score`
(no completion is to blame), and the supervisor scores the episodes again on the replacement.
"""

from __future__ import annotations

import functools
import os
import socket

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.actors.generator_pool import is_engine_dead
from forge_rl.actors.reward_model import LeastBusyReplica
from forge_rl.errors import ScorerFailed, ScorerLost, raised_by_actor
from forge_rl.plumbing.port_calls import PortServed
from forge_rl.scoring.judge import judge_client
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import ScorerConfig, build_scorer
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode


class ScorerActor(PortServed, Actor):
    def __init__(
        self,
        config: ScorerConfig = ScorerConfig(),
        reward: str | dict[str, float] | None = "leading_number",
        max_new_tokens: int = 0,
        reward_model=None,
        teacher=None,
        judge=None,
    ):
        """`reward`: the task's reward function, or each of its functions with its weight
        (`TaskConfig.reward_weights`); None: the episodes are an environment's, rewarded by it
        (`build_scorer`). `reward_model`: the RewardModelActor mesh (`forge_rl.actors.reward_model`, one actor per
        replica) when scorer.reward_model.path is set; its replicas' `score` is the reward model
        scorer's client.
        `teacher`: the teacher's FrozenModelSupervisor (`forge_rl.actors.frozen_model_supervisor`)
        when scorer.teacher is enabled; its `token_logprobs` (rank 0's answer of a collective over
        the teacher's ranks, sent again if they die) is the teacher scorer's client. `judge`: the judge's GeneratorActor
        mesh (`forge_rl.actors.generator`,
        one actor per replica) when scorer.judge.path is set; its replicas' `generate` serves the
        judge scorer's verdicts."""
        client = None
        self._replica_stats = []
        """Each replicated model's `LeastBusyReplica.stats` (the load per replica), by its prefix."""
        if reward_model is not None:
            replicas = LeastBusyReplica(reward_model, config.reward_model.replicas, "score")
            self._replica_stats.append(functools.partial(replicas.stats, "scorer/reward_model"))
            client = _lost_if_dead(replicas, "reward model")

        async def teacher_logprobs(episodes: list[Episode]) -> list[list[list[float]]]:
            try:  # a dead teacher is restarted by its supervisor, which sends the call again
                return await teacher.token_logprobs.call_one(episodes)
            except Exception as e:  # it kept dying: the run stops with the cause (not an ERRORED group)
                if isinstance(raised_by_actor(e), ScorerFailed):
                    raise raised_by_actor(e) from None
                raise

        verdicts = None
        if judge is not None:
            assert config.judge.path is not None  # the supervisor spawns a judge only with scorer.judge.path set
            tokenizer = PromptTokenizer(config.judge.path)
            engines = LeastBusyReplica(judge, config.judge.replicas, "generate")
            self._replica_stats.append(functools.partial(engines.stats, "scorer/judge"))
            verdicts = judge_client(tokenizer, config.judge.prompt_format, _lost_if_dead(engines, "judge"))
        scorer = build_scorer(config, reward, client, None if teacher is None else teacher_logprobs, verdicts)
        token_baseline = config.teacher.baseline if teacher is not None else "none"
        self.stage = ScoreWriter(scorer, config.overlong_buffer, max_new_tokens, token_baseline)

    @concurrent_endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """Sets each completion's reward (and its components, step and token rewards), or its
        ERRORED status and error."""
        return await self.stage.score(episodes)

    @endpoint
    async def process(self) -> dict:
        """Where this scorer runs: its supervisor polls the pid."""
        return {"pid": os.getpid(), "hostname": socket.gethostname()}

    @concurrent_endpoint
    async def stats(self) -> dict:
        stats = self.stage.stats()
        for replica_stats in self._replica_stats:
            stats |= replica_stats()
        return stats

    @endpoint
    async def shutdown(self) -> None:
        """Stops the scorers' processes (reward workers also die with this process)."""
        self.stage.close()


def _lost_if_dead(call, model: str):
    """`call`, raising ScorerLost when the model's process died during it, or (the judge) only its
    vLLM engine did, which the judge's actor, alive, reports as vLLM's EngineDeadError, often
    before the supervisor's poll sees the engine's pids gone: the whole scoring call is lost and
    scored again after a restart, instead of its completions being ERRORED."""

    async def guarded(*args):
        try:
            return await call(*args)
        except SupervisionError as e:
            raise ScorerLost(f"the {model}'s process died: {e}") from None
        except Exception as e:
            if is_engine_dead(e):
                raise ScorerLost(f"the {model}'s vLLM engine died: {e}") from None
            raise

    return guarded
