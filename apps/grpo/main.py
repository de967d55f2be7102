"""Asynchronous GRPO on Monarch actors: vLLM generators, a scorer, a replay buffer, a TorchTitan trainer.

    DatasetActor ──prompts──▶ GeneratorPool (vLLM engines) ──▶ ScorerSupervisor ──▶ [reference] ──▶ ReplayBufferActor
                                  ScorerActor [RewardModelActor] [judge] (restarted if one dies), [teacher]
                                  (reference, teacher: each under a FrozenModelSupervisor, restarted if it dies)
                                     ▲                                                                  │
                         update_weights(v) (in flight)                                             sample(batch)
                                     │                                                                  ▼
                       /dev/shm weight store ◀──────────── publish v ─────────── TrainerActor mesh (FSDP2/TP)

Two kinds of loop run concurrently in this process (forge_rl/loop.py owns them):

  rollout loop (prompts_in_flight_per_generator per generator)   prompt -> group_size completions ->
      `score` below -> buffer; paced by the admission gate (forge_rl/admission.py): its episodes must
      be trainable within buffer.max_policy_age versions, and fit in the buffer. With
      `environment.name` set, a prompt is group_size multi-turn episodes of that environment, each
      turn sampled on the generator while other episodes' environments step; the environment gives
      the reward, so `score` skips the scorer (forge_rl/envs/rollout.py, docs/environments.md)
  train loop (one)   batch from the buffer -> one optimizer step -> policy version v+1 in the weight
      store -> every generator swaps to it between two decode steps, without draining its requests

With buffer.max_policy_age=0 the same program is synchronous RL: generate, train, publish, repeat.
The lifecycle around the loops (run directory, checkpoints, `--resume`, Ctrl-C, a dead process) is
forge_rl/lifecycle.py.

Run it with `forge-rl grpo --config configs/grpo_tiny_cpu.yaml` (or `python -m apps.grpo.main ...`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import torch

from forge_rl import launch
from forge_rl.actors.buffer import ReplayBufferActor
from forge_rl.actors.dataset import DatasetActor
from forge_rl.actors.generator_pool import GeneratorPool
from forge_rl.actors.frozen_model_supervisor import FrozenModelSupervisor
from forge_rl.actors.scorer_supervisor import ScorerSupervisor
from forge_rl.actors.simulated_trainer import SimulatedTrainerActor
from forge_rl.actors.trainer import TrainerActor
from forge_rl.advantages import filter_zero_advantage_groups
from forge_rl.config import GRPOConfig
from forge_rl.errors import ScorerFailed, raised_by_actor
from forge_rl.envs.renderers import make_renderer
from forge_rl.lifecycle import Lifecycle
from forge_rl.loop import Pipeline, RunActors
from forge_rl.metrics import generator_time_summary, progress
from forge_rl.reference import attach_reference_logprobs
from forge_rl.teacher import pinned_teacher_refresh
from forge_rl.store.actors import spawn_store
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.timeline import Timeline
from forge_rl.types import Episode


async def run(config: GRPOConfig) -> dict:
    """Run the recipe (or continue it, with `config.resume`); returns the summary (also the last
    line of stdout from the CLI). However it ends, every process of the run is shut down first;
    a dead process raises ProcessDied, whose message says how to resume."""
    torch.set_num_threads(1)  # this process only orchestrates; the cores belong to engines and trainer
    lifecycle = Lifecycle.open(config)
    config = lifecycle.config  # a resume continues with the run directory's config
    async with lifecycle.owning_processes():
        actors = await spawn_actors(config, lifecycle)

        progress("starting vLLM engine(s) and trainer (engine start takes about 20 s on a CPU)")
        generator_starts = await start_engines_and_trainer(actors, lifecycle)

        pipeline = Pipeline(config, RunActors(
            dataset=actors.dataset,
            generators=actors.generators,
            buffer=actors.buffer,
            trainer=actors.trainer,
            score=lambda episodes, timeline: score(episodes, actors, config, timeline),
            stats=lambda: stage_stats(actors),
            renderer=make_renderer(config.environment.renderer, lifecycle.model_dir),
            after_publish=pinned_teacher_refresh(actors.teacher, config.scorer.teacher)
            if config.scorer.teacher.pin != "fixed" else None,
        ))
        await lifecycle.resume(pipeline)
        history, accounting = await lifecycle.run_loops(pipeline)
        recoveries = await actors.generators.recovery_events.call_one()
        scorer_recoveries = await actors.scorer.recovery_events.call_one()
        for frozen_model in (actors.reference, actors.teacher):
            if frozen_model is not None:
                scorer_recoveries += await frozen_model.recovery_events.call_one()
        forward_times = await actors.generators.forward_times.call_one()
    return lifecycle.summary(
        history,
        accounting,
        **generator_time_summary(history, forward_times),
        engine_start_s=max(start["engine_start_s"] for start in generator_starts),
        generator_recoveries=recoveries,
        scorer_recoveries=scorer_recoveries,
        # A simulation (generator.engine sim) ran no model: its figures are the control plane's only.
        simulated=config.simulated,
    )


async def score(episodes: list[Episode], actors: Actors, config: GRPOConfig, timeline: Timeline) -> list[Episode]:
    """Generated to buffered: rewards (the environment's already, for its episodes), then (DAPO)
    drop groups without signal, then (KL penalty) the reference model's logprobs. Episodes left
    out are counted as filtered by the loop."""
    if config.environment.name is None:
        with timeline.busy("scorer"):
            try:  # a dead scorer is restarted and rescores (forge_rl/scorer_restarts.py): it takes longer
                episodes = await actors.scorer.score.call_one(episodes)
            except Exception as e:
                if isinstance(raised_by_actor(e), ScorerFailed):  # it kept dying: the run stops with the cause
                    raise raised_by_actor(e) from None
                raise
    if config.dynamic_sampling:
        episodes, _ = filter_zero_advantage_groups(episodes)
    if actors.reference is not None and episodes:
        with timeline.busy("reference"):
            try:  # a dead reference model is restarted and answers the same call (frozen_model_supervisor.py)
                logprobs = await actors.reference.token_logprobs.call_one(episodes)
            except Exception as e:
                if isinstance(raised_by_actor(e), ScorerFailed):  # it kept dying: the run stops with the cause
                    raise raised_by_actor(e) from None
                raise
        episodes = attach_reference_logprobs(episodes, logprobs)
    return episodes


async def stage_stats(actors: Actors) -> dict:
    """The scoring stage's counters, read once per step: the scorer's, and the restarts of the
    reference model and the teacher (`reference/restarts`, `teacher/restarts`)."""
    frozen_models = [model for model in (actors.reference, actors.teacher) if model is not None]
    stats = await asyncio.gather(actors.scorer.stats.call_one(), *(model.stats.call_one() for model in frozen_models))
    return {key: value for part in stats for key, value in part.items()}


@dataclasses.dataclass
class Actors:
    dataset: DatasetActor
    scorer: ScorerSupervisor
    """Owns the scorer's processes (and the reward model's and judge's) and restarts them if one dies
    (forge_rl/actors/scorer_supervisor.py)."""
    buffer: ReplayBufferActor
    generators: GeneratorPool
    """Owns the generator meshes and replaces a generator that dies (forge_rl/actors/generator_pool.py)."""
    trainer: TrainerActor
    reference: FrozenModelSupervisor | None = None
    """Owns the frozen reference model's processes and restarts them if one dies; only when
    trainer.loss.kl_beta > 0."""
    teacher: FrozenModelSupervisor | None = None
    """Owns the distillation teacher's processes (the scorer calls it) and restarts them if one
    dies; only when scorer.teacher.path is set, or scorer.teacher.pin is not fixed (self-distillation)."""


async def spawn_actors(config: GRPOConfig, lifecycle: Lifecycle) -> Actors:
    """Services (dataset, scorer, buffer, the weight store's index and volume, and the generator
    pool, which spawns one process per generator itself) and the trainer ranks, on the hosts
    `config.launch` places them (forge_rl/launch.py; this machine by default)."""
    model_dir, store_root = str(lifecycle.model_dir), lifecycle.store.root
    pad_id = PromptTokenizer(model_dir).pad_id
    hosts = await launch.start_hosts(config, model_dir)
    lifecycle.stop_at_exit(hosts)
    services = hosts.spawn_services()
    trainer_procs = await hosts.spawn_ranks("trainer", config.trainer.num_procs)
    store_index, _ = await spawn_store(
        services, store_root, extra_files_dir=model_dir, volume_procs=hosts.store_volume_procs(services)
    )
    max_new_tokens = config.generator.max_new_tokens
    teacher = None
    if config.uses_teacher:
        # Its supervisor, beside the services, spawns its ranks (and respawns them if one dies).
        teacher_config = config.scorer.teacher
        if teacher_config.path is not None:
            teacher_model, store = str(teacher_config.path), (None, None)
        else:  # self-distillation: the initial policy, refreshed from the weight store (forge_rl/teacher.py)
            teacher_model, store = model_dir, (store_index, str(store_root))
        teacher = services.spawn(
            "teacher", FrozenModelSupervisor, "teacher", teacher_config, teacher_model, pad_id, *store,
            *hosts.owned_ranks(teacher_config.num_procs),
        )
    actors = Actors(
        dataset=services.spawn("dataset", DatasetActor, config.task, model_dir, max_new_tokens),
        # The scorer, reward model and judge run on processes of their own that the supervisor
        # spawns beside the services, and respawns if one dies.
        scorer=services.spawn(
            "scorer", ScorerSupervisor, config.scorer, config.task.reward, max_new_tokens, teacher,
            hosts.owned_host(config.launch.placement.services_host),
        ),
        buffer=services.spawn("buffer", ReplayBufferActor, config.buffer),
        generators=services.spawn(
            "generators", GeneratorPool, config.generator, model_dir, config.max_model_len, config.num_generators,
            store_index, hosts.generator_placements(), config.generate_timeout_s, config.update_timeout_s,
            adapters=config.adapter_serving(model_dir),
        ),
        trainer=trainer_procs.spawn(
            "trainer", SimulatedTrainerActor if config.trainer.engine == "sim" else TrainerActor, config.trainer, model_dir,
            store_index, str(store_root), pad_id, config.publish, config.launch.placement.trainer_cpus,
        ),
    )
    actors.teacher = teacher
    if config.uses_reference_model:
        actors.reference = services.spawn(
            "reference", FrozenModelSupervisor, "reference", config.reference, model_dir, pad_id, None, None,
            *hosts.owned_ranks(config.reference.num_procs),
        )
    # Their shutdown stops the processes they own (engines, reward workers, frozen-model ranks).
    owners = (actors.generators, actors.scorer, actors.reference, actors.teacher)
    lifecycle.stop_engines_first(*(owner for owner in owners if owner is not None))
    return actors


async def start_engines_and_trainer(actors: Actors, lifecycle: Lifecycle) -> list[dict]:
    """Start every engine, trainer rank, scorer-side process, reference and teacher rank at once; record
    their pids (a crash test and `forge-rl` users look there). Returns each generator's start figures."""
    generator_starts, trainer_starts, scorer_start, *_ = await asyncio.gather(
        actors.generators.start.call_one(),
        actors.trainer.setup.call(),
        actors.scorer.start.call_one(),
        *(model.start.call_one() for model in (actors.reference, actors.teacher) if model is not None),
    )
    processes = {
        "generators": await actors.generators.processes.call_one(),
        "trainer": [start["pid"] for start in trainer_starts.values()],
        "scorer": scorer_start["pids"],
    }
    for role, model in (("reference", actors.reference), ("teacher", actors.teacher)):
        if model is not None:
            processes[role] = await model.processes.call_one()
    (lifecycle.run_path / "processes.json").write_text(json.dumps(processes))
    return generator_starts


if __name__ == "__main__":
    from forge_rl.cli import main as cli_main

    cli_main(["grpo", *sys.argv[1:]])
