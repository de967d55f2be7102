"""Asynchronous GRPO on Monarch actors: vLLM generators, a scorer, a replay buffer, a TorchTitan trainer.

    RolloutsActor: prompts ──▶ GeneratorPool (vLLM engines) ──▶ ScorerSupervisor ──▶ [reference] ──▶ buffer
                                  ScorerActor [RewardModelActor] [judge] (restarted if one dies), [teacher]
                                  (reference, teacher: each under a FrozenModelSupervisor, restarted if it dies)
                                     ▲                                                                  │
                         update_weights(v) (in flight)                                batch_for_trainer (each trainer rank)
                                     │                                                                  ▼
                       /dev/shm weight store ◀──────────── publish v ─────────── TrainerActor mesh (FSDP2/TP)

Two kinds of loop run concurrently: the train loop in this process (forge_rl/run/loop.py), the rollout
loops in the RolloutsActor's (forge_rl/pipeline/rollouts.py), with the admission gate, the buffer and the
prompts:

  rollout loop (prompts_in_flight_per_generator per generator)   prompt -> group_size completions ->
      the scoring stage (forge_rl/actors/scoring_stage.py) -> buffer; paced by the admission gate
      (forge_rl/core/admission.py): its episodes must be trainable within buffer.max_policy_age versions,
      and fit in the buffer. With `environment.name` set, a prompt is group_size multi-turn episodes
      of that environment, each turn sampled on the generator while other episodes' environments
      step; the environment gives the reward, so the stage skips the scorer (forge_rl/envs/rollout.py,
      docs/environments.md)
  train loop (one)   batch from the buffer -> one optimizer step -> policy version v+1 in the weight
      store -> every generator swaps to it between two decode steps, without draining its requests

With buffer.max_policy_age=0 the same program is synchronous RL: generate, train, publish, repeat.
The lifecycle around the loops (run directory, checkpoints, `--resume`, Ctrl-C, a dead process) is
forge_rl/run/lifecycle.py.

Run it with `forge-rl grpo --config configs/grpo_tiny_cpu.yaml` (or `python -m apps.grpo.main ...`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys

from forge_rl.actors.generator_pool import GeneratorPool
from forge_rl.actors.rollouts import RolloutsActor
from forge_rl.actors.scoring_stage import ScoringStage
from forge_rl.actors.simulated_trainer import SimulatedTrainerActor
from forge_rl.actors.trainer import TrainerActor
from forge_rl.config import GRPOConfig
from forge_rl.observability.metrics import generator_time_summary, progress
from forge_rl.plumbing.gc_freeze import frozen_startup_objects
from forge_rl.plumbing.port_calls import PortCalled, PortCalls
from forge_rl.run import launch
from forge_rl.run.evaluation import Evaluation
from forge_rl.run.lifecycle import Lifecycle
from forge_rl.run.loop import Pipeline, RunActors
from forge_rl.store.actors import StoreIndexActor, spawn_store
from forge_rl.tasks.tokenizer import PromptTokenizer


async def run(config: GRPOConfig) -> dict:
    """Run the recipe (or continue it, with `config.resume`); returns the summary (also the last
    line of stdout from the CLI). However it ends, every process of the run is shut down first;
    a dead process raises ProcessDied, whose message says how to resume."""
    lifecycle = Lifecycle.open(config)
    # This process only orchestrates, and imports no torch for it (its ~3 s of CPU would delay
    # every spawn); the cores belong to the engines and the trainer. Should anything here have
    # imported torch (building a tiny model the cache lacked), it gets one thread.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    config = lifecycle.config  # a resume continues with the run directory's config
    async with lifecycle.owning_processes():
        actors = await spawn_actors(config, lifecycle)

        if config.generator.engine == "sim":
            progress("starting SIMULATED engines and trainer (no model runs: forge_rl/engines/simulated.py)")
        else:
            progress("starting vLLM engine(s) and trainer (engine start takes about 20 s on a CPU)")
        generator_starts = await start_engines_and_trainer(actors, lifecycle)

        every_step_calls = PortCalls()
        pipeline = Pipeline(
            config,
            RunActors(
                # The calls made every step (and a slow step's `batch_taken`) are answered on one port
                # (forge_rl/plumbing/port_calls.py).
                rollouts=PortCalled(actors.rollouts, every_step_calls, only=("batch_taken", "step_done")),
                trainer=PortCalled(actors.trainer, every_step_calls, only=("train_next_step",)),
                policy_trainers={
                    name: PortCalled(policy.trainer, every_step_calls, only=("train_next_step",))
                    for name, policy in actors.policies.items()
                },
                after_publish=actors.scoring.after_publish,
                generators=actors.generators,
                checkpointed=actors.scoring.checkpointed,
                evaluation=None
                if not config.eval.enabled
                else Evaluation(
                    config,
                    actors.eval_generators or actors.generators,
                    actors.store_index,
                    lifecycle.run_path,
                    lifecycle.model_dir,
                ),
            ),
        )
        await lifecycle.resume(pipeline)
        with frozen_startup_objects():  # no full GC scans this process's startup objects mid-run
            history, accounting = await lifecycle.run_loops(pipeline)
        recoveries = await actors.generators.recovery_events.call_one()
        scorer_recoveries = await actors.scoring.recovery_events()
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
        **({"eval": pipeline.evaluated, "evaluations": pipeline.evaluations} if config.eval.enabled else {}),
    )


@dataclasses.dataclass
class Actors:
    generators: GeneratorPool
    """Owns the generator meshes and replaces a generator that dies (forge_rl/actors/generator_pool.py)."""
    scoring: ScoringStage
    """Scorer, reference model and teacher, each restarted if it dies (forge_rl/actors/scoring_stage.py)."""
    rollouts: RolloutsActor
    """The rollout loops, the admission gate, the replay buffer and the prompts (forge_rl/pipeline/rollouts.py)."""
    trainer: TrainerActor
    store_index: StoreIndexActor
    eval_generators: GeneratorPool | None
    """The evaluation's own generators (eval.sets set, eval.placement own), which load only the
    version under evaluation."""
    policies: dict[str, PolicyActors] = dataclasses.field(default_factory=dict)
    """Each of config.policies' own trainer, generators and weight store, by name."""


