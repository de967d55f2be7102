"""Asynchronous GRPO on Monarch actors: vLLM generators, a scorer, a replay buffer, a TorchTitan trainer.

    DatasetActor ──episodes──▶ GeneratorActor(s) ──▶ ScorerActor ──▶ ReplayBufferActor
                                     ▲                                      │
                         update_weights(v) (in flight)                 sample(batch)
                                     │                                      ▼
                       /dev/shm weight store ◀──── publish v ──── TrainerActor mesh (FSDP2/TP)

Two kinds of loop run concurrently in this process:

  rollout loop (prompts_in_flight_per_generator per generator, one prompt each at a time)
      consumes   a prompt from the dataset
      produces   scored episodes into the buffer
      waits for  the staleness gate (forge_rl/staleness.py): its next episodes must be trainable
                 within max_policy_age of the version it generates with; and for buffer room
      unblocked  when the trainer takes a batch or the generator loads newer weights
  train loop (one)
      consumes   one batch of train_batch_size completions from the buffer (all fresh enough)
      produces   policy version v+1 in the weight store, then tells every generator (not awaited)
      waits for  the buffer to hold a full batch
      unblocked  by rollouts

With buffer.max_policy_age=0 the same program is synchronous RL: generate, train, publish, repeat.
With buffer.admission=drop the staleness gate is off: generation only waits for buffer room, and the
buffer drops what grows too old.

With checkpoint.enabled, the train loop checkpoints between two steps every
checkpoint.every_n_steps (forge_rl/checkpoint.py), and `forge-rl grpo --resume RUN_DIR` continues
from the newest complete one: prompts that were in flight then are handed out again.

Run it with `forge-rl grpo --config configs/grpo_tiny_cpu.yaml` (or `python -m apps.grpo.main ...`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import sys
import time

import torch

from forge_rl import launch
from forge_rl.actors.buffer import ReplayBufferActor
from forge_rl.actors.dataset import DatasetActor
from forge_rl.actors.generator_pool import GeneratorPool
from forge_rl.actors.reference import ReferenceActor
from forge_rl.actors.scorer import ScorerActor
from forge_rl.actors.trainer import TrainerActor
from forge_rl.accounting import PromptAccounting
from forge_rl.advantages import filter_zero_advantage_groups
from forge_rl.checkpoint import (
    TRAINER_DIR,
    ControllerState,
    begin_checkpoint,
    capture_rng_state,
    commit_checkpoint,
    complete_checkpoints,
    prompts_to_reissue,
    prune_checkpoints,
    read_controller_state,
    restore_rng_state,
    resume_hint,
)
from forge_rl.config import GRPOConfig
from forge_rl.metrics import MetricsLogger, batch_metrics, open_sinks, progress
from forge_rl.run_dir import (
    config_to_dict,
    create_run_dir,
    open_run_dir_for_resume,
    prepare_model_dir,
    remove_unstarted_run_dir,
    truncate_metrics,
)
from forge_rl.staleness import batch_may_be_sampled, rollout_may_start
from forge_rl.store.actors import spawn_store
from forge_rl.store.shm import SharedMemorySnapshots, default_store_root
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.timeline import Timeline
from forge_rl.types import Episode

# Final mean reward = mean of the last steps' batch rewards (one step is noisy at small batches).
_FINAL_REWARD_WINDOW = 5
# Shutdown must finish within the 10 s a user (or a scheduler's SIGTERM grace period) waits.
_ENGINE_STOP_TIMEOUT_S = 4.0
_MESH_STOP_TIMEOUT_S = 4.0
# On Ctrl-C / SIGTERM with checkpoint.on_shutdown: how long the optimizer step in flight may take to
# finish, then how long the checkpoint may take (a tiny model's takes well under a second).
_STOP_STEP_TIMEOUT_S = 2.0
_STOP_CHECKPOINT_TIMEOUT_S = 3.0


class ProcessDied(RuntimeError):
    """A process of the run (a trainer rank, or the services) died; the message says how to resume."""


@dataclasses.dataclass
class PipelineState:
    """What the loops share. Only this process's event loop touches it, so it needs no locks."""

    config: GRPOConfig
    generator_versions: list[int]
    """Policy version each generator serves now."""
    next_train_version: int = 0
    """Version the next batch will be trained at = batches taken so far."""
    num_episodes_queued: int = 0
    """Handed to rollouts and not yet taken by the trainer or dropped as stale."""
    in_flight_versions: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Generator version at the start of each episode still being generated or scored."""
    requeued: collections.deque = dataclasses.field(default_factory=collections.deque)
    """Prompts (episode shells) whose generator died mid-request; handed out again first."""
    accounting: PromptAccounting = dataclasses.field(default_factory=PromptAccounting)
    num_generated_tokens: int = 0
    generated_tokens_at_last_step: int = 0
    last_step_end_s: float = 0.0
    timeline: Timeline = dataclasses.field(default_factory=Timeline)
    """Busy intervals of every component; its origin is when the loops started."""
    last_weight_update: dict = dataclasses.field(default_factory=dict)
    step: int = 0
    """Train-loop steps done, skipped non-finite steps included (restored by a resume)."""
    step_in_flight: bool = False
    """A batch left the buffer and its step is not yet accounted for: no checkpoint now."""
    process_failures: list[str] = dataclasses.field(default_factory=list)
    """Processes of the run that died (from Monarch's fault hook); the run stops at the first."""
    changed: asyncio.Condition = dataclasses.field(default_factory=asyncio.Condition)

    def may_start_rollout(self, generator_index: int) -> bool:
        if self.config.buffer.admission == "drop":
            return True  # only the buffer's capacity paces generation
        return rollout_may_start(
            generator_version=self.generator_versions[generator_index],
            next_train_version=self.next_train_version,
            num_episodes_queued=self.num_episodes_queued,
            num_new_episodes=1,
            episodes_per_step=self.config.prompts_per_step,
            max_policy_age=self.config.buffer.max_policy_age,
        )

    def may_sample_batch(self) -> bool:
        if self.config.buffer.admission == "drop":
            return True  # stragglers that miss their last step are dropped, not waited for
        return batch_may_be_sampled(
            self.in_flight_versions, self.next_train_version, self.config.buffer.max_policy_age
        )

    async def update(self, **changes) -> None:
        """Apply counter changes and wake the loops waiting on them."""
        async with self.changed:
            for name, delta in changes.items():
                setattr(self, name, getattr(self, name) + delta)
            self.changed.notify_all()


@dataclasses.dataclass
class Actors:
    dataset: DatasetActor
    scorer: ScorerActor
    buffer: ReplayBufferActor
    generators: GeneratorPool
    """Owns the generator meshes and replaces a generator that dies (forge_rl/actors/generator_pool.py)."""
    trainer: TrainerActor
    reference: ReferenceActor | None = None
    """The frozen reference model, on its own processes; only when trainer.loss.kl_beta > 0."""


async def rollout_loop(index: int, actors: Actors, state: PipelineState) -> None:
    """One prompt at a time on generator `index`; many of these run per generator."""
    config, timeline = state.config, state.timeline
    while True:
        async with state.changed:
            await state.changed.wait_for(lambda: state.may_start_rollout(index))
            state.num_episodes_queued += 1
            start_version = state.generator_versions[index]
            state.in_flight_versions[start_version] += 1
        prompts = [state.requeued.popleft()] if state.requeued else await next_prompts(actors, state)
        with timeline.busy(f"generator{index}", num_sequences=config.group_size):
            episodes = await actors.generators.generate.call_one(index, prompts, config.group_size)
        if episodes is None:  # the generator died; the pool is replacing it
            state.requeued.extend(prompts)
            state.accounting.requeued += len(prompts)
            await finish_rollout(state, start_version, num_not_queued=len(prompts))
            replacement_version = await actors.generators.wait_until_serving.call_one(index)
            async with state.changed:
                state.generator_versions[index] = max(state.generator_versions[index], replacement_version)
                state.changed.notify_all()
            continue
        state.num_generated_tokens += sum(e.num_generated_tokens for e in episodes)
        with timeline.busy("scorer"):
            episodes = await actors.scorer.score.call_one(episodes)
        num_filtered = 0
        if config.dynamic_sampling:
            episodes, filtered = filter_zero_advantage_groups(episodes)
            num_filtered = len(filtered)
            state.accounting.count_filtered(filtered)
        if actors.reference is not None and episodes:
            with timeline.busy("reference"):
                episodes = (await actors.reference.annotate.call(episodes)).item(procs=0)
        num_stale = await actors.buffer.put.call_one(episodes) if episodes else 0
        await finish_rollout(state, start_version, num_not_queued=num_stale + num_filtered)


async def next_prompts(actors: Actors, state: PipelineState) -> list[Episode]:
    prompts = await actors.dataset.next_episodes.call_one(1)
    state.accounting.handed_out += len(prompts)
    return prompts


async def finish_rollout(state: PipelineState, start_version: int, num_not_queued: int) -> None:
    """The rollout left flight; `num_not_queued` of its episodes did not reach the buffer."""
    async with state.changed:
        state.in_flight_versions[start_version] -= 1
        state.num_episodes_queued -= num_not_queued
        state.changed.notify_all()


async def update_generator(index: int, actors: Actors, state: PipelineState, policy_version: int, weights_dir: str) -> None:
    """Tell generator `index` that `policy_version` is servable; it swaps while decoding."""
    with state.timeline.busy(f"weights{index}"):
        result = await actors.generators.update_weights.call_one(index, policy_version, weights_dir)
    if result is None:  # the generator died; its replacement loads the newest version itself
        return
    async with state.changed:
        state.generator_versions[index] = max(state.generator_versions[index], result["policy_version"])
        # Per-update figures of the weight store (forge_rl/store/loader.py): stall, stage, bytes, GB/s...
        state.last_weight_update = {k: v for k, v in result.items() if k.startswith("weights/")}
        state.changed.notify_all()


async def train_loop(actors: Actors, state: PipelineState, metrics_logger: MetricsLogger, run_path) -> list[dict]:
    """Steps state.step + 1 to config.steps; checkpoints after a step per config.checkpoint.

    A stop (Ctrl-C, SIGTERM) while the trainer steps lets that step finish and be accounted for
    when a shutdown checkpoint is wanted, so that checkpoint matches the trainer's weights.
    """
    config, timeline = state.config, state.timeline
    checkpoints = config.checkpoint
    history, weight_updates = [], []
    for step in range(state.step + 1, config.steps + 1):
        train_version = state.next_train_version
        async with state.changed:
            await state.changed.wait_for(state.may_sample_batch)
        episodes, num_evicted = await actors.buffer.sample.call_one(config.prompts_per_step, train_version)
        await state.update(next_train_version=1, num_episodes_queued=-(config.prompts_per_step + num_evicted))

        step_start = timeline.now()
        state.step_in_flight = True  # until the step is accounted for, with no await in between
        with timeline.busy("trainer"):
            values, stopped = await finish_despite_stop(actors.trainer.train_step.call(episodes), state)
            trainer_metrics = values.item(procs=0)
        trained_tokens_per_s = trainer_metrics["num_tokens"] / max(timeline.now() - step_start, 1e-9)
        if trainer_metrics["step_skipped"]:
            # NaN/inf: no optimizer step, nothing published; the next batch trains at this version.
            state.accounting.count_skipped(episodes)
            state.step, state.step_in_flight = step, False
            await state.update(next_train_version=-1)
        else:
            state.accounting.count_trained(episodes)
            weights_dir = trainer_metrics.pop("weights/dir")
            # Finished updates are dropped (their errors raised here), so a long run holds only
            # the updates in flight, not one task per generator per step.
            for task in [t for t in weight_updates if t.done()]:
                task.result()
            weight_updates = [t for t in weight_updates if not t.done()] + [
                asyncio.create_task(update_generator(i, actors, state, trainer_metrics["policy_version"], weights_dir))
                for i in range(config.num_generators)
            ]
            state.step, state.step_in_flight = step, False

        metrics = {
            "step": step,
            **batch_metrics(episodes, train_version),
            **trainer_metrics,
            **state.last_weight_update,
            "throughput/trained_tokens_per_s": trained_tokens_per_s,
            **await pipeline_metrics(actors, state),
        }
        metrics_logger.log(metrics)
        history.append(metrics)
        if stopped:
            raise asyncio.CancelledError
        if checkpoints.enabled and (
            step % checkpoints.every_n_steps == 0 or (step == config.steps and checkpoints.on_shutdown)
        ):
            # Finished even if the run is stopped meanwhile: a stop then needs no checkpoint of its own.
            _, stopped = await finish_despite_stop(save_checkpoint(actors, state, run_path), state)
            if stopped:
                raise asyncio.CancelledError
    await asyncio.gather(*weight_updates)
    return history


async def finish_despite_stop(awaitable, state: PipelineState):
    """(result, stopped): awaits `awaitable` to its end even if the run is stopped (Ctrl-C, SIGTERM)
    meanwhile, when a shutdown checkpoint is wanted, up to _STOP_STEP_TIMEOUT_S after the stop.
    Otherwise a stop, or a dead process, cancels at once."""
    task = asyncio.ensure_future(awaitable)
    checkpoints = state.config.checkpoint
    if not (checkpoints.enabled and checkpoints.on_shutdown):
        return await task, False
    try:
        return await asyncio.shield(task), False
    except asyncio.CancelledError:
        if state.process_failures:
            task.cancel()
            raise
        try:
            return await asyncio.wait_for(task, _STOP_STEP_TIMEOUT_S), True
        except asyncio.TimeoutError:
            raise asyncio.CancelledError from None


async def save_checkpoint(actors: Actors, state: PipelineState, run_path) -> None:
    """Checkpoint after step `state.step` (forge_rl/checkpoint.py); generation goes on meanwhile.

    The buffer is read before the dataset cursor, so every prompt in the buffer's snapshot is below
    that cursor; a prompt handed out after the read is above it and is simply handed out again.
    """
    started = time.monotonic()
    partial = begin_checkpoint(run_path, state.step)
    saved = (await actors.trainer.save_checkpoint.call(str(partial / TRAINER_DIR))).item(procs=0)
    buffer_state = await actors.buffer.state_dict.call_one(state.config.checkpoint.save_buffer)
    dataset = await actors.dataset.state.call_one()
    settled = [
        *state.accounting.trained_ids(),
        *state.accounting.skipped_ids,
        *state.accounting.filtered_ids,
        *buffer_state["dropped"]["episode_ids"],
        *(episode["episode_id"] for episode in buffer_state["episodes"]),
    ]
    controller = ControllerState(
        step=state.step,
        policy_version=saved["policy_version"],
        dataset_cursor=dataset["cursor"],
        reissue=prompts_to_reissue(dataset["cursor"], settled),
        accounting=state.accounting.state_dict(),
        buffer=buffer_state,
        num_generated_tokens=state.num_generated_tokens,
        rng=capture_rng_state(),
    )
    path = commit_checkpoint(partial, controller)
    prune_checkpoints(run_path, state.config.checkpoint.keep_last)
    progress(
        f"checkpoint {path} (policy version {saved['policy_version']}, "
        f"{len(controller.reissue)} prompts to re-issue on resume, {time.monotonic() - started:.2f}s)"
    )


async def checkpoint_at_stop(actors: Actors, state: PipelineState, run_path) -> None:
    """The shutdown checkpoint (checkpoint.on_shutdown), bounded by _STOP_CHECKPOINT_TIMEOUT_S."""
    checkpoints = state.config.checkpoint
    if not (checkpoints.enabled and checkpoints.on_shutdown) or state.process_failures or state.step == 0:
        return
    if state.step_in_flight:
        progress("no checkpoint at stop: the optimizer step in flight did not finish in time")
        return
    if any(step == state.step for step, _ in complete_checkpoints(run_path)):
        return
    try:
        await asyncio.wait_for(save_checkpoint(actors, state, run_path), _STOP_CHECKPOINT_TIMEOUT_S)
    except (Exception, asyncio.TimeoutError) as e:
        progress(f"no checkpoint at stop: {type(e).__name__}: {e}")


async def resume_from(checkpoint, actors: Actors, state: PipelineState) -> None:
    """Load `checkpoint` into the trainer, buffer, dataset and `state`, and have every generator
    serve its policy version before any rollout starts."""
    saved = read_controller_state(checkpoint)
    loaded = (await actors.trainer.load_checkpoint.call(str(checkpoint / TRAINER_DIR))).item(procs=0)
    if loaded["policy_version"] != saved.policy_version:
        raise RuntimeError(
            f"checkpoint {checkpoint} is inconsistent: its trainer state is at policy version "
            f"{loaded['policy_version']}, its controller state at {saved.policy_version}"
        )
    num_buffered = await actors.buffer.load_state_dict.call_one(saved.buffer, saved.policy_version)
    await actors.dataset.load_state.call_one(saved.dataset_cursor, saved.reissue)
    restore_rng_state(saved.rng)
    state.step, state.next_train_version, state.num_episodes_queued = saved.step, saved.policy_version, num_buffered
    state.accounting = PromptAccounting.from_state_dict(
        saved.accounting, handed_out=saved.dataset_cursor - len(saved.reissue)
    )
    state.accounting.reissued_after_resume += len(saved.reissue)
    state.num_generated_tokens = state.generated_tokens_at_last_step = saved.num_generated_tokens
    await asyncio.gather(
        *(
            update_generator(i, actors, state, saved.policy_version, loaded["weights/dir"])
            for i in range(state.config.num_generators)
        )
    )
    progress(
        f"resumed from {checkpoint}: step {saved.step}, policy version {saved.policy_version}, "
        f"{num_buffered} buffered episodes, {len(saved.reissue)} prompts re-issued"
    )


async def pipeline_metrics(actors: Actors, state: PipelineState) -> dict:
    """Generation rate since the previous step, idle fractions since the loops started, buffer."""
    timeline, now = state.timeline, state.timeline.now()
    trainer_busy = timeline.busy_s("trainer")
    generator_busy = [timeline.busy_s(f"generator{i}") for i in range(state.config.num_generators)]
    generated_tokens_per_s = (state.num_generated_tokens - state.generated_tokens_at_last_step) / max(
        now - state.last_step_end_s, 1e-9
    )
    state.generated_tokens_at_last_step, state.last_step_end_s = state.num_generated_tokens, now
    buffer_stats = await actors.buffer.stats.call_one()
    return {
        "wall_time_s": now,
        "tokens/generated_total": state.num_generated_tokens,
        "throughput/generated_tokens_per_s": generated_tokens_per_s,
        "idle_fraction/trainer": 1.0 - trainer_busy / max(now, 1e-9),
        "idle_fraction/generators": 1.0 - sum(generator_busy) / max(now * len(generator_busy), 1e-9),
        **buffer_stats,
        **await actors.scorer.stats.call_one(),
        "generator/policy_versions": list(state.generator_versions),
    }


async def spawn_actors(config: GRPOConfig, model_dir, store_root, max_model_len: int) -> tuple[Actors, list]:
    """Services (dataset, scorer, buffer, the weight store's index and volume, and the generator
    pool, which spawns one process per generator itself) and the trainer ranks, on the hosts
    `config.launch` places them (forge_rl/launch.py; this machine by default)."""
    pad_id = PromptTokenizer(model_dir).pad_id
    hosts = await launch.start_hosts(config, model_dir)
    try:
        return await _spawn_on(hosts, config, model_dir, store_root, max_model_len, pad_id)
    except BaseException:
        await hosts.stop()
        raise


async def _spawn_on(hosts: launch.Hosts, config: GRPOConfig, model_dir, store_root, max_model_len: int, pad_id: int):
    services = hosts.spawn_services()
    trainer_procs = await hosts.spawn_ranks("trainer", config.trainer.num_procs)
    store_index, _ = await spawn_store(
        services, store_root, extra_files_dir=model_dir, volume_procs=hosts.store_volume_procs(services)
    )
    actors = Actors(
        dataset=services.spawn("dataset", DatasetActor, config.task, str(model_dir), config.generator.max_new_tokens),
        scorer=services.spawn("scorer", ScorerActor, config.scorer, config.task.reward, config.generator.max_new_tokens),
        buffer=services.spawn("buffer", ReplayBufferActor, config.buffer),
        generators=services.spawn(
            "generators", GeneratorPool, config.generator, str(model_dir), max_model_len, config.num_generators,
            store_index, hosts.generator_hosts(config.num_generators),
        ),
        trainer=trainer_procs.spawn(
            "trainer", TrainerActor, config.trainer, str(model_dir), store_index, str(store_root), pad_id,
            config.publish,
        ),
    )
    if config.uses_reference_model:
        reference_procs = await hosts.spawn_ranks("reference", config.reference.num_procs)
        actors.reference = reference_procs.spawn("reference", ReferenceActor, config.reference, str(model_dir), pad_id)
    return actors, [hosts]  # hosts.stop() stops every proc mesh it spawned, then releases the hosts


async def run(config: GRPOConfig) -> dict:
    """Run the recipe (or continue it, with `config.resume`); returns the summary (also the last
    line of stdout from the CLI).

    However it ends (finished, failed, Ctrl-C or SIGTERM cancelling this coroutine), generation is
    stopped and every process of the run is shut down before this returns or raises. If a process
    of the run dies, this raises ProcessDied, whose message says how to resume.
    """
    torch.set_num_threads(1)  # this process only orchestrates; the cores belong to engines and trainer
    started = time.monotonic()
    if config.resume is None:
        run_path, checkpoint = create_run_dir(config), None
    else:
        config, run_path, checkpoint = open_run_dir_for_resume(config)
    model_dir = prepare_model_dir(config, run_path)
    max_model_len = config.model.hf_config()["max_position_embeddings"]
    store = SharedMemorySnapshots(default_store_root(run_path.name), model_dir)
    progress(f"run directory {run_path}")
    state = PipelineState(config, generator_versions=[0] * config.num_generators)
    loops: asyncio.Task | None = None
    event_loop = asyncio.get_running_loop()

    def process_died(description: str) -> None:  # Monarch's fault hook; may run on another thread
        state.process_failures.append(description)
        if loops is not None:
            event_loop.call_soon_threadsafe(loops.cancel)

    try:
        with launch.on_process_failure(process_died):
            actors, proc_meshes = await spawn_actors(config, model_dir, store.root, max_model_len)
            try:
                progress("starting vLLM engine(s) and trainer (engine start takes about 30 s on a CPU)")
                generator_starts, trainer_starts, *_ = await asyncio.gather(
                    actors.generators.start.call_one(),
                    actors.trainer.setup.call(),
                    *([actors.reference.setup.call()] if actors.reference is not None else []),
                )
                processes = {
                    "generators": await actors.generators.processes.call_one(),
                    "trainer": [start["pid"] for start in trainer_starts.values()],
                }
                (run_path / "processes.json").write_text(json.dumps(processes))
                previous_history = []
                if checkpoint is not None:
                    await resume_from(checkpoint, actors, state)
                    previous_history = truncate_metrics(run_path, state.step)
                    (run_path / "timeline.jsonl").unlink(missing_ok=True)  # the timeline covers one segment
                progress(f"ready in {time.monotonic() - started:.1f}s; training to step {config.steps}")
                loops = asyncio.ensure_future(run_loops(actors, state, run_path))
                history, accounting = await loops
                history = previous_history + history
                recoveries = await actors.generators.recovery_events.call_one()
            finally:
                loops = None  # a failure reported from here on is the shutdown's own
                await shutdown(actors, proc_meshes, store)
    except BaseException as e:
        remove_unstarted_run_dir(run_path)  # a run that trained no step leaves nothing to resume from
        hint = resume_hint(run_path, config.checkpoint)
        if state.process_failures or (isinstance(e, Exception) and launch.is_process_failure(e)):
            cause = state.process_failures[0] if state.process_failures else f"{type(e).__name__}: {e}"
            raise ProcessDied(f"a process of run {run_path} died ({cause}); the run stopped. {hint}") from e
        if run_path.exists():
            if isinstance(e, Exception):
                e.add_note(f"[forge-rl] {hint}")
            else:  # stopped by Ctrl-C or SIGTERM
                progress(hint)
        raise
    last = history[-1]
    summary = {
        "final_mean_reward": sum(m["reward/mean"] for m in history[-_FINAL_REWARD_WINDOW:])
        / len(history[-_FINAL_REWARD_WINDOW:]),
        "wall_time_s": time.monotonic() - started,
        "steps": len(history),
        "max_policy_age_seen": max(m["policy_age/max"] for m in history),
        "dropped_samples": last["buffer/dropped_completions"],
        "errored_samples": sum(m["completions/errored"] for m in history),
        "engine_start_s": max(s["engine_start_s"] for s in generator_starts),
        "generator_recoveries": recoveries,
        "accounting": accounting,
        "loop_time_s": last["wall_time_s"],
        "trainer_idle_fraction": last["idle_fraction/trainer"],
        "generator_idle_fraction": last["idle_fraction/generators"],
        "run_dir": str(run_path),
        "resumed_from": None if checkpoint is None else str(checkpoint),
    }
    (run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def run_loops(actors: Actors, state: PipelineState, run_path) -> tuple[list[dict], dict]:
    """The rollout loops and the train loop until `config.steps` steps are trained; a stop
    (Ctrl-C, SIGTERM) writes a checkpoint first when checkpoint.on_shutdown says so."""
    config = state.config
    state.timeline = Timeline(run_path / "timeline.jsonl")  # its origin is when the loops start
    metrics_logger = MetricsLogger(
        run_path / "metrics.jsonl",
        config.steps,
        config.log.progress_every_s,
        sinks=open_sinks(config.log, run_path, config_to_dict(config)),
    )
    rollouts = [
        asyncio.create_task(rollout_loop(i, actors, state))
        for i in range(config.num_generators)
        for _ in range(config.prompts_in_flight_per_generator)
    ]
    try:
        history = await train_loop(actors, state, metrics_logger, run_path)
    except asyncio.CancelledError:
        await checkpoint_at_stop(actors, state, run_path)
        raise
    finally:
        for task in rollouts:
            task.cancel()
        await asyncio.gather(*rollouts, return_exceptions=True)
        metrics_logger.close()
        state.timeline.close()
        (run_path / "timeline_origin.json").write_text(json.dumps({"unix_time": state.timeline.origin_unix_time}))
    buffer_stats = await actors.buffer.stats.call_one()
    return history, state.accounting.summary(buffer_stats["buffer/dropped_episodes"])


async def shutdown(actors: Actors, proc_meshes: list, store: SharedMemorySnapshots) -> None:
    """Stop the engines, then every process of the run; bounded so a hung actor cannot block exit."""
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(actors.generators.shutdown.call_one(), _ENGINE_STOP_TIMEOUT_S)
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(procs.stop() for procs in proc_meshes), return_exceptions=True), _MESH_STOP_TIMEOUT_S
        )
    store.destroy()


if __name__ == "__main__":
    from forge_rl.cli import main as cli_main

    cli_main(["grpo", *sys.argv[1:]])
