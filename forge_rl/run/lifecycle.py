"""A run's lifecycle around its loops: directory, checkpoints, resume, stop, failures, shutdown.

    Lifecycle.open(config)        a new run directory, or the one `--resume` continues (and its
                                  newest complete checkpoint); the model directory; the store root
    async with lifecycle.owning(...)  installs the fault hook for the run's processes; on the way
                                  out, however the run ends, stops the engines, every process and
                                  the store, and turns a dead process into ProcessDied whose
                                  message names the resume command
    lifecycle.resume(pipeline)    loads the checkpoint into trainer, buffer, dataset and the loops'
                                  state, and has every generator serve its version (fresh run: no-op)
    lifecycle.run_loops(pipeline) the loops (`forge_rl.run.loop`) until config.steps; a checkpoint every
                                  checkpoint.every_n_steps and, on Ctrl-C/SIGTERM, at the stop
    lifecycle.summary(...)        the summary line (and RUN_DIR/summary.json)

The checkpoint layout, and why it is consistent while generation goes on, is `forge_rl.core.checkpoint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_rl.core.checkpoint import (
    TRAINER_DIR,
    ControllerState,
    begin_checkpoint,
    capture_rng_state,
    commit_checkpoint,
    complete_checkpoints,
    policy_trainer_dir,
    prune_checkpoints,
    read_controller_state,
    restore_rng_state,
    resume_hint,
)
from forge_rl.core.deadlines import within
from forge_rl.errors import ProcessDied, ProcessNotStarted, TrainStepTimedOut
from forge_rl.observability.metrics import progress, run_summary
from forge_rl.observability.sinks import MetricsLogger, open_sinks
from forge_rl.plumbing.reaper import Reaper
from forge_rl.plumbing.replies import rank_zero
from forge_rl.run import launch
from forge_rl.run.run_dir import (
    config_to_dict,
    create_run_dir,
    open_run_dir_for_resume,
    prepare_model_dir,
    remove_unstarted_run_dir,
    truncate_metrics,
)
from forge_rl.run.scaling import Scaling
from forge_rl.store.shm import SharedMemorySnapshots, default_store_root

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig
    from forge_rl.run.loop import Pipeline

# A stop (Ctrl-C, SIGTERM) must finish within the 10 s a user (or a scheduler's SIGTERM grace
# period) waits: every stage below takes at most its own bound and never more than is left of
# _STOP_BUDGET_S since the stop (the rest is the processes exiting).
_STOP_BUDGET_S = 9.0
# With checkpoint.on_shutdown: how long the optimizer step in flight may take to finish, then how
# long the checkpoint may take (a tiny model's takes well under a second).
_STOP_STEP_TIMEOUT_S = 2.0
_STOP_CHECKPOINT_TIMEOUT_S = 3.0
# Then the engines, then every process of the run.
_ENGINE_STOP_TIMEOUT_S = 4.0
_MESH_STOP_TIMEOUT_S = 4.0


async def _bounded_stage(what: str, timeout_s: float, awaitable) -> None:
    """Await one stage of a run's shutdown for at most `timeout_s`; past it, say so and go on (the
    processes the stage did not stop are stopped by the next, or with the controller)."""
    with contextlib.suppress(Exception):
        try:
            await within(timeout_s, awaitable)
        except TimeoutError:
            progress(f"stopping: did not {what} within {timeout_s:.1f} s; going on")


class Lifecycle:
    step_at_stop_s = _STOP_STEP_TIMEOUT_S
    """How long a step in flight at a stop may take to finish (the loop's steps after a stop too)."""

    def __init__(self, config: GRPOConfig, run_path: Path, checkpoint: Path | None):
        self.started = time.monotonic()
        self.config = config
        """The run's config; for a resume, the run directory's, with the flags given on top."""
        self.run_path = run_path
        self.checkpoint = checkpoint
        """The checkpoint a resume continues from; None for a fresh run."""
        self.model_dir = prepare_model_dir(config, run_path)
        self.store = SharedMemorySnapshots(default_store_root(run_path.name), self.model_dir)
        # A killed controller runs no cleanup, and every other process of the run dies with it, so
        # the store's shared memory (a whole model per version kept) would stay until the next
        # run on this host sweeps it. The reaper, outside the run, removes it when this process exits.
        self.policy_stores = {
            policy.name: SharedMemorySnapshots(default_store_root(f"{run_path.name}-{policy.name}"), self.model_dir)
            for policy in config.policies
        }
        """The weight store of each of config.policies, by name: its versions are its own."""
        roots = [glob.escape(str(store.root)) for store in [self.store, *self.policy_stores.values()]]
        self._store_reaper = Reaper.start(remove=[pattern for root in roots for pattern in (root, root + "-fetched-*")])
        self.process_failures: list[str] = []
        """Processes of the run that died (from Monarch's fault hook); the run stops at the first."""
        self._engine_owners: tuple = ()
        self._proc_meshes: list = []
        self._loops: asyncio.Task | None = None
        self._committing: asyncio.Task | None = None
        """The newest checkpoint's commit, waiting for the trainer's background write (`_commit`)."""
        self._stopped_at: float | None = None
        """When a stop (or failure) began to unwind the run: the clock of _STOP_BUDGET_S."""
        self.scaling = Scaling(run_path)
        """`forge-rl scale` requests, read after each step, and the generators' hosts' preemption
        notices (`forge_rl.run.scaling`)."""

    @classmethod
    def open(cls, config: GRPOConfig) -> Lifecycle:
        """A new run directory for `config`, or the run `config.resume` names (validated first)."""
        if config.resume is None:
            return cls(config, create_run_dir(config), checkpoint=None)
        return cls(*open_run_dir_for_resume(config))

    # Processes --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def owning_processes(self) -> AsyncIterator[None]:
        """While inside, a process of the run that dies stops the run (instead of Monarch's default
        hook exiting this process). However the block ends, every process is shut down before this
        returns or raises; a death is raised as ProcessDied with the resume command."""
        progress(f"run directory {self.run_path}")
        event_loop = asyncio.get_running_loop()

        stopping_cleanly = False

        def process_died(description: str) -> None:  # Monarch's fault hook; may run on another thread
            # Once a run that finished, or was stopped (Ctrl-C, SIGTERM), stops its processes, a
            # failure is the stop's own, not a death: the meshes stop at once, and an actor still
            # answering one that stopped first (the generator pool replying to the rollouts) fails
            # on the undeliverable reply. A run that ended in an error may have met a death before
            # its report: that report still counts.
            if stopping_cleanly:
                return
            self.process_failures.append(description)
            if self._loops is not None:
                event_loop.call_soon_threadsafe(self._loops.cancel)

        try:
            with launch.on_process_failure(process_died):
                try:
                    yield
                    stopping_cleanly = True
                except (asyncio.CancelledError, KeyboardInterrupt):
                    stopping_cleanly = True
                    raise
                finally:
                    self._loops = None
                    await self._shutdown()
        except BaseException as e:
            translated = self._translated(e)
            if translated is e:
                raise
            raise translated from e

    def stop_at_exit(self, *proc_meshes: Any) -> None:
        """Stop these proc meshes (or hosts, whose `stop` stops every mesh spawned on them) when
        the run ends; call it as soon as they exist, so a failure while spawning stops them too."""
        self._proc_meshes = list(proc_meshes)

    def stop_engines_first(self, *owners: Any) -> None:
        """The `shutdown` of these actors (the generator pool, the scorer's supervisor) runs before
        the proc meshes stop: vLLM's engine processes and the reward workers are children of the
        actor processes, not of Monarch."""
        self._engine_owners = owners

    def stop_began(self) -> None:
        """A stop (Ctrl-C, SIGTERM, a failure) reached the loops: _STOP_BUDGET_S starts now, unless
        it started already. Every wait of the stop, the loops' included, draws on it (`stop_timeout`)."""
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()

    def stop_timeout(self, bound_s: float) -> float:
        """`bound_s`, cut to what is left of _STOP_BUDGET_S since the stop began (which this starts,
        if nothing did)."""
        self.stop_began()
        assert self._stopped_at is not None  # stop_began set it
        return max(0.0, min(bound_s, self._stopped_at + _STOP_BUDGET_S - time.monotonic()))

    async def _shutdown(self) -> None:
        """Stop the engines, then every process of the run; bounded so a hung actor cannot block
        exit. A stage cut at its bound says so: a slow stop's log then shows where its time went."""
        if self._engine_owners:
            await _bounded_stage(
                "stop the engines",
                self.stop_timeout(_ENGINE_STOP_TIMEOUT_S),
                asyncio.gather(*(owner.shutdown.call_one() for owner in self._engine_owners), return_exceptions=True),
            )
        # A mesh stop gets at least a second, so processes are asked to exit even when the earlier
        # stages used the budget up.
        await _bounded_stage(
            "stop every process of the run",
            max(1.0, self.stop_timeout(_MESH_STOP_TIMEOUT_S)),
            asyncio.gather(*(procs.stop() for procs in self._proc_meshes), return_exceptions=True),
        )
        for store in [self.store, *self.policy_stores.values()]:
            store.destroy()
        self._store_reaper.dismiss()

    def _translated(self, error: BaseException) -> BaseException:
        """The exception the run ends with: ProcessNotStarted for a process Monarch could not start,
        ProcessDied for a dead process, a hung train step's TrainStepTimedOut with the resume
        command in its message, else `error` with the resume command attached (a Ctrl-C or
        SIGTERM prints it)."""
        remove_unstarted_run_dir(self.run_path)  # a run that trained no step leaves nothing to resume from
        hint = resume_hint(self.run_path, self.config.checkpoint)
        if isinstance(error, Exception) and (waited_s := launch.spawn_timed_out(error)) is not None:
            setting = launch.SPAWN_MAX_IDLE
            return ProcessNotStarted(
                f"a process of run {self.run_path} did not start: Monarch saw no progress in starting it for "
                f"{waited_s:.0f} s ({setting}={os.environ.get(setting, launch.MONARCH_DEFAULTS[setting])}), so the "
                "run stopped. Either the machine was too busy to start it in time (run again when it is less "
                f"busy, or allow longer with {setting}=600s in the environment), or it hung while starting "
                f"(Monarch's log, named at the run's start, says which). {hint}"
            )
        if self.process_failures or (isinstance(error, Exception) and launch.is_process_failure(error)):
            cause = self.process_failures[0] if self.process_failures else f"{type(error).__name__}: {error}"
            return ProcessDied(f"a process of run {self.run_path} died ({cause}); the run stopped. {hint}")
        if isinstance(error, TrainStepTimedOut):
            return TrainStepTimedOut(error.step, error.timeout_s, resume_hint=hint)
        if self.run_path.exists():
            if isinstance(error, Exception):
                error.add_note(f"[forge-rl] {hint}")
            else:  # stopped by Ctrl-C or SIGTERM
                progress(hint)
        return error

    # Loops ------------------------------------------------------------------------------------

    async def run_loops(self, pipeline: Pipeline) -> tuple[list[dict], dict]:
        """The loops until config.steps; returns every step's metrics (a resumed run's earlier
        steps included) and the prompt accounting."""
        previous_history = []
        if self.checkpoint is not None:
            previous_history = truncate_metrics(self.run_path, pipeline.step)
            (self.run_path / "timeline.jsonl").unlink(missing_ok=True)  # the timeline covers one segment
        progress(f"ready in {time.monotonic() - self.started:.1f}s; training to step {self.config.steps}")
        metrics_logger = MetricsLogger(
            self.run_path / "metrics.jsonl",
            self.config.steps,
            self.config.log.progress_every_s,
            sinks=open_sinks(self.config.log, self.run_path, config_to_dict(self.config)),
        )
        self.scaling.start(pipeline.actors)
        self._loops = asyncio.ensure_future(pipeline.run(self.run_path, metrics_logger, self))
        try:
            history, accounting = await self._loops
            _, stopped = await self.finish_despite_stop(self.checkpoint_committed())  # the last step's
            if stopped:
                raise asyncio.CancelledError
        except BaseException:
            if self._committing is not None:  # the trainer may never say its write is done
                self._committing.cancel()
            raise
        finally:
            self.scaling.cancel()
            metrics_logger.close()
            origin = {"unix_time": pipeline.timeline.origin_unix_time}
            (self.run_path / "timeline_origin.json").write_text(json.dumps(origin))
        return previous_history + history, accounting

    async def serve_until(self, awaitable) -> None:
        """Await `awaitable` (a service's life, `forge-rl serve`: until it is stopped) in place of
        the loops: a process that dies meanwhile cancels it, and `owning_processes` then raises
        ProcessDied naming the process."""
        self._loops = asyncio.ensure_future(awaitable)
        try:
            await self._loops
        finally:
            self._loops = None

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint follows step `step` (every_n_steps, or the last step)."""
        checkpoints = self.config.checkpoint
        due = step % checkpoints.every_n_steps == 0 or (step == self.config.steps and checkpoints.on_shutdown)
        return checkpoints.enabled and due

    async def after_step(self, pipeline: Pipeline) -> None:
        """Checkpoint after this step if it is due; raise what the previous checkpoint's
        background write raised, if it failed meanwhile."""
        if self._committing is not None and self._committing.done():
            await self.checkpoint_committed()
        await self.scaling.after_step(pipeline)
        if self.checkpoint_due(pipeline.step):
            # Finished even if the run is stopped meanwhile: a stop then needs no checkpoint of its own.
            _, stopped = await self.finish_despite_stop(self.save_checkpoint(pipeline))
            if stopped:
                raise asyncio.CancelledError

    @property
    def stop_waits_for_steps(self) -> bool:
        """Whether a stop (Ctrl-C, SIGTERM) now lets the step in flight finish, for the shutdown
        checkpoint (`forge_rl.run.loop.Pipeline._trained`); a dead process cancels at once."""
        checkpoints = self.config.checkpoint
        return checkpoints.enabled and checkpoints.on_shutdown and not self.process_failures

    async def finish_despite_stop(self, awaitable) -> tuple[Any, bool]:
        """(result, stopped): awaits `awaitable` to its end even if the run is stopped (Ctrl-C,
        SIGTERM) meanwhile, when a shutdown checkpoint is wanted, up to _STOP_STEP_TIMEOUT_S after
        the stop. Otherwise a stop, or a dead process, cancels at once."""
        task = asyncio.ensure_future(awaitable)
        checkpoints = self.config.checkpoint
        if not (checkpoints.enabled and checkpoints.on_shutdown):
            return await task, False
        try:
            return await asyncio.shield(task), False
        except asyncio.CancelledError:
            if self.process_failures:
                task.cancel()
                raise
            try:
                return await within(self.stop_timeout(_STOP_STEP_TIMEOUT_S), task), True
            except asyncio.TimeoutError:
                raise asyncio.CancelledError from None

    # Checkpoints ------------------------------------------------------------------------------

    async def save_checkpoint(self, pipeline: Pipeline) -> None:
        """Checkpoint after step `pipeline.step` (`forge_rl.core.checkpoint`); generation goes on meanwhile.

        Only taking the state holds the train loop: the trainer copies its state to host memory
        and writes the copy in the background (PolicyTrainer.start_checkpoint) while the rollouts
        hand over theirs. The checkpoint is committed (controller.json, COMPLETE, the rename) once
        the trainer says its shards are written, while the next steps train (`_commit`); the next
        checkpoint, the run's end and a stop wait for it (`checkpoint_committed`)."""
        from monarch.actor import Channel

        await self.checkpoint_committed()
        started, actors = time.monotonic(), pipeline.actors
        partial = begin_checkpoint(self.run_path, pipeline.step)
        written_port, written = Channel.open()
        # The other policies' trainers (`policies`) write theirs beside it; the commit waits for all.
        policy_ports = {name: Channel.open() for name in actors.policy_trainers}
        saved, rollouts, *policies_saved = await asyncio.gather(
            actors.trainer.save_checkpoint.call(str(partial / TRAINER_DIR), written_port),
            actors.rollouts.state_dict.call_one(self.config.checkpoint.save_buffer),
            *(
                trainer.save_checkpoint.call(str(partial / policy_trainer_dir(name)), policy_ports[name][0])
                for name, trainer in actors.policy_trainers.items()
            ),
        )
        saved = rank_zero(saved)
        for name, part in actors.checkpointed.items():
            await part.save_checkpoint(partial / name)
        controller = ControllerState(
            step=pipeline.step,
            policy_version=saved["policy_version"],
            dataset_cursor=rollouts["prompts"]["cursor"],
            reissue=rollouts["reissue"],
            accounting=rollouts["accounting"],
            buffer=rollouts["buffer"],
            num_generated_tokens=rollouts["num_generated_tokens"],
            rng=capture_rng_state(),
            data_fingerprint=rollouts["prompts"].get("data_fingerprint"),
            partial_groups=rollouts["partial_groups"],
            tokenizer_fingerprint=rollouts["tokenizer_fingerprint"],
            num_generators=rollouts["num_generators"],
            policy_versions={
                name: rank_zero(policy_saved)["policy_version"]
                for name, policy_saved in zip(actors.policy_trainers, policies_saved)
            },
        )
        held_s = time.monotonic() - started
        writes = [written, *(port[1] for port in policy_ports.values())]
        self._committing = asyncio.ensure_future(self._commit(partial, controller, writes, started, held_s))
        # Its error is raised where it is awaited; a run that fails otherwise first never awaits it.
        self._committing.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _commit(
        self, partial: Path, controller: ControllerState, writes: list, started: float, held_s: float
    ) -> None:
        """Commit the checkpoint in `partial` once every trainer's background write is done (each
        one's port in `writes` says so, or names the error)."""
        for written in writes:
            error = await written.recv()
            if error is not None:
                raise RuntimeError(f"checkpoint {partial}: a trainer's write failed: {error}")
        # Off the event loop: the fsyncs would delay the train loop's replies.
        path = await asyncio.to_thread(commit_checkpoint, partial, controller)
        await asyncio.to_thread(prune_checkpoints, self.run_path, self.config.checkpoint.keep_last)
        progress(
            f"checkpoint {path} (policy version {controller.policy_version}, {len(controller.reissue)} prompts to "
            f"re-issue on resume; held training {held_s:.2f}s, complete {time.monotonic() - started:.2f}s after the step)"
        )

    async def checkpoint_committed(self) -> None:
        """Waits until the newest checkpoint is committed; raises what its commit raised."""
        committing, self._committing = self._committing, None
        if committing is not None:
            await committing

    async def checkpoint_at_stop(self, pipeline: Pipeline) -> None:
        """The shutdown checkpoint (checkpoint.on_shutdown), bounded by _STOP_CHECKPOINT_TIMEOUT_S."""
        checkpoints = self.config.checkpoint
        if not (checkpoints.enabled and checkpoints.on_shutdown) or self.process_failures or pipeline.step == 0:
            return

        async def save() -> None:
            await self.checkpoint_committed()  # the newest checkpoint's write, already under way
            if pipeline.step_in_flight:
                progress("no checkpoint at stop: the optimizer step in flight did not finish in time")
            elif not any(step == pipeline.step for step, _ in complete_checkpoints(self.run_path)):
                await self.save_checkpoint(pipeline)
                await self.checkpoint_committed()

        try:
            await within(self.stop_timeout(_STOP_CHECKPOINT_TIMEOUT_S), save())
        except (Exception, asyncio.TimeoutError) as e:
            progress(f"no checkpoint at stop: {type(e).__name__}: {e}")

    async def resume(self, pipeline: Pipeline) -> None:
        """Load the checkpoint into the trainer, the rollouts (buffer, prompts, accounting) and
        `pipeline`, and have every generator serve its policy version before any rollout starts. A fresh run: nothing to do."""
        if self.checkpoint is None:
            return
        checkpoint, actors = self.checkpoint, pipeline.actors
        saved = read_controller_state(checkpoint)
        loaded = rank_zero(await actors.trainer.load_checkpoint.call(str(checkpoint / TRAINER_DIR)))
        if loaded["policy_version"] != saved.policy_version:
            raise RuntimeError(
                f"checkpoint {checkpoint} is inconsistent: its trainer state is at policy version "
                f"{loaded['policy_version']}, its controller state at {saved.policy_version}"
            )
        policies = {}
        for name, trainer in actors.policy_trainers.items():
            policy_loaded = rank_zero(await trainer.load_checkpoint.call(str(checkpoint / policy_trainer_dir(name))))
            if policy_loaded["policy_version"] != saved.policy_versions.get(name):
                raise RuntimeError(
                    f"checkpoint {checkpoint} is inconsistent: policy {name!r}'s trainer state is at version "
                    f"{policy_loaded['policy_version']}, its controller state at {saved.policy_versions.get(name)}"
                )
            policies[name] = policy_loaded["policy_version"]
        restore_rng_state(saved.rng)
        pipeline.step, pipeline.policy_version = saved.step, saved.policy_version
        for name, part in actors.checkpointed.items():
            await part.load_checkpoint(checkpoint / name)
        num_buffered = await actors.rollouts.load_state_dict.call_one(
            dataclasses.asdict(saved), saved.policy_version, *([policies] if policies else [])
        )
        progress(
            f"resumed from {checkpoint}: step {saved.step}, policy version {saved.policy_version}, "
            f"{num_buffered} buffered episodes, {len(saved.reissue)} prompts re-issued"
            + (f" ({len(saved.partial_groups)} continuing their partial groups)" if saved.partial_groups else "")
        )

    # Summary ----------------------------------------------------------------------------------

    def summary(self, history: list[dict], accounting: dict, **how_it_ran: Any) -> dict:
        """The run's summary: `metrics.run_summary` of its steps, the accounting, `how_it_ran`
        (engine start, recoveries, ...); also written to RUN_DIR/summary.json."""
        summary = {
            **run_summary(history),
            "wall_time_s": time.monotonic() - self.started,
            **how_it_ran,
            "accounting": accounting,
            "run_dir": str(self.run_path),
            "resumed_from": None if self.checkpoint is None else str(self.checkpoint),
            "generator_preemptions": self.scaling.preempted,
        }
        (self.run_path / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
