"""The run's loops: the train loop here, in the controller; the rollout loops in the rollouts'
process (`forge_rl.pipeline.rollouts`), which hold the admission gate, the replay buffer and the prompts.

    rollout loops (the rollouts' process; prompts_in_flight_per_generator per generator)
        produce    scored episodes into the buffer, paced by the admission gate
    train loop (one, here)
        consumes   one batch of prompts_per_step episodes from the buffer (all fresh enough), which
                   the trainer takes from the rollouts itself; asked for while the step before it
                   trains (one step ahead)
        produces   policy version v+1 in the weight store; the rollouts tell every generator;
                   a checkpoint every checkpoint.every_n_steps (`forge_rl.run.lifecycle`)
        waits for  the gate's "taking the buffer's batch now leaves every episode in flight enough
                   steps before its deadline", then the buffer to hold a full batch
        unblocked  by rollouts

Per step the train loop makes two calls, whatever the number of generators and prompts: the
trainer's `train_next_step` (each rank then takes the batch from the rollouts) and the rollouts'
`step_done` (whose reply carries the data plane's figures). Only a step slower than its timeout,
or a stop, asks the rollouts when the batch left the buffer (`batch_taken`): every message leaves
memory behind in Monarch (docs/benchmarks/README.md, "soak"). The library owns these loops; a recipe supplies
its actors, its scoring stage (which runs in the rollouts' process) and its work after a publish.
Nothing here imports Monarch: the actors are handles whose endpoints are called with
`.call_one()` / `.call()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forge_rl.core.deadlines import within
from forge_rl.errors import TrainStepTimedOut, raised_by_actor
from forge_rl.observability import metric_names as m
from forge_rl.observability.health import TOKEN_VERSIONS_BY_GENERATOR, MismatchAlarm
from forge_rl.observability.metrics import progress
from forge_rl.observability.sinks import MetricsLogger
from forge_rl.observability.timeline import Timeline, idle_fraction
from forge_rl.plumbing.native_heap import trim_native_heap_if_due
from forge_rl.plumbing.replies import rank_zero

_STOP_ROLLOUTS_TIMEOUT_S = 3.0
"""A stopped or failed run waits at most this long for each answer of the rollouts' it needs to
stop (a batch withheld, the loops stopped), cut to what is left of the stop's budget
(`forge_rl.run.lifecycle.Lifecycle.stop_timeout`); then the stop goes on without them."""

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig
    from forge_rl.training.trainer_steps import PulledStep


class LoopHooks(Protocol):
    """What the train loop asks of the run around it (`forge_rl.run.lifecycle.Lifecycle` is the
    run's): checkpoints between steps, and the bounds of a stop. The loop knows the lifecycle
    through these alone, so the lifecycle sits above it and imports it, never the reverse."""

    step_at_stop_s: float
    """How long a step in flight at a stop may take to finish."""

    @property
    def stop_waits_for_steps(self) -> bool:
        """Whether a stop now lets the step in flight finish (for a shutdown checkpoint)."""

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint follows `step`."""

    async def after_step(self, pipeline: Pipeline) -> None:
        """Between steps: a checkpoint when due, the run's stop if one arrived."""

    async def checkpoint_at_stop(self, pipeline: Pipeline) -> None:
        """The shutdown checkpoint, when the config wants one."""

    def stop_began(self) -> None:
        """A stop reached the loops: its time budget starts now."""

    def stop_timeout(self, bound_s: float) -> float:
        """`bound_s`, cut to what is left of the stop's budget."""


@dataclasses.dataclass
class RunActors:
    """The actor handles the train loop calls; a recipe spawns them (apps/grpo/main.py)."""

    rollouts: Any
    """The data plane (`forge_rl.actors.rollouts`): `start`, `step_done`, `batch_taken`, `withhold_batch`,
    `stop_loops`, `wait_for_failure`, `state_dict`, `load_state_dict`; the trainer
    calls its `batch_for_trainer`."""
    trainer: Any
    """The trainer mesh: `train_next_step`, `wait_for_publish`, `save_checkpoint`,
    `load_checkpoint` (rank 0 answers)."""
    after_publish: Callable[[int, int, dict, Timeline], Awaitable[dict]] | None = None
    """The recipe's work after a step published a version: (step, policy version, the step's
    metrics, the run's timeline, to record its busy intervals on) -> metrics to add (a
    self-distillation teacher's refresh, say). Awaited before the next step; the generators go on
    decoding meanwhile."""
    generators: Any = None
    """The generator pool, for what watches a run (bench scale's faults); the loop never calls it."""
    evaluation: Any = None
    """The run's evaluation at exact policy versions (`forge_rl.run.evaluation.Evaluation`), or
    None: started with the loops, told of every step's version (`published`, which returns at once),
    waited for once training ends; the loop never waits for an evaluation."""
    policy_trainers: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The trainer mesh of each of config.policies, by name: each step trains every one of them on
    its part of the batch (`train_next_step`, which takes that part from the rollouts), then
    `wait_for_publish` at the end, as the run's own."""
    checkpointed: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The recipe's other parts a checkpoint holds, by name: each has async `save_checkpoint(dir)`
    and `load_checkpoint(dir)`, with dir RUN_DIR/checkpoints/step-N/<name> (a self-distillation
    teacher's schedule and weights, `forge_rl.scoring.teacher.PinnedTeacherRefresh`)."""


@dataclasses.dataclass
class SentStep:
    """A step whose train call went to the trainer, which takes its batch from the rollouts; not
    yet accounted for."""

    step: int
    reply: asyncio.Future
    """The trainer mesh's answer to `train_next_step` (a ValueMesh of PulledStep, or of None if a
    stop withheld the batch)."""
    waiting_from: float
    """When the loop asked for this step (the timeline's clock)."""
    taken: asyncio.Future | None = None
    """The rollouts' `batch_taken`, asked only when needed (`Pipeline._taken`): when the batch left
    the buffer (the timeline's clock), or None if it was withheld."""
    prefetch_next: bool = False
    """The trainer was told the loop sends step + 1 next, so it asks for step + 1's batch as soon
    as this step's is in hand (`forge_rl.training.trainer_steps.BatchPrefetch`)."""
    replied: float | None = None
    """When the trainer's reply arrived (set as it arrives, whatever the loop is doing then)."""
    policy_replies: dict[str, asyncio.Future] = dataclasses.field(default_factory=dict)
    """The answers of the trainers of config.policies, by name (as `reply`)."""

    def cancel(self) -> None:
        """The run fails or is cut: stop waiting for the step's answers."""
        self.reply.cancel()
        for reply in self.policy_replies.values():
            reply.cancel()
        if self.taken is not None:
            self.taken.cancel()


@dataclasses.dataclass
class StepResult:
    """What one train-loop step hands the loop: its metrics, and whether a stop arrived meanwhile."""

    metrics: dict
    stopped: bool


class Pipeline:
    """The train loop's state. Only the controller's event loop touches it."""

    def __init__(self, config: GRPOConfig, actors: RunActors):
        self.config = config
        self.actors = actors
        self.step = 0
        """Train-loop steps done, skipped non-finite steps included (restored by a resume)."""
        self.policy_version = 0
        """The newest version a step made (restored by a resume)."""
        self.evaluated: dict[str, dict] = {}
        """The last evaluation's figures of each eval set, once training ended (the summary's)."""
        self.evaluations: dict[str, int] = {}
        """Evaluations made, failed and dropped, once training ended (the summary's)."""
        self.batches_out = 0
        """Batches taken from the buffer whose steps are not yet accounted for (two while the next
        step's batch is sent ahead)."""
        self._rollouts_sent = False
        """Whether a `train_next_step` went with the rollouts' handle (the first one does)."""
        self._last_replied_s: float | None = None
        """When the previous step's reply arrived (the timeline's clock); None before the first."""
        self.timeline = Timeline()
        """The trainer's busy intervals (the rollouts' process records the generators' on the same
        file and clock); `run` restarts it (with a file) when the loops start."""
        self.mismatch_alarm = MismatchAlarm(config.log.mismatch_alarm)
        self.rollouts_at_stop: dict = {}
        """What the rollouts' `stop` reported: accounting, what was held where, call counts."""

    # Training ---------------------------------------------------------------------------------

    async def train_loop(self, metrics_logger: MetricsLogger, lifecycle: LoopHooks) -> list[dict]:
        """Steps self.step + 1 to config.steps; `lifecycle` checkpoints between steps and lets a
        stop (Ctrl-C, SIGTERM) wait for the steps in flight when a shutdown checkpoint is wanted.

        One step ahead: while step k trains, the loop asks the trainer for step k + 1, whose ranks
        ask the rollouts for its batch as soon as they have step k's (`prefetch_next`), so it
        reaches the trainer one message after its last episode arrives, or while step k trains
        when it was ready before (the controller and the loop's bookkeeping are off the trainer's
        critical path). Not past a checkpoint, which holds the buffer as of its step. The batch is
        taken at version k + 1, the version it trains at (the gate counts it from then); if step k
        is skipped (non-finite loss) it trains at k, younger than its label, so the age bound
        still holds.
        """
        ahead: SentStep | None = None
        try:
            for step in range(self.step + 1, self.config.steps + 1):
                sent = ahead if ahead is not None else self._send_step(step, self._sends_ahead(step, lifecycle))
                ahead = None
                if sent.prefetch_next:
                    ahead = self._send_step(step + 1, self._sends_ahead(step + 1, lifecycle))
                result = await self._finish_step(sent, lifecycle)
                results = [] if result is None else [result]
                if result is None or result.stopped:
                    # A stop. The batches that left the buffer before it (the one sent ahead, and
                    # the one its trainer asked for while it trained) are trained and accounted
                    # too (the shutdown checkpoint then holds them as trained); none leaves after.
                    results += [
                        dataclasses.replace(r, stopped=True) for r in await self._finish_taken(ahead, lifecycle)
                    ]
                    ahead = None
                if result is None:  # the stop withheld this step's batch: nothing was taken
                    raise asyncio.CancelledError
                for finished in results:
                    metrics_logger.log(finished.metrics)
                if result.stopped:
                    raise asyncio.CancelledError
                await lifecycle.after_step(self)
        finally:
            if ahead is not None:  # the run fails or is cut: the rollouts' stop releases its call
                ahead.cancel()
        return metrics_logger.logged()

    def _sends_ahead(self, step: int, lifecycle: LoopHooks) -> bool:
        """Whether the loop sends step + 1 while step `step` trains: not past the last step, nor
        past a checkpoint, which holds the buffer as of its step."""
        return step < self.config.steps and not lifecycle.checkpoint_due(step)

    async def _finish_taken(self, ahead: SentStep | None, lifecycle: LoopHooks) -> list[StepResult]:
        """After a stop: no batch leaves the buffer from now on, and the steps whose batches had
        left (`ahead`, then the step its trainer asked for ahead, if it did) are finished."""
        if ahead is None:
            return []
        try:
            await self._within_stop(
                lifecycle, self.actors.rollouts.withhold_batch.call_one(sys.maxsize), "withhold every batch"
            )
        except asyncio.TimeoutError:  # the stop goes on without the rollouts
            raise asyncio.CancelledError from None
        finished: list[StepResult] = []
        sent = ahead
        while True:
            result = await self._finish_step(sent, lifecycle, withheld=True)
            if result is None:
                return finished
            finished.append(result)
            if not sent.prefetch_next:
                return finished
            sent = self._send_step(sent.step + 1, prefetch_next=False)

    def _send_step(self, step: int, prefetch_next: bool) -> SentStep:
        """Ask the trainer for step `step`: each rank takes the step's batch from the rollouts
        itself once the gate lets it go (`forge_rl.training.trainer_steps.train_on_pulled_batch`), so the
        batch's last episode is one message from the trainer. Sent ahead, while the step before
        trains."""
        actors, timeline = self.actors, self.timeline
        # The rollouts' handle goes with the first step only; the trainer keeps it (BatchPrefetch).
        rollouts, self._rollouts_sent = (None if self._rollouts_sent else actors.rollouts), True
        reply = asyncio.ensure_future(
            actors.trainer.train_next_step.call(step, rollouts, self.config.trainer.num_procs, prefetch_next)
        )
        policy_replies = {
            name: asyncio.ensure_future(
                trainer.train_next_step.call(step, rollouts, self.config.trainer.num_procs, prefetch_next)
            )
            for name, trainer in actors.policy_trainers.items()
        }
        self.batches_out += 1  # until the step is accounted for
        sent = SentStep(step, reply, timeline.now(), prefetch_next=prefetch_next, policy_replies=policy_replies)
        reply.add_done_callback(lambda _: setattr(sent, "replied", timeline.now()))
        return sent

    async def _finish_step(self, sent: SentStep, lifecycle: LoopHooks, withheld: bool = False) -> StepResult | None:
        """Wait for the trainer's step, and account for it; the rollouts tell every generator
        about the new version (not awaited) and answer with the data plane's figures. None if a
        stop withheld the step's batch (nothing was taken or trained); `withheld`: the loop
        withheld it itself."""
        actors, timeline, step = self.actors, self.timeline, sent.step
        # The trainer's critical path for this step runs from the previous step's reply (the
        # trainer free again) to this one's. The loop's work after a reply (the rollouts'
        # step_done, metrics, logging) overlaps the next step, sent ahead, and is not on it;
        # a checkpoint, which holds the next batch back, is.
        path_start = sent.waiting_from if self._last_replied_s is None else self._last_replied_s
        try:
            pulled, stopped = await self._trained(sent, lifecycle, after_stop=withheld)
        except BaseException:
            sent.cancel()
            raise
        if pulled is None:
            self.batches_out -= 1
            for reply in sent.policy_replies.values():  # withheld for them too: they answer None
                reply.cancel()
            if not (stopped or withheld):
                raise RuntimeError(f"step {step}'s batch was withheld without a stop")
            return None
        policies_trained = await self._policies_trained(sent, lifecycle if stopped or withheld else None)
        trained = pulled.trained
        replied_s = sent.replied if sent.replied is not None else timeline.now()
        step_start = max(pulled.ready_s, path_start)
        # The trainer's busy interval: from its batch (or the end of its step before) to its reply.
        timeline.record("trainer", step_start, replied_s)
        trained_tokens_per_s = trained.metrics[m.TRAINED_TOKENS] / max(replied_s - step_start, 1e-9)
        # NaN/inf: no optimizer step, nothing published; the next batch trains at this version.
        rollout_metrics = await actors.rollouts.step_done.call_one(
            step,
            trained.skipped,
            trained.policy_version,
            *(
                [{name: (t.skipped, t.policy_version) for name, t in policies_trained.items()}]
                if policies_trained
                else []
            ),
        )
        token_versions = rollout_metrics.pop(TOKEN_VERSIONS_BY_GENERATOR)
        self.step = step
        self.batches_out -= 1
        now = timeline.now()
        step_metrics = {
            m.STEP: step,
            **trained.metrics,
            m.TRAINED_TOKENS_PER_S: trained_tokens_per_s,
            m.WALL_TIME_S: now,
            m.TRAINER_IDLE_FRACTION: idle_fraction([timeline.busy_s("trainer")], now),
            **{
                f"policies/{name}/{key}": value
                for name, t in policies_trained.items()
                for key, value in t.metrics.items()
            },
            **rollout_metrics,
        }
        if self.actors.after_publish is not None and not trained.skipped:
            step_metrics.update(await self.actors.after_publish(step, trained.policy_version, step_metrics, timeline))
        self.policy_version = trained.policy_version
        if self.actors.evaluation is not None:
            await self.actors.evaluation.published(step, trained.policy_version)
        alarms = self.mismatch_alarm.observe(step, step_metrics, token_versions, pulled.train_version)
        for warning in alarms:
            progress(f"WARNING {warning}")
        step_metrics[m.MISMATCH_ALARMS] = len(alarms)
        # Data wait: the part of this step's path after the loop began waiting for the batch and
        # before it left the buffer (none when it was taken while the previous step trained).
        data_wait_s = max(pulled.ready_s - max(path_start, sent.waiting_from), 0.0)
        step_metrics.update(critical_path_breakdown(trained.metrics, data_wait_s, replied_s - path_start - data_wait_s))
        self._last_replied_s = replied_s
        trim_native_heap_if_due()  # the controller's, once a minute at most
        return StepResult(step_metrics, stopped)

    async def _policies_trained(self, sent: SentStep, stopping: LoopHooks | None) -> dict:
        """The steps of the trainers of config.policies on `sent`'s batch (TrainStepResult by
        name), once the run's own has answered: they took the same batch, so each gets
        config.train_step_timeout_s from now (TrainStepTimedOut past it), or in a stop
        (`stopping`) what is left of the stop's budget for a step."""
        trained = {}
        for name, reply in sent.policy_replies.items():
            if stopping is not None:
                try:
                    answer = await self._within_stop(
                        stopping,
                        asyncio.shield(reply),
                        f"finish policy {name!r}'s step {sent.step}",
                        stopping.step_at_stop_s,
                    )
                except asyncio.TimeoutError:  # left in flight: no shutdown checkpoint
                    raise asyncio.CancelledError from None
            else:
                answer = await within(
                    self.config.train_step_timeout_s,
                    asyncio.shield(reply),
                    lambda: TrainStepTimedOut(sent.step, self.config.train_step_timeout_s),
                )
            pulled = rank_zero(answer)
            if pulled is None:
                raise RuntimeError(
                    f"policy {name!r}'s trainer got no batch for step {sent.step}, which the run's own trained"
                )
            trained[name] = pulled.trained
        return trained

    @property
    def step_in_flight(self) -> bool:
        """A batch left the buffer and its step is not yet accounted for: no checkpoint now."""
        return self.batches_out > 0

    async def _trained(
        self, sent: SentStep, lifecycle: LoopHooks, after_stop: bool = False
    ) -> tuple[PulledStep | None, bool]:
        """(The trainer's answer to step `sent.step`, whether a stop came meanwhile.) The step raises
        TrainStepTimedOut past config.train_step_timeout_s from when its batch left the buffer (the
        previous step has ended by then), so a hung rank or collective stops the run instead of
        hanging it; the wait for data is not timed (`_answer_in_time`). A stop withholds the batch
        if it has not left (the answer is then None); if it has, `lifecycle` lets the stop wait for
        the step, for the shutdown checkpoint. `after_stop`: the stop came before this step (the
        loop withheld every batch): it gets what is left of the stop's budget if its batch left."""
        if not after_stop:
            try:
                return rank_zero(await self._answer_in_time(sent)), False
            except asyncio.CancelledError:  # a stop
                if not lifecycle.stop_waits_for_steps:
                    raise
                if sent.taken is None or not sent.taken.done():
                    try:
                        await self._within_stop(
                            lifecycle,
                            self.actors.rollouts.withhold_batch.call_one(sent.step),
                            f"withhold step {sent.step}'s batch",
                        )
                    except asyncio.TimeoutError:  # the stop goes on without the rollouts
                        raise asyncio.CancelledError from None
        try:
            # Withheld by now unless it had left, so the rollouts answer at once.
            taken_s = await self._within_stop(
                lifecycle, asyncio.shield(self._taken(sent)), f"learn whether step {sent.step}'s batch left"
            )
            if taken_s is None:  # withheld: nothing was taken, and the trainer's ranks answer None
                return rank_zero(await sent.reply), True
            values = await self._within_stop(
                lifecycle, asyncio.shield(sent.reply), f"finish step {sent.step}", lifecycle.step_at_stop_s
            )
        except asyncio.TimeoutError:  # left in flight: no shutdown checkpoint
            raise asyncio.CancelledError from None
        return rank_zero(values), True

    async def _answer_in_time(self, sent: SentStep) -> Any:
        """The trainer's answer to step `sent.step`; raises TrainStepTimedOut once the step has run
        config.train_step_timeout_s from when its batch left the buffer, or from now if it left
        while the step before trained (its ranks take one step at a time). The rollouts are asked
        when it left (`batch_taken`) only if the answer has not come within the timeout: most steps
        then cost the controller no message for it."""
        timeout_s, since_s = self.config.train_step_timeout_s, self.timeline.now()
        try:
            return await within(timeout_s, asyncio.shield(sent.reply))
        except asyncio.TimeoutError:
            if sent.reply.done():  # it came at the deadline, or is the trainer's own TimeoutError
                return sent.reply.result()
        taken_s = await asyncio.shield(self._taken(sent))  # waits for the data: not timed
        if taken_s is None:  # withheld: the rollouts' loops stopped, and the ranks answer None
            return await asyncio.shield(sent.reply)
        return await within(
            max(max(taken_s, since_s) + timeout_s - self.timeline.now(), 0.0),
            asyncio.shield(sent.reply),
            lambda: TrainStepTimedOut(sent.step, timeout_s),
        )

    def _taken(self, sent: SentStep) -> asyncio.Future:
        """The rollouts' `batch_taken` for `sent`'s step (asked once): when its batch left the
        buffer (the timeline's clock), once it has, or None once it is withheld."""
        if sent.taken is None:
            sent.taken = asyncio.ensure_future(self.actors.rollouts.batch_taken.call_one(sent.step))
        return sent.taken

    @staticmethod
    async def _within_stop(
        lifecycle: LoopHooks, awaitable, what: str, bound_s: float = _STOP_ROLLOUTS_TIMEOUT_S
    ) -> Any:
        """Await `awaitable` within `bound_s`, cut to what is left of the stop's budget; past it the
        stop goes on without it, saying so: raises asyncio.TimeoutError."""
        timeout_s = lifecycle.stop_timeout(bound_s)
        try:
            return await within(timeout_s, awaitable)
        except asyncio.TimeoutError:
            progress(f"stopping: did not {what} within {timeout_s:.1f} s; the stop goes on without it")
            raise

    # Both -------------------------------------------------------------------------------------

    async def run(self, run_path: Path, metrics_logger: MetricsLogger, lifecycle: LoopHooks) -> tuple[list[dict], dict]:
        """The rollout loops and the train loop until config.steps steps are trained; returns the
        steps' metrics and the prompt accounting. A stop checkpoints first when configured."""
        rollouts = self.actors.rollouts
        self.timeline = Timeline(run_path / "timeline.jsonl")  # its origin is when the loops start
        await rollouts.start.call_one(str(run_path / "timeline.jsonl"), self.timeline.origin_unix_time)
        evaluation = self.actors.evaluation
        if evaluation is not None:
            await evaluation.start(self.step, self.policy_version, metrics_logger)
        # A rollout or a weight update that fails (anything but a lost generator, which the
        # rollouts handle) fails the run at once, instead of leaving the train loop waiting for
        # episodes that will not come.
        failure = asyncio.ensure_future(rollouts.wait_for_failure.call_one())
        train = asyncio.create_task(self.train_loop(metrics_logger, lifecycle))
        finished = False
        try:
            done, _ = await asyncio.wait([train, failure], return_when=asyncio.FIRST_COMPLETED)
            if train not in done:
                try:
                    failure.result()
                except Exception as e:
                    raise _own_error_unwrapped(e) from None
                raise RuntimeError("the rollouts' wait_for_failure returned without a failure")
            history = train.result()
            finished = True
        except asyncio.CancelledError:
            lifecycle.stop_began()  # the stop's budget covers the steps it lets finish too
            await _cancelled(train)
            await lifecycle.checkpoint_at_stop(self)
            raise
        except BaseException:
            await _cancelled(train)
            raise
        finally:
            failure.cancel()
            self.timeline.close()
            if finished:  # the last version's updates reach every generator before the run ends
                await self.actors.trainer.wait_for_publish.call()  # its snapshot is taken after the reply
                for trainer in self.actors.policy_trainers.values():
                    await trainer.wait_for_publish.call()
                self.rollouts_at_stop = await rollouts.stop_loops.call_one(True)
                if evaluation is not None:
                    progress("training done; waiting for the evaluations asked for (eval.at_end: the last version's)")
                    self.evaluated = await evaluation.finish()
                    self.evaluations = evaluation.counts()
            elif evaluation is not None:  # bounded: the store may be gone with the run's failure
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await self._within_stop(lifecycle, evaluation.stop(), "stop the evaluations")
            else:
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    self.rollouts_at_stop = await self._within_stop(
                        lifecycle, rollouts.stop_loops.call_one(False), "stop the rollout loops"
                    )
        return history, self.rollouts_at_stop["accounting"]


def critical_path_breakdown(trainer_metrics: dict, data_wait_s: float, busy_s: float) -> dict:
    """A step's critical path, from the previous step's reply to this one's: `data_wait_s` waiting
    for a batch, then `busy_s` until the reply, of which the trainer's forward, backward and
    optimizer (rank 0's, in `trainer_metrics`) are compute and the rest is overhead (taking the
    batch, the messages, batching and publishing in the trainer, a checkpoint). A simulated
    trainer reports no compute: nothing then."""
    if m.TRAINER_FORWARD_S not in trainer_metrics:
        return {}
    compute_s = sum(
        trainer_metrics.get(name, 0.0) for name in (m.TRAINER_FORWARD_S, m.TRAINER_BACKWARD_S, m.TRAINER_OPTIMIZER_S)
    )
    return {m.TRAINER_DATA_WAIT_S: data_wait_s, m.TRAINER_OVERHEAD_S: max(busy_s - compute_s, 0.0)}


def _own_error_unwrapped(error: Exception) -> Exception:
    """A failure the rollouts raised: one of forge_rl's own errors (a scorer that kept dying, say)
    without Monarch's wrapper, since its message says what to do; any other as it came, with the
    remote tracebacks in its report."""
    raised = raised_by_actor(error)
    return raised if type(raised).__module__.startswith("forge_rl.") and isinstance(raised, Exception) else error


async def _cancelled(*tasks: asyncio.Task) -> None:
    """Cancel `tasks` (those not done) and wait until they have finished unwinding."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
