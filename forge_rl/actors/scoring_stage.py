"""A GRPO run's stage from generated to buffered, and the actors it owns.

    generated episodes ─▶ scorer (reward functions, reward model, judge, teacher: ScorerSupervisor)
                      ─▶ (dynamic_sampling) drop groups without signal
                      ─▶ (trainer.loss.kl_beta > 0) the reference model's logprobs ─▶ buffer

An environment's episodes carry the environment's reward: they skip the scorer, unless a teacher
runs, which the scorer adds to the environment's rewards (`calls_scorer`). Each model runs
under a supervisor that restarts it if one of its processes dies and answers the call in flight
again (`forge_rl.scoring.restarts`); one that keeps dying stops the run with its cause
(ScorerFailed). The loops take `score`, `stats` and `after_publish` from here
(`forge_rl.run.loop.RunActors`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_rl.actors.frozen_model_supervisor import FrozenModelSupervisor
from forge_rl.actors.restarting_owner import RestartingOwner
from forge_rl.actors.scorer_supervisor import ScorerSupervisor
from forge_rl.core.advantages import DynamicSampling
from forge_rl.errors import ScorerFailed, raised_by_actor
from forge_rl.observability.timeline import Timeline
from forge_rl.plumbing.port_calls import PortCalls
from forge_rl.scoring.teacher import TEACHER_EMA_FILE, PinnedTeacherRefresh, pinned_teacher_refresh
from forge_rl.training.reference import attach_reference_logprobs
from forge_rl.types import Episode

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig
    from forge_rl.run.launch import Hosts


@dataclasses.dataclass
class ScoringStage:
    scorer: ScorerSupervisor
    """Owns the scorer's processes (and the reward model's and judge's)."""
    reference: FrozenModelSupervisor | None
    """The frozen reference model's owner; only when trainer.loss.kl_beta > 0."""
    teacher: FrozenModelSupervisor | None
    """The distillation teacher's owner (the scorer calls it); only when scorer.teacher.path is
    set, or scorer.teacher.pin is not fixed (self-distillation)."""
    calls_scorer: bool
    """Whether episodes go through the scorer (`calls_scorer`)."""
    dynamic_sampling: DynamicSampling | None
    """Drops groups without signal, and stops a run that finds none (`DynamicSampling`); only with
    dynamic_sampling."""
    after_publish: Callable[[int, int, dict, Timeline], Awaitable[dict]] | None = None
    """A self-distillation teacher's refresh after each published version (`forge_rl.scoring.teacher`)."""
    calls: PortCalls = dataclasses.field(default_factory=PortCalls)
    """The per-prompt calls, `score` and the reference's `token_logprobs` (`forge_rl.plumbing.port_calls`):
    their supervisors live as long as the run."""

    @classmethod
    def spawn(
        cls,
        config: GRPOConfig,
        services,
        hosts: Hosts,
        model_dir: str,
        pad_id: int,
        store_index,
        store_root: str,
        run_path: Path,
    ) -> ScoringStage:
        """The supervisors, beside the services (`services`: their process mesh); each spawns
        its model's processes on the hosts `config.launch` gives it, and respawns them. An ema
        teacher keeps its average in `run_path` (scorer.teacher.keep_ema_average)."""
        teacher = None
        if config.uses_teacher:
            teacher_config = config.scorer.teacher
            store: tuple[Any, str | None]  # (the store's index, its root): a pinned teacher's only
            if teacher_config.path is not None:
                teacher_model, store = str(teacher_config.path), (None, None)
            else:  # self-distillation: the initial policy, refreshed from the weight store (`forge_rl.scoring.teacher`)
                teacher_model, store = model_dir, (store_index, store_root)
            keeps_average = teacher_config.pin == "ema" and teacher_config.keep_ema_average
            teacher = services.spawn(
                "teacher",
                FrozenModelSupervisor,
                "teacher",
                teacher_config,
                teacher_model,
                pad_id,
                *store,
                *hosts.owned_ranks(teacher_config.num_procs),
                str(run_path / TEACHER_EMA_FILE) if keeps_average else None,
            )
        # None: the episodes carry their environment's rewards, which take the reward function's place.
        reward = None if config.environment.name is not None else config.task.reward_weights
        scorer = services.spawn(
            "scorer",
            ScorerSupervisor,
            config.scorer,
            reward,
            config.generator.max_new_tokens,
            teacher,
            hosts.owned_host(config.launch.placement.scorer_host_index),
        )
        reference = None
        if config.uses_reference_model:
            reference = services.spawn(
                "reference",
                FrozenModelSupervisor,
                "reference",
                config.reference,
                model_dir,
                pad_id,
                None,
                None,
                *hosts.owned_ranks(config.reference.num_procs),
            )
        pinned = teacher is not None and config.scorer.teacher.pin != "fixed"
        return cls(
            scorer=scorer,
            reference=reference,
            teacher=teacher,
            calls_scorer=calls_scorer(config),
            dynamic_sampling=DynamicSampling(
                config.dynamic_sampling_max_filtered_steps,
                config.prompts_per_step,
                config.trainer.loss.normalize_advantage_std,
                config.trainer.loss.step_discount,
                config.trainer.loss.local_advantage_weight,
            )
            if config.dynamic_sampling
            else None,
            after_publish=pinned_teacher_refresh(teacher, config.scorer.teacher) if pinned else None,
        )

    @property
    def checkpointed(self) -> dict[str, Any]:
        """What a checkpoint holds of the stage (`RunActors.checkpointed`): a self-distillation
        teacher's schedule and weights."""
        return {"teacher": self.after_publish} if isinstance(self.after_publish, PinnedTeacherRefresh) else {}

    @property
    def owners_by_role(self) -> dict[str, RestartingOwner]:
        """The supervisors there are, by role (scorer, reference, teacher)."""
        roles = {"scorer": self.scorer, "reference": self.reference, "teacher": self.teacher}
        return {role: owner for role, owner in roles.items() if owner is not None}

    @property
    def owners(self) -> list[RestartingOwner]:
        """The supervisors; their shutdown stops the processes they own."""
        return list(self.owners_by_role.values())

    async def start(self) -> dict[str, list[int]]:
        """Start every model's processes at once; returns their OS pids by role (scorer,
        reference, teacher), as each supervisor's start reports them."""
        owners = self.owners_by_role
        starts = await asyncio.gather(*(owner.start.call_one() for owner in owners.values()))
        return {role: start["pids"] for role, start in zip(owners, starts)}

    async def score(self, episodes: list[Episode], timeline: Timeline) -> list[Episode]:
        """The episodes to buffer, scored; those left out are counted as filtered by the loop."""
        if self.calls_scorer:
            with timeline.busy("scorer"):
                episodes = await _unless_failed(self.calls.call(self.scorer, "score", episodes))
        if self.dynamic_sampling is not None:
            episodes = self.dynamic_sampling.filter(episodes)
        if self.reference is not None and episodes:
            with timeline.busy("reference"):
                logprobs = await _unless_failed(self.calls.call(self.reference, "token_logprobs", episodes))
            episodes = attach_reference_logprobs(episodes, logprobs)
        return episodes

    async def stats(self) -> dict:
        """The stage's counters, read once per step: the scorer's, and the restarts of the
        reference model and the teacher (`reference/restarts`, `teacher/restarts`)."""
        parts = await asyncio.gather(*(self.calls.call(owner, "stats") for owner in self.owners))
        return {key: value for part in parts for key, value in part.items()}

    async def recovery_events(self) -> list[dict]:
        """Every restart of the stage's models so far."""
        events = await asyncio.gather(*(owner.recovery_events.call_one() for owner in self.owners))
        return [event for owner_events in events for event in owner_events]


def calls_scorer(config: GRPOConfig) -> bool:
    """Whether a run's episodes go through the scorer: a task's always (the scorer gives their
    reward); an environment's, which carry the environment's rewards, only when a teacher adds its
    per-token rewards to them or scorer.reward_fn_weight weights them (a reward model or judge with
    an environment is refused by the config)."""
    return config.environment.name is None or config.uses_teacher or config.scorer.reward_fn_weight != 1.0


async def _unless_failed(call: Awaitable):
    """The call's answer; a model that kept dying (ScorerFailed) stops the run with its cause, not
    with Monarch's wrapper around it."""
    try:
        return await call
    except Exception as e:
        if isinstance(raised_by_actor(e), ScorerFailed):
            raise raised_by_actor(e) from None
        raise
