"""The run's loops: rollouts on every generator and the trainer, concurrent in the controller.

    rollout loop (prompts_in_flight_per_generator per generator, one prompt each at a time)
        consumes   a prompt (a re-queued one first) and an admission from the gate
        produces   scored episodes into the buffer (the scoring stage runs between); with
                   `environment.name` set, a prompt is group_size episodes of the environment,
                   played turn by turn on the generator (forge_rl/envs/rollout.py), rewarded by it
        waits for  the admission gate (forge_rl/admission.py): its episodes must be trainable
                   within max_policy_age of the version it generates with, and fit in the buffer
        unblocked  when the trainer takes a batch or its generator loads newer weights
    train loop (one)
        consumes   one batch of prompts_per_step episodes from the buffer (all fresh enough), taken
                   and sent to the trainer while the step before it trains (one step ahead)
        produces   policy version v+1 in the weight store, then tells every generator (not awaited);
                   a checkpoint every checkpoint.every_n_steps (forge_rl/lifecycle.py)
        waits for  the gate's "taking the buffer's batch now leaves every episode in flight enough
                   steps before its deadline", then the buffer to hold a full batch
        unblocked  by rollouts

The library owns these loops; a recipe supplies its actors and the stage between generation and
the buffer (`RunActors.score`: verifier, reward model, reference logprobs, filters), so the next
workloads extend the loops without copying them. Nothing here imports Monarch: the actors are
handles whose endpoints are called with `.call_one()` / `.call()`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_rl import metrics as m
from forge_rl.accounting import PromptAccounting
from forge_rl.admission import AdmissionGate
from forge_rl.deadlines import within
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.rollout import EnvWaitClock, TimedEnvironment, play_group, trajectory_completion
from forge_rl.envs.runner import ContextExhausted, SampledTurn
from forge_rl.errors import GeneratorLost, TrainStepTimedOut, generator_lost, raised_by_actor
from forge_rl.health import MismatchAlarm
from forge_rl.metrics import EpisodeStats, MetricsLogger, batch_metrics, progress
from forge_rl.store.loader import FETCHED_BYTES
from forge_rl.timeline import Timeline, idle_fraction
from forge_rl.types import Episode

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig
    from forge_rl.lifecycle import Lifecycle
    from forge_rl.trainer import TrainStepResult


@dataclasses.dataclass
class RunActors:
    """The actor handles the loops call; a recipe spawns them (apps/grpo/main.py)."""

    dataset: Any
    """`next_episodes(n)`: the next prompts as episode shells; `state()`, `load_state(...)`."""
    generators: Any
    """The generator pool (forge_rl/actors/generator_pool.py): `generate(i, ...)` (single-turn
    prompts), `generate_turn(i, ...)` (environment episodes), `update_weights(i, ...)`,
    `wait_until_serving(i)`; a dead generator raises GeneratorLost."""
    buffer: Any
    """The replay buffer: `put`, `sample`, `stats`, `state_dict`, `load_state_dict`."""
    trainer: Any
    """The trainer mesh: `train_step`, `save_checkpoint`, `load_checkpoint` (rank 0 answers)."""
    score: Callable[[list[Episode], Timeline], Awaitable[list[Episode]]]
    """The recipe's stage from generated to buffered: returns the episodes to keep; those it
    leaves out are counted as filtered (never trained)."""
    stats: Callable[[], Awaitable[dict]]
    """The recipe's per-step metrics of that stage (the scorer's failures, say)."""
    renderer: Renderer | None = None
    """How an environment's observations become tokens (forge_rl/envs/renderers.py); required
    when config.environment.name is set."""
    after_publish: Callable[[int, int, dict, Timeline], Awaitable[dict]] | None = None
    """The recipe's work after a step published a version: (step, policy version, the step's
    metrics, the run's timeline, to record its busy intervals on) -> metrics to add (a
    self-distillation teacher's refresh, say). Awaited before the next step; the generators go on
    decoding meanwhile."""


@dataclasses.dataclass
class SentStep:
    """A step whose batch left the buffer and was sent to the trainer, not yet accounted for."""

    step: int
    train_version: int
    """The version the gate took the batch for (the trainer's, unless the step before it is skipped)."""
    episodes: list[Episode]
    reply: asyncio.Future
    """The trainer mesh's answer to `train_step` (a ValueMesh of TrainStepResult)."""
    trainer_busy: contextlib.ExitStack
    """The trainer's busy interval on the timeline, from the send until the reply."""
    waiting_from: float
    """When the loop began waiting for this batch (the timeline's clock)."""
    data_ready: float
    """When the gate let it be taken."""


@dataclasses.dataclass
class StepResult:
    """What one train-loop step hands the loop: its metrics, and whether a stop arrived meanwhile."""

    metrics: dict
    stopped: bool


class Pipeline:
    """What the loops share: the admission gate, prompt accounting, counters, the timeline.
    Only the controller's event loop touches it."""

    def __init__(self, config: GRPOConfig, actors: RunActors):
        self.config = config
        self.actors = actors
        self.gate = AdmissionGate(
            num_generators=config.num_generators,
            episodes_per_step=config.prompts_per_step,
            max_policy_age=config.buffer.max_policy_age,
            max_episodes_queued=config.max_episodes_queued,
            admission=config.buffer.admission,
        )
        self.accounting = PromptAccounting()
        self.requeued: collections.deque[Episode] = collections.deque()
        """Prompts whose generator died mid-request; handed out again first."""
        self.step = 0
        """Train-loop steps done, skipped non-finite steps included (restored by a resume)."""
        self._taking_batch = False
        """Between the gate's go and the batch's send to the trainer."""
        self.batches_out = 0
        """Batches taken from the buffer whose steps are not yet accounted for (two while the next
        step's batch is sent ahead)."""
        self.num_generated_tokens = 0
        self.generated_tokens_at_last_step = 0
        self._last_step_end_s = 0.0
        self._last_step_returned_s: float | None = None
        """When the previous step was accounted for (the timeline's clock); None before the first."""
        self.last_weight_update: dict = {}
        self.weights_fetched_bytes = 0
        """Per-update figures of the newest weight update (forge_rl/store/loader.py)."""
        self.timeline = Timeline()
        """Busy intervals of every component; `run` restarts it (with a file) when the loops start."""
        self.mismatch_alarm = MismatchAlarm(config.log.mismatch_alarm)
        self.make_env = None if config.environment.name is None else config.environment.make_env()
        if self.make_env is not None and actors.renderer is None:
            raise ValueError("environment.name is set but RunActors.renderer is None: episodes need a renderer")
        self.episode_stats = EpisodeStats()
        """Environment episodes played since the last step's metrics."""
        self.env_waits = EnvWaitClock(config.num_generators)
        """Generator idle time while episodes wait on environments; `run` restarts it with the timeline."""

    # Rollouts ---------------------------------------------------------------------------------

    async def rollout_loop(self, index: int) -> None:
        """One prompt at a time on generator `index`; many of these run per generator."""
        while True:
            start_version = await self.gate.admit(index)
            try:
                prompts = [self.requeued.popleft()] if self.requeued else await self._next_prompts()
            except BaseException:
                await self.gate.settle(start_version, 1, num_not_queued=1)  # the admission goes back
                raise
            prompts = [dataclasses.replace(p, admitted_version=start_version) for p in prompts]
            try:
                num_buffered = await self._rollout(index, prompts)
            except GeneratorLost:
                await self._requeue_after_loss(index, prompts, start_version)
                continue
            except BaseException:
                await self.gate.settle(start_version, len(prompts), num_not_queued=len(prompts))
                raise
            await self.gate.settle(start_version, len(prompts), num_not_queued=len(prompts) - num_buffered)

    async def _rollout(self, index: int, prompts: list[Episode]) -> int:
        """Generate, score and buffer `prompts` on generator `index`; returns how many reached the buffer."""
        config, actors = self.config, self.actors
        if self.make_env is not None:
            episodes = [await self._play(index, prompt) for prompt in prompts]
        else:
            with self.timeline.busy(f"generator{index}", num_sequences=config.group_size):
                try:
                    episodes = await actors.generators.generate.call_one(index, prompts, config.group_size)
                except Exception as e:
                    lost = generator_lost(e)
                    if lost is None:
                        raise
                    raise lost from None
        self.num_generated_tokens += sum(e.num_generated_tokens for e in episodes)
        kept = await actors.score(episodes, self.timeline)
        kept_ids = {e.episode_id for e in kept}
        self.accounting.count_filtered([e for e in episodes if e.episode_id not in kept_ids])
        num_stale = await actors.buffer.put.call_one(kept) if kept else 0
        return len(kept) - num_stale

    async def _play(self, index: int, prompt: Episode) -> Episode:
        """`prompt` as group_size episodes of the environment played on generator `index`: one
        completion per trajectory, its reward the environment's (forge_rl/envs/rollout.py)."""
        config = self.config
        envs = [
            TimedEnvironment(self.make_env(config.task.seed, prompt.episode_id), self.env_waits, index)
            for _ in range(config.group_size)
        ]

        async def generate(prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
            with self.timeline.busy(f"generator{index}", num_sequences=1), self.env_waits.turn(index):
                try:
                    return await self.actors.generators.generate_turn.call_one(index, prefix_token_ids, max_new_tokens)
                except Exception as e:
                    raised = raised_by_actor(e)
                    if isinstance(raised, (GeneratorLost, ContextExhausted)):
                        raise raised from None
                    raise

        trajectories = await play_group(envs, generate, self.actors.renderer, config.environment.limits)
        for trajectory in trajectories:
            self.episode_stats.observe(trajectory)
        first_observation = trajectories[0].conversation[0].content if trajectories[0].conversation else ""
        return dataclasses.replace(
            prompt,
            prompt_text=first_observation,
            answer="",
            prompt_token_ids=[],  # each trajectory holds its prompt as context
            completions=[trajectory_completion(t) for t in trajectories],
            generator_index=index,
            temperature=config.generator.temperature,
        )

    async def _next_prompts(self) -> list[Episode]:
        prompts = await self.actors.dataset.next_episodes.call_one(1)
        self.accounting.handed_out += len(prompts)
        return prompts

    async def _requeue_after_loss(self, index: int, prompts: list[Episode], start_version: int) -> None:
        """The generator died mid-request: its prompts go out again once it (replaced) serves."""
        self.requeued.extend(prompts)
        self.accounting.requeued += len(prompts)
        await self.gate.settle(start_version, len(prompts), num_not_queued=len(prompts))
        loaded_version = await self.actors.generators.wait_until_serving.call_one(index)
        await self.gate.generator_serves(index, loaded_version)

    # Weights ----------------------------------------------------------------------------------

    async def update_generator(self, index: int, policy_version: int, weights_dir: str) -> None:
        """Tell generator `index` that `policy_version` is servable; it swaps while decoding."""
        with self.timeline.busy(f"weights{index}"):
            try:
                result = await self.actors.generators.update_weights.call_one(index, policy_version, weights_dir)
            except Exception as e:
                if generator_lost(e) is None:
                    raise
                return  # its replacement loads the newest version itself
        await self.gate.generator_serves(index, result["policy_version"])
        self.last_weight_update = {k: v for k, v in result.items() if k.startswith("weights/")}
        self.weights_fetched_bytes += result.get(FETCHED_BYTES, 0)

    async def update_all_generators(self, policy_version: int, weights_dir: str) -> None:
        await asyncio.gather(
            *(self.update_generator(i, policy_version, weights_dir) for i in range(self.config.num_generators))
        )

    # Training ---------------------------------------------------------------------------------

    async def train_loop(self, metrics_logger: MetricsLogger, lifecycle: Lifecycle) -> list[dict]:
        """Steps self.step + 1 to config.steps; `lifecycle` checkpoints between steps and lets a
        stop (Ctrl-C, SIGTERM) wait for the steps in flight when a shutdown checkpoint is wanted.

        One step ahead: while step k trains, the loop takes step k + 1's batch and sends it, so the
        trainer starts it the moment step k ends (the buffer's round trip, the message and the
        loop's bookkeeping leave the trainer's critical path). Not past a checkpoint, which holds
        the buffer as of its step. The batch is taken at version k + 1, the version it trains at
        (the gate counts it from then); if step k is skipped (non-finite loss) it trains at k,
        younger than its label, so the age bound still holds.
        """
        history: list[dict] = []
        weight_updates: list[asyncio.Task] = []
        ahead: asyncio.Task[SentStep] | None = None
        try:
            for step in range(self.step + 1, self.config.steps + 1):
                sent = await (ahead if ahead is not None else self._send_step(step))
                ahead = None
                if step < self.config.steps and not lifecycle.checkpoint_due(step):
                    ahead = asyncio.create_task(self._send_step(step + 1))
                result, weight_updates = await self._finish_step(sent, lifecycle, weight_updates)
                results = [result]
                if result.stopped and ahead is not None:
                    # The batch sent ahead is trained and accounted too (the shutdown checkpoint
                    # then holds it as trained); one still waiting for the gate is abandoned.
                    if self._taking_batch or ahead.done():
                        ahead_result, weight_updates = await self._finish_step(await ahead, lifecycle, weight_updates)
                        results.append(dataclasses.replace(ahead_result, stopped=True))
                    else:
                        await _cancelled(ahead)
                    ahead = None
                for result in results:
                    metrics_logger.log(result.metrics)
                    history.append(result.metrics)
                if result.stopped:
                    raise asyncio.CancelledError
                await lifecycle.after_step(self)
            await asyncio.gather(*weight_updates)
        finally:
            # A stop or a failure leaves updates in flight; once the run's processes stop they would
            # fail with nobody to see it ("Task exception was never retrieved" at every Ctrl-C).
            await _cancelled(*weight_updates, *([ahead] if ahead is not None else []))
        return history

    async def _send_step(self, step: int) -> SentStep:
        """Take step `step`'s batch from the buffer once the gate allows, and send it to the trainer."""
        actors, timeline = self.actors, self.timeline
        waiting_from = timeline.now()
        train_version = await self.gate.wait_for_batch()
        data_ready = timeline.now()
        self._taking_batch = True  # a stop now waits for the batch instead of losing it in transit
        try:
            episodes, evicted_versions, buffer_waited_s = await actors.buffer.sample.call_one(
                self.config.prompts_per_step, train_version
            )
            data_ready += buffer_waited_s  # the buffer may still wait for episodes the gate counts as arrived
            trainer_busy = contextlib.ExitStack()
            trainer_busy.enter_context(timeline.busy("trainer"))
            # Sent before the gate's bookkeeping, which the trainer does not need: it wakes every
            # waiting rollout, and the batch's message should not queue behind them.
            reply = asyncio.ensure_future(actors.trainer.train_step.call(episodes))
            self.batches_out += 1  # until the step is accounted for
            try:
                await self.gate.took_batch([e.schedule_version for e in episodes], evicted_versions)
            except BaseException:
                reply.cancel()
                trainer_busy.close()
                raise
        finally:
            self._taking_batch = False
        return SentStep(step, train_version, episodes, reply, trainer_busy, waiting_from, data_ready)

    async def _finish_step(
        self, sent: SentStep, lifecycle: Lifecycle, weight_updates: list[asyncio.Task]
    ) -> tuple[StepResult, list[asyncio.Task]]:
        """Wait for the trainer's step, account for it, publish the new version to every generator
        (not awaited)."""
        actors, timeline, step, episodes = self.actors, self.timeline, sent.step, sent.episodes
        # The loop's work after the previous step (logging, a checkpoint) is on this step's path.
        path_start = sent.waiting_from if self._last_step_returned_s is None else self._last_step_returned_s
        # The buffer's and the scoring stage's counters cross while the trainer steps, off the
        # critical path (about 14 ms a step on the demo); they read as of the step's start.
        counters = asyncio.ensure_future(asyncio.gather(actors.buffer.stats.call_one(), actors.stats()))
        step_start = max(sent.data_ready, path_start)
        try:
            values, stopped = await lifecycle.finish_despite_stop(self._trained(step, sent.reply))
            trained: TrainStepResult = values.item(procs=0)
        except BaseException:
            counters.cancel()
            sent.reply.cancel()
            raise
        finally:
            sent.trainer_busy.close()
        trained_tokens_per_s = trained.metrics[m.TRAINED_TOKENS] / max(timeline.now() - step_start, 1e-9)
        if trained.skipped:
            # NaN/inf: no optimizer step, nothing published; the next batch trains at this version.
            self.accounting.count_skipped(episodes)
            await self.gate.step_skipped()
        else:
            self.accounting.count_trained(episodes)
            # Finished updates are dropped (their errors raised here), so a long run holds only
            # the updates in flight, not one task per generator per step.
            for task in [t for t in weight_updates if t.done()]:
                task.result()
            weight_updates = [t for t in weight_updates if not t.done()] + [
                asyncio.create_task(self.update_generator(i, trained.policy_version, trained.weights_dir))
                for i in range(self.config.num_generators)
            ]
        self.step = step
        self.batches_out -= 1
        step_metrics = {
            m.STEP: step,
            **batch_metrics(episodes, sent.train_version),
            **trained.metrics,
            **self.last_weight_update,
            m.WEIGHTS_FETCHED_BYTES_TOTAL: self.weights_fetched_bytes,
            m.TRAINED_TOKENS_PER_S: trained_tokens_per_s,
            **await self._pipeline_metrics(counters),
        }
        if self.actors.after_publish is not None and not trained.skipped:
            step_metrics.update(await self.actors.after_publish(step, trained.policy_version, step_metrics, timeline))
        alarms = self.mismatch_alarm.observe(step, step_metrics, episodes, sent.train_version)
        for warning in alarms:
            progress(f"WARNING {warning}")
        step_metrics[m.MISMATCH_ALARMS] = len(alarms)
        returned_s = timeline.now()
        # Data wait: the part of this step's path before the gate let its batch be taken (none when
        # the batch was taken ahead, while the previous step trained).
        data_wait_s = max(sent.data_ready - path_start, 0.0)
        step_metrics.update(critical_path_breakdown(trained.metrics, data_wait_s, returned_s - path_start - data_wait_s))
        self._last_step_returned_s = returned_s
        return StepResult(step_metrics, stopped), weight_updates

    @property
    def step_in_flight(self) -> bool:
        """A batch left the buffer and its step is not yet accounted for: no checkpoint now."""
        return self.batches_out > 0

    async def _trained(self, step: int, reply: asyncio.Future):
        """The trainer's step `step` on every rank (`reply`: its call, sent earlier); raises
        TrainStepTimedOut past config.train_step_timeout_s from now (the previous step has ended by
        then), so a hung rank or collective stops the run instead of hanging it."""
        return await within(
            self.config.train_step_timeout_s,
            asyncio.shield(reply),
            lambda: TrainStepTimedOut(step, self.config.train_step_timeout_s),
        )

    async def _pipeline_metrics(self, counters: Awaitable[tuple[dict, dict]]) -> dict:
        """Generation rate since the previous step, idle fractions since the loops started, and
        `counters`: the buffer's and the scoring stage's."""
        buffer_stats, stage_stats = await counters
        timeline, now = self.timeline, self.timeline.now()
        generator_busy_s = [timeline.busy_s(f"generator{i}") for i in range(self.config.num_generators)]
        generated_tokens_per_s = (self.num_generated_tokens - self.generated_tokens_at_last_step) / max(
            now - self._last_step_end_s, 1e-9
        )
        self.generated_tokens_at_last_step, self._last_step_end_s = self.num_generated_tokens, now
        return {
            m.WALL_TIME_S: now,
            m.GENERATED_TOKENS_TOTAL: self.num_generated_tokens,
            m.GENERATED_TOKENS_PER_S: generated_tokens_per_s,
            m.TRAINER_IDLE_FRACTION: idle_fraction([timeline.busy_s("trainer")], now),
            m.GENERATORS_IDLE_FRACTION: idle_fraction(generator_busy_s, now),
            **self._episode_metrics(now),
            **buffer_stats,
            **stage_stats,
            m.GENERATOR_POLICY_VERSIONS: list(self.gate.generator_versions),
        }

    def _episode_metrics(self, now: float) -> dict:
        """Environment episodes played since the previous step, and the generators' idle time
        waiting on environments since the loops started (none without an environment)."""
        if self.make_env is None:
            return {}
        figures, self.episode_stats = self.episode_stats.figures(), EpisodeStats()
        waiting_s = sum(self.env_waits.idle_waiting_s(i) for i in range(self.config.num_generators))
        figures[m.GENERATORS_IDLE_ON_ENV_FRACTION] = waiting_s / max(now * self.config.num_generators, 1e-9)
        return figures

    # Both -------------------------------------------------------------------------------------

    async def run(self, run_path: Path, metrics_logger: MetricsLogger, lifecycle: Lifecycle) -> tuple[list[dict], dict]:
        """The rollout loops and the train loop until config.steps steps are trained; returns the
        steps' metrics and the prompt accounting. A stop checkpoints first when configured."""
        self.timeline = Timeline(run_path / "timeline.jsonl")  # its origin is when the loops start
        self.env_waits = EnvWaitClock(self.config.num_generators)
        rollouts = [
            asyncio.create_task(self.rollout_loop(i))
            for i in range(self.config.num_generators)
            for _ in range(self.config.prompts_in_flight_per_generator)
        ]
        # A rollout that fails (anything but a lost generator, which it handles) fails the run at
        # once, instead of dying unseen while the train loop waits for its episodes.
        train = asyncio.create_task(self.train_loop(metrics_logger, lifecycle))
        try:
            done, _ = await asyncio.wait([train, *rollouts], return_when=asyncio.FIRST_COMPLETED)
            if train not in done:
                next(iter(done)).result()  # raises the rollout's error
                raise RuntimeError("a rollout loop returned; rollout loops run until cancelled")
            history = train.result()
        except asyncio.CancelledError:
            await _cancelled(train)
            await lifecycle.checkpoint_at_stop(self)
            raise
        except BaseException:
            await _cancelled(train)
            raise
        finally:
            for task in rollouts:
                task.cancel()
            await asyncio.gather(*rollouts, return_exceptions=True)
            self.timeline.close()
        buffer_stats = await self.actors.buffer.stats.call_one()
        return history, self.accounting.summary(buffer_stats[m.DROPPED_EPISODES])


def critical_path_breakdown(trainer_metrics: dict, data_wait_s: float, busy_s: float) -> dict:
    """A step's critical path in the train loop: `data_wait_s` waiting for a batch, then `busy_s`
    until the loop can wait for the next one, of which the trainer's forward, backward and
    optimizer (rank 0's, in `trainer_metrics`) are compute and the rest is overhead. A simulated
    trainer reports no compute: nothing then."""
    if m.TRAINER_FORWARD_S not in trainer_metrics:
        return {}
    compute_s = sum(trainer_metrics.get(name, 0.0) for name in (m.TRAINER_FORWARD_S, m.TRAINER_BACKWARD_S, m.TRAINER_OPTIMIZER_S))
    return {m.TRAINER_DATA_WAIT_S: data_wait_s, m.TRAINER_OVERHEAD_S: max(busy_s - compute_s, 0.0)}


async def _cancelled(*tasks: asyncio.Task) -> None:
    """Cancel `tasks` (those not done) and wait until they have finished unwinding."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