@dataclasses.dataclass
class PolicyActors:
    """One of config.policies (forge_rl/core/policies.py): its trainer ranks, which train its part of
    each batch and publish its versions to its own weight store, and the generators serving them."""

    trainer: TrainerActor
    generators: GeneratorPool
    store_index: StoreIndexActor


async def spawn_policies(
    config: GRPOConfig, lifecycle: Lifecycle, hosts: launch.Hosts, pad_id: int
) -> dict[str, PolicyActors]:
    """Each of config.policies' roles: a services process (its store's index and volume, its
    generator pool) and its trainer ranks, on this machine, from the run's starting model."""
    model_dir = str(lifecycle.model_dir)
    spawned = {}
    for policy in config.policies:
        services = hosts.spawn_procs(f"services-{policy.name}", 1, config.launch.placement.services_host)
        root = lifecycle.policy_stores[policy.name].root
        store_index, _ = await spawn_store(services, root, extra_files_dir=model_dir)
        generators = services.spawn(
            "generators",
            GeneratorPool,
            config.generator,
            model_dir,
            config.max_model_len,
            policy.num_generators,
            store_index,
            hosts.policy_generator_placements(policy.num_generators),
            config.generate_timeout_s,
            config.update_timeout_s,
            adapters=config.adapter_serving(model_dir),
            store_root=str(root),
        )
        trainer_procs = await hosts.spawn_ranks("trainer", config.trainer.num_procs, name=f"trainer-{policy.name}")
        trainer = trainer_procs.spawn(
            "trainer",
            TrainerActor,
            config.policy_trainer_config(policy),
            model_dir,
            store_index,
            str(root),
            pad_id,
            config.publish,
            config.launch.placement.trainer_cpus,
            policy.name,
        )
        spawned[policy.name] = PolicyActors(trainer, generators, store_index)
    return spawned


async def spawn_actors(config: GRPOConfig, lifecycle: Lifecycle) -> Actors:
    """Services (the scoring stage's supervisors, the weight store's index and volume, and the
    generator pool, which spawns one process per generator itself), the rollouts' process and the
    trainer ranks, on the hosts `config.launch` places them (forge_rl/run/launch.py; this machine by
    default)."""
    model_dir, store_root = str(lifecycle.model_dir), str(lifecycle.store.root)
    pad_id = PromptTokenizer(model_dir).pad_id
    hosts = await launch.start_hosts(config, model_dir)
    lifecycle.stop_at_exit(hosts)
    services = hosts.spawn_services()
    trainer_procs = await hosts.spawn_ranks("trainer", config.trainer.num_procs)
    store_index, _ = await spawn_store(
        services, lifecycle.store.root, extra_files_dir=model_dir, volume_procs=hosts.store_volume_procs(services)
    )
    generators = services.spawn(
        "generators",
        GeneratorPool,
        config.generator,
        model_dir,
        config.max_model_len,
        config.num_generators,
        store_index,
        hosts.generator_placements(),
        config.generate_timeout_s,
        config.update_timeout_s,
        adapters=config.adapter_serving(model_dir),
        store_root=store_root,
    )
    scoring = ScoringStage.spawn(
        config, services, hosts, model_dir, pad_id, store_index, store_root, lifecycle.run_path
    )
    eval_generators = None
    if config.eval.enabled and config.eval.placement == "own":
        eval_generators = services.spawn(
            "eval_generators",
            GeneratorPool,
            Evaluation.generator_config(config),
            model_dir,
            config.max_model_len,
            config.eval.num_generators,
            store_index,
            hosts.eval_generator_placements(config.eval.num_generators),
            config.generate_timeout_s,
            config.update_timeout_s,
            adapters=config.adapter_serving(model_dir),
            store_root=store_root,
        )
    policies = await spawn_policies(config, lifecycle, hosts, pad_id)
    actors = Actors(
        generators=generators,
        scoring=scoring,
        # Its after_publish runs here, in the controller; a closure does not cross processes.
        rollouts=hosts.spawn_rollouts().spawn(
            "rollouts",
            RolloutsActor,
            config,
            model_dir,
            generators,
            dataclasses.replace(scoring, after_publish=None),
            {name: policy.generators for name, policy in policies.items()},
        ),
        trainer=trainer_procs.spawn(
            "trainer",
            SimulatedTrainerActor if config.trainer.engine == "sim" else TrainerActor,
            config.trainer,
            model_dir,
            store_index,
            store_root,
            pad_id,
            config.publish,
            config.launch.placement.trainer_cpus,
        ),
        store_index=store_index,
        eval_generators=eval_generators,
        policies=policies,
    )
    # Their shutdown stops the processes they own (engines, reward workers, frozen-model ranks).
    lifecycle.stop_engines_first(
        actors.generators,
        *actors.scoring.owners,
        *filter(None, [eval_generators]),
        *(p.generators for p in policies.values()),
    )
    return actors


async def start_engines_and_trainer(actors: Actors, lifecycle: Lifecycle) -> list[dict]:
    """Start every engine, trainer rank and scoring model at once; record their pids in the run
    directory's processes.json (crash tests and users look there). Returns each generator's start
    figures."""
    eval_start = actors.eval_generators.start.call_one() if actors.eval_generators is not None else asyncio.sleep(0)
    policies = list(actors.policies.values())
    generator_starts, trainer_starts, scoring_processes, _, *policy_starts = await asyncio.gather(
        actors.generators.start.call_one(),
        actors.trainer.setup.call(),
        actors.scoring.start(),
        eval_start,
        *(policy.generators.start.call_one() for policy in policies),
        *(policy.trainer.setup.call() for policy in policies),
    )
    policy_trainer_starts = policy_starts[len(policies) :]
    processes = {
        "controller": os.getpid(),
        "generators": await actors.generators.processes.call_one(),
        **({"eval_generators": await actors.eval_generators.processes.call_one()} if actors.eval_generators else {}),
        **{
            f"generators-{name}": await policy.generators.processes.call_one()
            for name, policy in actors.policies.items()
        },
        **{
            f"trainer-{name}": [start["pid"] for start in starts.values()]
            for name, starts in zip(actors.policies, policy_trainer_starts)
        },
        "trainer": [start["pid"] for start in trainer_starts.values()],
        "rollouts": await actors.rollouts.process_id.call_one(),
        **scoring_processes,
    }
    (lifecycle.run_path / "processes.json").write_text(json.dumps(processes))
    return generator_starts


if __name__ == "__main__":
    from forge_rl.cli import main as cli_main

    cli_main(["grpo", *sys.argv[1:]])
