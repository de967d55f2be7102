"""The run's data plane: rollouts on every generator, the admission gate, the replay buffer, the
prompts and their accounting, on one event loop in a process of their own (the RolloutsActor,
`forge_rl.actors.rollouts`), so the controller's work per step does not grow with the number of
generators or prompts.

    rollout loop (prompts_in_flight_per_generator per generator, one prompt each at a time)
        consumes   a prompt (a re-queued one first; built here from its index, `forge_rl.pipeline.prompts`)
                   and an admission from the gate
        produces   scored episodes into the buffer (the recipe's scoring stage runs between); with
                   `environment.name` set, a prompt is group_size episodes of the environment,
                   played turn by turn on the generator (`forge_rl.envs.rollout`), rewarded by it
        waits for  the admission gate (`forge_rl.core.admission`): its episodes must be trainable
                   within max_policy_age of the version it generates with, and fit in the buffer
        unblocked  when the train loop takes a batch or its generator loads newer weights

The train loop (`forge_rl.run.loop`, in the controller) makes one call per step here, whatever the
number of generators and prompts: `step_done` (accounts for the step, tells every generator about
the new version, and answers with this plane's figures for the step); and `batch_taken` (when the
step's batch left the buffer) only for a step slower than its timeout, or at a stop. Each trainer rank takes the step's batch itself
(`batch_for_trainer`: the gate's go, then the batch out of the buffer); a stop withholds one still
waiting at the gate (`withhold_batch`).
Prompt i depends only on (task, seed, i), so prompts need no messages; the buffer and the gate
are where the episodes arrive, so buffering one needs none either.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from forge_rl.core.accounting import PromptAccounting
from forge_rl.core.admission import AdmissionGate
from forge_rl.core.buffer import WaitingBuffer
from forge_rl.core.columns import batch_columns, exact_versions
from forge_rl.core.policies import episodes_of_policy, metric_name
from forge_rl.envs.forks import play_forks, refuse_unless_replayable
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.rollout import EnvWaitClock, TimedEnvironment, group_completions, play_group
from forge_rl.envs.runner import ContextExhausted, GenerateTurn, SampledTurn
from forge_rl.errors import GeneratorFailed, GeneratorLost, generator_lost, raised_by_actor
from forge_rl.observability import metric_names as m
from forge_rl.observability.health import TOKEN_VERSIONS_BY_GENERATOR, token_versions_by_generator
from forge_rl.observability.metrics import EpisodeStats, batch_metrics, progress
from forge_rl.observability.timeline import Timeline, idle_fraction, watch_event_loop_lag
from forge_rl.pipeline.branching import Brancher
from forge_rl.pipeline.partial_groups import PartialGroup, restored_partial_groups, saved_partial_tokens
from forge_rl.store.loader import FETCHED_BYTES
from forge_rl.training.trainer_steps import PulledBatch
from forge_rl.types import Completion, Episode, join_pieces

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig

UPDATES_PER_TURN = 16
"""Weight-update calls the rollouts send per event-loop turn when a version is published."""

ROLLOUT_CALLS_TOTAL = "rollouts/calls_total"
"""Endpoint calls this plane made since the loops started (generators' pool and the scoring stage)."""


class Prompts(Protocol):
    """Where prompts come from (`forge_rl.pipeline.prompts.PromptSource`)."""

    @property
    def tokenizer_fingerprint(self) -> str | None:
        """The tokenizer its prompts are encoded with (`forge_rl.tasks.tokenizer.tokenizer_fingerprint`),
        None if unknown."""

    def next_episodes(self, num_prompts: int) -> list[Episode]: ...
    def state(self) -> dict: ...
    def load_state(self, cursor: int, reissue: list[int], data_fingerprint: str | None = None) -> None: ...
    def stats(self) -> dict: ...


@dataclasses.dataclass
class NextBatch:
    """A step's batch as it left the buffer (`Rollouts.next_batch`), kept until its step is
    accounted for (`step_done`); the trainer gets it as columns (`batch_for_trainer`)."""

    train_version: int
    """The policy version it trains at (the gate counts it from then)."""
    episodes: list[Episode]
    ready_s: float
    """When it was taken, on the run's timeline (the controller's clock): the end of the train
    loop's data wait."""


@dataclasses.dataclass
class RolloutActors:
    """What the rollouts call: the generator pool and the recipe's stage from generated to buffered."""

    generators: Any
    """The generator pool (`forge_rl.actors.generator_pool`): `generate(i, ...)` (single-turn
    prompts), `generate_turn(i, ...)` (environment episodes), `update_weights(i, ...)`,
    `wait_until_serving(i)`; a dead generator raises GeneratorLost."""
    score: Callable[[list[Episode], Timeline], Awaitable[list[Episode]]]
    """The recipe's stage from generated to buffered (`forge_rl.actors.scoring_stage`): returns the
    episodes to keep; those it leaves out are counted as filtered (never trained)."""
    stats: Callable[[], Awaitable[dict]]
    """The stage's per-step metrics (the scorer's failures, say)."""
    renderer: Renderer | None = None
    """How an environment's observations become tokens (`forge_rl.envs.renderers`); required
    when config.environment.name is set."""
    policy_generators: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The generator pool of each of config.policies, by name: the turns of the seats it plays."""


class Rollouts:
    """The data plane's state and loops. Only its own event loop touches it."""

    def __init__(self, config: GRPOConfig, actors: RolloutActors, prompts: Prompts):
        self.config = config
        self.actors = actors
        self.prompts = prompts
        self.gate = AdmissionGate(
            num_generators=config.num_generators,
            prompts_per_step=config.prompts_per_step,
            # With several policies, the tightest of their bounds: an episode holds tokens of each.
            max_policy_age=min(config.run_policies.max_ages.values()),
            max_episodes_queued=config.max_episodes_queued,
            admission=config.buffer.admission,
            wait_for_stragglers=config.buffer.wait_for_stragglers,
        )
        self.policies = config.run_policies
        """Who plays each seat, and each policy's age bound (`forge_rl.core.policies`)."""
        self.buffer = WaitingBuffer(config.buffer, self.policies.max_ages)
        self.policy_versions: dict[str, int] = {p.name: 0 for p in config.policies}
        """The newest version each of config.policies published (the run's own: the gate's)."""
        self._step_batches: dict[int, list] = {}
        """With config.policies, per step: [its `next_batch` task, policies yet to take their part]."""
        self.accounting = PromptAccounting()
        self.requeued: collections.deque[Episode] = collections.deque()
        """Prompts whose generator died mid-request; handed out again first."""
        self.salvaged: dict[int, PartialGroup] = {}
        """Per re-queued prompt (episode id), what its dead generator had sampled of its group, a
        segment at a time (generator.segment_tokens), or what a checkpoint held of it: its next
        generator continues from it."""
        self.in_progress: dict[int, PartialGroup] = {}
        """Per prompt being generated a segment at a time, its group as of its last segment (what
        a checkpoint keeps)."""
        self.taken: dict[int, NextBatch] = {}
        """The batch of each step taken and not yet accounted for (`step_done`)."""
        self._pulled: dict[tuple[int, str | None], list] = {}
        """Per step and policy whose trainer's ranks ask for it: [its columns' task, ranks yet to ask]."""
        self._batch_events = asyncio.Condition()
        """Notified when a batch is taken or withheld (`batch_taken`)."""
        self.num_generated_tokens = 0
        self._generated_tokens_at_last_step = 0
        self._last_step_end_s = 0.0
        self.last_weight_update: dict = {}
        self.weights_fetched_bytes = 0
        """Per-update figures of the newest weight update (`forge_rl.store.loader`)."""
        self.timeline = Timeline()
        """Busy intervals of the generators and the scoring stage; `start` gives it the run's file."""
        self.make_env = None if config.environment.name is None else config.environment.make_env()
        if self.make_env is not None and actors.renderer is None:
            raise ValueError("environment.name is set but RolloutActors.renderer is None: episodes need a renderer")
        self.brancher = Brancher(config.branch) if config.branch.enabled else None
        """Grows each sampled group into a tree (branch.rule; `forge_rl.pipeline.branching`)."""
        self.episode_stats = EpisodeStats()
        """Environment episodes played since the last step's figures."""
        self.env_waits = EnvWaitClock(config.num_generators)
        """Generator idle time while episodes wait on environments; `start` restarts it with the timeline."""
        self.calls: collections.Counter[str] = collections.Counter()
        """Endpoint calls made here, per endpoint (ROLLOUT_CALLS_TOTAL)."""
        self.lags_s: list[tuple[float, float]] = []
        """(wall time, seconds late) of each 10 ms timer on this event loop (log.event_loop_lag)."""
        self.rollouts_log: TextIO | None = None
        """RUN_DIR/rollouts.jsonl, with log.rollouts: each trained episode (`rollout_record`)."""
        self.generators: list[int] = list(range(config.num_generators))
        """The generators in the pool now, by index: the run's first `num_generators`, then those
        added (`add_generator`), less those removed (`remove_generator`)."""
        self._leaving: dict[int, asyncio.Event] = {}
        """Set for a generator being removed: its rollout loops take no more admissions."""
        self._loops: dict[int, set[asyncio.Task]] = {}
        """Each generator's rollout loops."""
        self.cut_at_stop: set[int] = set()
        """Prompts whose generation or scoring the stop cut short."""
        self._tasks: set[asyncio.Task] = set()
        """Rollout loops, weight updates and probes; held here because the event loop keeps only weak
        references to tasks."""
        self._updates: set[asyncio.Task] = set()
        """The weight updates in flight (also in `_tasks`)."""
        self._failure: asyncio.Future | None = None
        """The first error of a rollout or a weight update (`start` makes it): fails the run
        (`wait_for_failure`)."""
        self._stage_stats: dict = {}
        self._stage_stats_next: asyncio.Future | None = None
        self._taking = asyncio.Lock()
        """Held by a `next_batch` from the gate to the batch: steps take their batches in order."""
        self._waiting: tuple[int, asyncio.Future] | None = None
        """The step whose `next_batch` waits at the gate, and what `withhold_batch` resolves to stop it."""
        self._withheld_through = 0
        """`next_batch` for this step or an earlier one returns None (`withhold_batch`)."""
        self._taken_through = 0
        """The newest step whose batch was taken (steps take their batches in order)."""

    # The train loop's calls -------------------------------------------------------------------

    def start(self, timeline_path: Path | None, origin_unix_time: float | None) -> None:
        """Start the rollout loops; busy intervals go to `timeline_path` (the run's timeline.jsonl,
        which the controller also appends to), on the controller's origin `origin_unix_time`."""
        self._failure = asyncio.get_running_loop().create_future()
        self.timeline = Timeline(timeline_path, origin_unix_time=origin_unix_time)
        if self.config.log.rollouts and timeline_path is not None:  # the run directory's
            self.rollouts_log = open(timeline_path.parent / "rollouts.jsonl", "a", buffering=1)
        self.env_waits = EnvWaitClock(self.config.num_generators)
        for index in self.generators:
            self._spawn_rollout_loops(index)
        if self.config.log.event_loop_lag:
            self._spawn(watch_event_loop_lag(self.lags_s))

    async def wait_for_failure(self) -> None:
        """Raises the first error of a rollout or a weight update (none: waits for ever)."""
        if self._failure is None:
            raise RuntimeError("Rollouts.wait_for_failure called before start")
        await asyncio.shield(self._failure)

    async def batch_for_trainer(self, step: int, num_ranks: int, policy: str | None = None) -> PulledBatch | None:
        """Step `step`'s batch, for each of the trainer's `num_ranks` ranks, which ask for it
        themselves (`forge_rl.training.trainer_steps.train_on_pulled_batch`): the first call waits for the gate
        and takes it out of the buffer (`next_batch`), every rank gets the same batch, and the last
        batch's episodes reach the trainer in one message from here, as columns (`forge_rl.core.columns`:
        the trainer only pads them). `policy`: the trainer of that one of config.policies, which
        gets the completions of the seats it plays (the run's own trainer: None, the rest). None
        if withheld."""
        return await _shared(self._pulled, (step, policy), lambda: self._columns_of_next_batch(step, policy), num_ranks)

    async def _columns_of_next_batch(self, step: int, policy: str | None) -> PulledBatch | None:
        batch = await self._next_batch_of_every_policy(step)
        if batch is None:
            return None
        episodes, train_version = batch.episodes, batch.train_version
        if self.config.policies:
            episodes = episodes_of_policy(episodes, policy)
            if policy is not None:  # its own version count, as the age bound took it
                train_version += self.buffer.buffer.policy_offsets.get(policy, 0)
            if not episodes:  # no agent of its seats spoke in the batch: its trainer has nothing to train
                return PulledBatch(train_version, None, batch.ready_s)
        loss = self.config.trainer.loss
        # In a thread: building `bench scale`'s batch at 128 generators is long enough in Python to
        # hold up every rollout loop on this event loop; a thread lets the loop run at every switch
        # interval of the GIL. The episodes left the buffer: nothing writes them now.
        columns = await asyncio.to_thread(
            batch_columns, episodes, loss.normalize_advantage_std, loss.step_discount, loss.local_advantage_weight
        )
        return PulledBatch(train_version, columns, batch.ready_s)

    async def _next_batch_of_every_policy(self, step: int) -> NextBatch | None:
        """`next_batch(step)`, taken once for the trainers of every policy of the run."""
        if not self.config.policies:
            return await self.next_batch(step)
        return await _shared(self._step_batches, step, lambda: self.next_batch(step), len(self.policies.names))

    async def batch_taken(self, step: int) -> float | None:
        """Waits until step `step`'s batch has left the buffer, and answers when (on the run's
        timeline: the train loop times the step from then, train_step_timeout_s), or None once it
        was withheld. Asked before the step is accounted for (`step_done`), and only for a step
        slower than its timeout, or at a stop (`forge_rl.run.loop`)."""
        async with self._batch_events:  # the state is read under the lock its notifier holds
            await self._batch_events.wait_for(lambda: step <= max(self._taken_through, self._withheld_through))
        return self.taken[step].ready_s if step <= self._taken_through else None

    async def next_batch(self, step: int) -> NextBatch | None:
        """Waits until the gate lets step `step`'s batch be taken, and takes it out of the buffer;
        steps take theirs in the order they ask. None if `withhold_batch(step)` came first or
        while it waited at the gate (nothing taken: a stop abandons it); once past the gate, the
        batch is taken and returned whatever comes."""
        async with self._taking:
            if step <= self._withheld_through:
                return None
            withheld = asyncio.get_running_loop().create_future()
            self._waiting = (step, withheld)
            go = asyncio.ensure_future(self.gate.wait_for_batch())
            try:
                await asyncio.wait([go, withheld], return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._waiting = None
            if not go.done():
                go.cancel()
                await asyncio.gather(go, return_exceptions=True)
                return None
            train_version = go.result()
            episodes, evicted_versions, _ = await self.buffer.sample(self.config.prompts_per_step, train_version)
            batch = self.taken[step] = NextBatch(train_version, episodes, self.timeline.now())
            self._taken_through = step
            await self._notify_batch_events()
            # The trainer is not waiting for the gate's bookkeeping: its ranks get the batch at once.
            await self.gate.took_batch([e.schedule_version for e in episodes], evicted_versions)
            return batch

    async def withhold_batch(self, step: int) -> None:
        """`next_batch` for step `step` or earlier returns None if it is waiting at the gate or has
        not begun yet; one past the gate is not stopped."""
        self._withheld_through = max(self._withheld_through, step)
        if self._waiting is not None and self._waiting[0] <= step and not self._waiting[1].done():
            self._waiting[1].set_result(None)
        await self._notify_batch_events()

    async def _notify_batch_events(self) -> None:
        async with self._batch_events:
            self._batch_events.notify_all()

    async def step_done(
        self, step: int, skipped: bool, policy_version: int, policies: dict[str, tuple[bool, int]] | None = None
    ) -> dict:
        """Step `step` trained (or was `skipped`: a non-finite loss, nothing published): account for
        its batch, tell every generator about `policy_version` (not awaited), and answer with this
        plane's figures: the batch's (`batch_metrics`, and its token versions by generator under
        TOKEN_VERSIONS_BY_GENERATOR, for the mismatch alarm's message), then the generators', the
        buffer's and the scoring stage's (its counters as of the step before: they are read off
        the train loop's path). `policies`: what each of config.policies' trainers made of its
        part of the batch (skipped, its version); the batch counts as
        trained if any policy trained on it."""
        batch = self.taken.pop(step)
        policies = policies or {}
        policy_metrics = self._policies_stepped(batch, skipped, policy_version, policies)
        if skipped:
            self.buffer.step_skipped()
            await self.gate.step_skipped()
        if skipped and all(done[0] for done in policies.values()):
            self.accounting.count_skipped(batch.episodes)
        else:
            self.accounting.count_trained(batch.episodes)
            if not skipped:
                self._updates.add(self._spawn(self._tell_generators(policy_version)))
            if self.rollouts_log is not None:
                self.rollouts_log.writelines(
                    json.dumps(rollout_record(step, batch.train_version, episode)) + "\n" for episode in batch.episodes
                )
        return {
            **batch_metrics(
                batch.episodes,
                batch.train_version,
                self.config.trainer.loss.normalize_advantage_std,
                self.config.trainer.loss.step_discount,
                self.config.trainer.loss.local_advantage_weight,
            ),
            TOKEN_VERSIONS_BY_GENERATOR: token_versions_by_generator(batch.episodes),
            **policy_metrics,
            **await self._step_metrics(),
        }

    def _policies_stepped(
        self, batch: NextBatch, skipped: bool, policy_version: int, policies: dict[str, tuple[bool, int]]
    ) -> dict:
        """With config.policies: each policy's new version goes to its generators (not awaited),
        the buffer counts each one's tokens against its own version from now on, and the step's
        figures per policy: its version, and its part's rewards and token ages at the version it
        trained at (POLICY_AGE_MAX per policy is what its age bound holds)."""
        if not self.config.policies:
            return {}
        loss = self.config.trainer.loss
        metrics = {}
        trained_at: dict[str | None, int] = {None: policy_version - (0 if skipped else 1)}
        for name, (policy_skipped, version) in policies.items():
            trained_at[name] = version - (0 if policy_skipped else 1)
            if not policy_skipped:
                self.policy_versions[name] = version
                self._updates.add(self._spawn(self._tell_policy_generators(name, version)))
        for policy, version in trained_at.items():
            part = batch_metrics(
                episodes_of_policy(batch.episodes, policy),
                version,
                loss.normalize_advantage_std,
                loss.step_discount,
                loss.local_advantage_weight,
            )
            label = metric_name(policy)
            metrics[f"{m.POLICY_VERSION}/{label}"] = policy_version if policy is None else self.policy_versions[policy]
            for name in (m.POLICY_AGE_MAX, m.POLICY_AGE_DEPENDENCY_MAX, m.REWARD_MEAN):
                metrics[f"{name}/{label}"] = part[name]
        self.buffer.buffer.set_policy_offsets(
            {name: version - policy_version for name, version in self.policy_versions.items()}
        )
        return metrics

    async def stop_loops(self, finish_updates: bool) -> dict:
        """Stop the loops, and the weight updates (`finish_updates`: once they have finished, so
        that a run that ends leaves every generator at its last version); returns the prompt
        accounting, what was held where at the stop, and the probes' figures."""
        while finish_updates and self._updates:
            await asyncio.gather(*self._updates)
        await self.withhold_batch(sys.maxsize)  # a trainer rank still asking for a batch gets None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._stage_stats_next is not None:
            self._stage_stats_next.cancel()
        self.timeline.close()
        if self.rollouts_log is not None:
            self.rollouts_log.close()
            self.rollouts_log = None
        return {
            "accounting": self.accounting.summary(self.buffer.buffer.dropped.episodes),
            "held_at_stop": {
                "buffered": self.gate.num_episodes_queued,
                "requeued_not_regenerated": len(self.requeued),
                # A rollout cut while buffering has counted its filtered prompts already.
                "cut_in_flight": len(self.cut_at_stop - set(self.accounting.filtered_ids)),
            },
            "calls": dict(self.calls),
            "event_loop_lags_s": list(self.lags_s),
        }

    def state_dict(self, include_episodes: bool) -> dict:
        """What a checkpoint keeps of this plane (`forge_rl.core.checkpoint`). The buffer is read before
        the prompts' cursor, so every prompt in the buffer's snapshot is below that cursor; one
        handed out after the read is above it and is simply handed out again."""
        buffer = self.buffer.buffer.state_dict(include_episodes)
        prompts = self.prompts.state()
        reissue = self.accounting.unsettled_ids(
            prompts["cursor"],
            [*buffer["dropped"]["episode_ids"], *(episode["episode_id"] for episode in buffer["episodes"])],
        )
        reissued = set(reissue)
        return {
            "buffer": buffer,
            "prompts": prompts,
            "accounting": self.accounting.state_dict(),
            "reissue": reissue,
            "num_generated_tokens": self.num_generated_tokens,
            "num_generators": len(self.generators),
            "tokenizer_fingerprint": self.prompts.tokenizer_fingerprint,
            "partial_groups": [
                group.to_dict(episode_id)
                for episode_id, group in {**self.salvaged, **self.in_progress}.items()
                if episode_id in reissued
            ],
        }

    async def load_state_dict(self, state: dict, policy_version: int, policies: dict[str, int] | None = None) -> int:
        """Continue from a checkpoint (`state_dict`'s figures, the prompts to hand out again first
        as state["reissue"]): every generator serves `policy_version` before this returns, and
        before any rollout starts; with config.policies, each one's generators serve its version
        in `policies` (name -> its version). Returns the number of episodes the
        buffer holds now."""
        for name, version in (policies or {}).items():
            self.policy_versions[name] = version
        self.buffer.buffer.set_policy_offsets({name: v - policy_version for name, v in self.policy_versions.items()})
        buffered_versions = await self.buffer.load_state_dict(state["buffer"], policy_version)
        self.prompts.load_state(state["dataset_cursor"], state["reissue"], state.get("data_fingerprint"))
        self.gate.restore(policy_version, buffered_versions)
        self.accounting = PromptAccounting.from_state_dict(
            state["accounting"], handed_out=state["dataset_cursor"] - len(state["reissue"])
        )
        self.accounting.reissued_after_resume += len(state["reissue"])
        self.num_generated_tokens = self._generated_tokens_at_last_step = state["num_generated_tokens"]
        saved_groups = state.get("partial_groups", [])
        try:
            self.salvaged = restored_partial_groups(
                saved_groups,
                state["reissue"],
                self.config.model.hf_config()["vocab_size"],
                state.get("tokenizer_fingerprint"),
                self.prompts.tokenizer_fingerprint,
            )
        except ValueError as e:
            if self.config.checkpoint.partial_groups_on_error == "refuse":
                raise ValueError(
                    f"the checkpoint's partial groups cannot be continued: {e}. Resume with "
                    "--checkpoint.partial-groups-on-error regenerate to generate those prompts from the start, or "
                    "from an earlier checkpoint."
                ) from None
            # checkpoint.partial_groups_on_error regenerate: `open_run_dir_for_resume` warned.
            self.accounting.salvage_discarded_tokens += saved_partial_tokens(saved_groups)
            self.salvaged = {}
        if self.salvaged and self.config.generator.segment_tokens is None:
            # Resumed without segments: those prompts are generated from the start.
            self.accounting.salvage_discarded_tokens += sum(
                c.num_tokens for group in self.salvaged.values() for c in group.completions
            )
            self.salvaged = {}
        await asyncio.gather(
            *(self._update_generator(i, policy_version) for i in range(self.config.num_generators)),
            *(self._tell_policy_generators(name, version) for name, version in (policies or {}).items()),
        )
        return len(buffered_versions)

    # The pool changing size -------------------------------------------------------------------

    async def add_generator(self) -> dict:
        """One more generator (the pool starts it: `GeneratorPool.add_generator`), with its
        rollout loops; returns what the pool reported of it."""
        self.calls["generators.add_generator"] += 1
        added = await self.actors.generators.add_generator.call_one()
        index = added["index"]
        # Indices the pool gave to generators whose start failed get entries too, never used.
        while len(self.gate.generator_versions) <= index:
            self.gate.add_generator(added["policy_version"])
            self.env_waits.add_generator()
        self.generators.append(index)
        self._spawn_rollout_loops(index)
        return added

    async def remove_generator(self, index: int, grace_s: float) -> dict:
        """Take generator `index` out of the run: its rollout loops take no more admissions, the
        groups it decodes get up to `grace_s` to finish (a preemption notice's grace), then the
        pool removes it and what is still in flight on it is continued elsewhere (with
        generator.segment_tokens, from the tokens held) or handed out again. Returns how many
        groups finished within the grace and how many were cut."""
        if index not in self.generators:
            raise ValueError(f"generator {index} is not in the pool (it has {self.generators})")
        if len(self.generators) == 1:
            raise ValueError(f"generator {index} is the pool's last: a run needs one. Add one before removing it.")
        self.generators.remove(index)
        self._leaving.setdefault(index, asyncio.Event()).set()
        loops = set(self._loops.get(index, ()))
        _, cut = await asyncio.wait(loops, timeout=grace_s) if loops else (set(), set())
        self.calls["generators.remove_generator"] += 1
        await self.actors.generators.remove_generator.call_one(index)
        if cut:  # their calls fail at once now: they re-queue their prompts and end
            await asyncio.wait(cut)
        return {"index": index, "loops_drained": len(loops) - len(cut), "loops_cut": len(cut)}

    def _spawn_rollout_loops(self, index: int) -> None:
        loops = self._loops.setdefault(index, set())
        for _ in range(self.config.prompts_in_flight_per_generator):
            task = self._spawn(self._rollout_loop(index))
            loops.add(task)
            task.add_done_callback(loops.discard)

    async def _admission(self, index: int) -> int | None:
        """The gate's admission on generator `index` (its start version), or None once the
        generator is leaving the pool."""
        leaving = self._leaving.setdefault(index, asyncio.Event())
        if leaving.is_set():
            return None
        admit = asyncio.ensure_future(self.gate.admit(index))
        left = asyncio.ensure_future(leaving.wait())
        try:
            await asyncio.wait([admit, left], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the run ended: no admission may stay taken
            if admit.done() and not admit.cancelled() and admit.exception() is None:
                await self.gate.settle(admit.result(), 1, num_not_queued=1)
            admit.cancel()
            raise
        finally:
            left.cancel()
        if admit.done():
            return admit.result()
        admit.cancel()  # an admission granted meanwhile goes back (`AdmissionGate.admit`)
        await asyncio.gather(admit, return_exceptions=True)
        return None

    # Rollouts ---------------------------------------------------------------------------------

    async def _rollout_loop(self, index: int) -> None:
        """One prompt at a time on generator `index`; many of these run per generator, until it
        leaves the pool."""
        while True:
            start_version = await self._admission(index)
            if start_version is None:
                return
            try:
                prompts = [self.requeued.popleft()] if self.requeued else self._next_prompts()
            except BaseException:
                await self.gate.settle(start_version, 1, num_not_queued=1)  # the admission goes back
                raise
            prompts = [dataclasses.replace(p, admitted_version=start_version) for p in prompts]
            try:
                num_buffered = await self._rollout(index, prompts)
            except GeneratorLost:
                await self._requeue_after_loss(index, prompts, start_version)
                continue
            except BaseException as e:
                if isinstance(e, asyncio.CancelledError):  # the run ended (nothing else cancels a rollout)
                    self.cut_at_stop.update(prompt.episode_id for prompt in prompts)
                await self.gate.settle(start_version, len(prompts), num_not_queued=len(prompts))
                raise
            await self.gate.settle(start_version, len(prompts), num_not_queued=len(prompts) - num_buffered)

    async def _rollout(self, index: int, prompts: list[Episode]) -> int:
        """Generate, score and buffer `prompts` on generator `index`; returns how many reached the buffer."""
        config, actors = self.config, self.actors
        if self.make_env is not None:
            episodes = [await self._play(index, prompt) for prompt in prompts]
        elif config.generator.segment_tokens is not None:
            episodes = [await self._generate_in_segments(index, prompt) for prompt in prompts]
        else:
            with self.timeline.busy(f"generator{index}", num_sequences=config.group_size):
                try:
                    self.calls["generators.generate"] += 1
                    episodes = await actors.generators.generate.call_one(index, prompts, config.group_size)
                except Exception as e:
                    lost = generator_lost(e)
                    if lost is None:
                        raise
                    raise lost from None
            if self.brancher is not None:  # the generator's busy interval above has ended: these are its own
                episodes = [await self.brancher.grow(e, functools.partial(self._branches, index)) for e in episodes]
        self.num_generated_tokens += sum(e.num_generated_tokens for e in episodes)
        self.calls["score"] += 1
        kept = await actors.score(episodes, self.timeline)
        kept_ids = {e.episode_id for e in kept}
        self.accounting.count_filtered([e for e in episodes if e.episode_id not in kept_ids])
        num_stale = await self.buffer.put(kept) if kept else 0
        return len(kept) - num_stale

    async def _branches(
        self, index: int, group: Episode, heads: list[list[int]], n: int
    ) -> list[tuple[list[Completion], int]]:
        """`n` continuations of each head of `group` from generator `index` (`Brancher.grow`)."""
        with self.timeline.busy(f"generator{index}", num_sequences=len(heads) * n):
            try:
                self.calls["generators.generate_branches"] += 1
                return await self.actors.generators.generate_branches.call_one(
                    index, group.prompt_token_ids, group.forced_length, heads, n
                )
            except Exception as e:
                lost = generator_lost(e)
                if lost is None:
                    raise
                raise lost from None

    async def _generate_in_segments(self, index: int, prompt: Episode) -> Episode:
        """`prompt`'s group generated on generator `index` a segment at a time
        (`GeneratorConfig.segment_tokens`), from what an earlier generator sampled of it before it
        died, or a checkpoint held of it, when that is still trainable (`_salvage`). Each
        segment's pieces join their completions here, so should this generator die too, they are
        what the next one continues."""
        config = self.config
        group = self._salvage(prompt)
        if group is not None:  # a checkpoint taken before its next segment keeps it
            self.in_progress[prompt.episode_id] = group
        try:
            while group is None or not all(group.finished):
                group = await self._next_segment(index, prompt, group)
        finally:
            self.in_progress.pop(prompt.episode_id, None)
        return dataclasses.replace(
            prompt, completions=group.completions, generator_index=index, temperature=config.generator.temperature
        )

    async def _next_segment(self, index: int, prompt: Episode, group: PartialGroup | None) -> PartialGroup:
        """`group` (None: not begun) one segment further on generator `index`."""
        config = self.config
        todo = [] if group is None else [i for i, done in enumerate(group.finished) if not done]
        heads = None if group is None else [group.completions[i].token_ids for i in todo]
        with self.timeline.busy(f"generator{index}", num_sequences=len(todo) or config.group_size):
            try:
                self.calls["generators.generate_segment"] += 1
                pieces = await self.actors.generators.generate_segment.call_one(
                    index,
                    prompt.prompt_token_ids,
                    prompt.forced_length,
                    heads,
                    config.group_size,
                    config.generator.segment_tokens,
                )
            except Exception as e:
                lost = generator_lost(e)
                if lost is None:
                    raise
                if group is not None:
                    self.salvaged[prompt.episode_id] = group
                raise lost from None
        if group is None:
            group = PartialGroup([piece for piece, _ in pieces], [done for _, done in pieces])
        else:
            for i, (piece, done) in zip(todo, pieces):
                group.completions[i] = join_pieces(group.completions[i], piece)
                group.finished[i] = done
        self.in_progress[prompt.episode_id] = group
        return group

    def _salvage(self, prompt: Episode) -> PartialGroup | None:
        """What generators that died sampled of `prompt`'s group, or the checkpoint a resume began
        from held of it, to continue from, or None (start afresh). A completion with a token the
        trainer can no longer take (older than max_policy_age behind the version the next batch
        trains at, as every later one does or after) is restarted from nothing with drop_policy
        drop_episode, whose buffer would drop the whole group for that token; with mask_tokens it
        is continued, and the buffer masks the token."""
        group = self.salvaged.pop(prompt.episode_id, None)
        if group is None:
            return None
        oldest_trainable = self.buffer.trainer_version - self.config.buffer.max_policy_age
        limit = self.config.generator.max_new_tokens
        budget = min(prompt.forced_length or limit, limit)
        for i, completion in enumerate(group.completions):
            # A resume with a lower generator.max_new_tokens: a head already at the budget is done.
            group.finished[i] = group.finished[i] or completion.num_tokens >= budget
            too_old = min(exact_versions(completion), default=oldest_trainable) < oldest_trainable
            if too_old and self.config.buffer.drop_policy == "drop_episode":
                self.accounting.salvage_discarded_tokens += completion.num_tokens
                group.completions[i], group.finished[i] = Completion([], [], []), False
            else:
                self.accounting.salvaged_tokens += completion.num_tokens
        if all(completion.num_tokens == 0 for completion in group.completions):
            return None
        if group.after_resume:
            self.accounting.continued_after_resume += 1
        else:
            self.accounting.continued_after_generator_failure += 1
        return group

    async def _play(self, index: int, prompt: Episode) -> Episode:
        """`prompt` as group_size episodes of the environment played on generator `index` (each made
        with the prompt's data row, when it has one): one completion per agent of each episode (one
        for a single-agent environment), its reward the environment's (`forge_rl.envs.rollout`);
        with branch rollouts, the episodes' forks too (`Brancher.fork`)."""
        config = self.config
        renderer = self.actors.renderer
        assert renderer is not None and config.environment.name is not None  # both come with make_env (__init__)
        generate = self._turns_on(index)
        envs = self._envs(index, prompt, config.group_size)
        if self.brancher is not None:  # checked at config time too, where the factory takes no data row
            refuse_unless_replayable(envs[0], config.environment.name)
        seat_generate = {
            seat: self._policy_turns_on(policy.name, index) for policy in config.policies for seat in policy.seats
        }
        graphs = await play_group(envs, generate, renderer, config.environment.limits, seat_generate)
        for graph in graphs:
            self.episode_stats.observe(graph)
        first = next(iter(graphs[0].agents.values()))
        first_observation = first.conversation[0].content if first.conversation else ""
        episode = dataclasses.replace(
            prompt,
            prompt_text=first_observation,
            answer="",
            prompt_token_ids=[],  # each trajectory holds its prompt as context
            completions=self._with_policies(group_completions(graphs)),
            generator_index=index,
            temperature=config.generator.temperature,
        )
        if self.brancher is None:
            return episode

        async def forks(parent: Completion, pivot: int, n: int) -> list[Completion]:
            envs = self._envs(index, prompt, n)
            played = await play_forks(envs, generate, parent, pivot, renderer, config.environment.limits)
            return group_completions(played)

        return await self.brancher.fork(episode, forks)

    def _with_policies(self, completions: list[Completion]) -> list[Completion]:
        """Each completion named by the policy that played its agent's seat (config.policies)."""
        if self.config.policies:
            for completion in completions:
                completion.policy = self.policies.of_agent(completion.agent)
        return completions

    def _policy_turns_on(self, policy: str, index: int) -> GenerateTurn:
        """`generate` for the turns of a seat `policy` (one of config.policies) plays, in a rollout
        on the run's generator `index`: on that policy's generator index mod its pool's size. A
        generator lost mid-turn is waited for until its pool's replacement serves, and only that
        turn is sampled again (the episodes so far live here)."""
        pool = self.actors.policy_generators[policy]
        on = index % next(p.num_generators for p in self.config.policies if p.name == policy)

        async def generate(prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
            while True:
                with self.timeline.busy(f"{policy}/generator{on}", num_sequences=1):
                    self.calls[f"{policy}/generators.generate_turn"] += 1
                    turn = await _turn_unless_lost(pool, on, prefix_token_ids, max_new_tokens)
                if turn is not None:
                    return turn
                self.accounting.turns_moved_after_generator_failure += 1
                await pool.wait_until_serving.call_one(on)

        return generate

    def _envs(self, index: int, prompt: Episode, count: int) -> list[TimedEnvironment]:
        """`count` fresh environments of `prompt`'s episode, timed as generator `index`'s."""
        assert self.make_env is not None  # environment episodes are played only with environment.name set (_rollout)
        return [
            TimedEnvironment(
                self.make_env(self.config.task.seed, prompt.episode_id, **self._row(prompt)), self.env_waits, index
            )
            for _ in range(count)
        ]

    @staticmethod
    def _row(prompt: Episode) -> dict:
        """A prompt from a data file hands its row to the environment (EnvironmentConfig.make_env)."""
        return {} if prompt.columns is None else {"row": prompt.columns}

    def _turns_on(self, index: int) -> GenerateTurn:
        """`generate` for a group's turns: on generator `index` until it is lost mid-turn. The
        episodes so far (tokens, environments) live here, so only that turn is sampled again, on
        the next generator that answers (`_turn_elsewhere`)."""
        serving = {"on": index}

        async def generate(prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
            tried: list[int] = []
            while True:
                on = serving["on"]
                with self.timeline.busy(f"generator{on}", num_sequences=1), self.env_waits.turn(on):
                    self.calls["generators.generate_turn"] += 1
                    turn = await _turn_unless_lost(self.actors.generators, on, prefix_token_ids, max_new_tokens)
                if turn is not None:
                    return turn
                tried.append(on)
                serving["on"] = await self._turn_elsewhere(index, tried)
                self.accounting.turns_moved_after_generator_failure += 1

        return generate

    async def _turn_elsewhere(self, index: int, tried: list[int]) -> int:
        """Where an environment episode's turn goes after its generator was lost mid-turn (the
        generators in `tried`, in order): the next generator of the pool not tried yet, after
        the last one tried; once every one was, the replacement of the rollout's own generator
        `index`, waited for. Each lost generator is marked serving again in the gate once its
        replacement serves (`_serves_again`). GeneratorLost if `index` left the pool and every
        other generator was tried."""
        lost = tried[-1]
        self._spawn(self._serves_again(lost))
        # A generator leaving the pool is out of `self.generators` already.
        untried = [i for i in self.generators if i not in tried]
        if untried:
            after = [i for i in untried if i > lost]
            return (after or untried)[0]
        if index not in self.generators:
            raise GeneratorLost(index, "it left the pool, and every other generator was lost mid-turn")
        tried.clear()
        if await self._wait_until_serving(index) is not None:
            return index
        if not self.generators:
            raise GeneratorLost(index, "it left the pool, and no other generator is left")
        return self.generators[0]  # it left the pool (given up): the others are tried again

    async def _serves_again(self, index: int) -> None:
        """Once lost generator `index`'s replacement serves, the gate admits on it at the version
        it loaded (a rollout loop that re-queued after the loss does this itself)."""
        loaded_version = await self._wait_until_serving(index)
        if loaded_version is not None:
            await self.gate.generator_serves(index, loaded_version)

    def _next_prompts(self) -> list[Episode]:
        prompts = self.prompts.next_episodes(1)
        self.accounting.handed_out += len(prompts)
        return prompts

    async def _requeue_after_loss(self, index: int, prompts: list[Episode], start_version: int) -> None:
        """The generator died mid-request: its prompts go out again once it (replaced) serves."""
        self.requeued.extend(prompts)
        self.accounting.requeued += len(prompts)
        await self.gate.settle(start_version, len(prompts), num_not_queued=len(prompts))
        leaving = self._leaving.setdefault(index, asyncio.Event())
        if leaving.is_set():
            return  # removed from the pool, not dead: nothing to wait for
        loaded_version = await self._wait_until_serving(index)
        if loaded_version is not None:
            await self.gate.generator_serves(index, loaded_version)

    async def _wait_until_serving(self, index: int) -> int | None:
        """The version lost generator `index` serves again with, once its replacement does; None
        if it left the pool meanwhile, or could not be replaced while others serve (it leaves
        the pool: the run goes on without it). GeneratorFailed if it was the pool's last."""
        self.calls["generators.wait_until_serving"] += 1
        try:
            return await self.actors.generators.wait_until_serving.call_one(index)
        except Exception as e:
            leaving = self._leaving.setdefault(index, asyncio.Event())
            if leaving.is_set():
                return None  # removed, or given up by another waiter, while its replacement started
            failed = raised_by_actor(e)
            if not isinstance(failed, GeneratorFailed) or len(self.generators) == 1:
                raise
            self.generators.remove(index)
            leaving.set()
            progress(f"{failed}; the run goes on with generators {self.generators}")
            return None

    # Weights ----------------------------------------------------------------------------------

    async def _tell_generators(self, policy_version: int) -> None:
        """Start every generator's update to `policy_version`, UPDATES_PER_TURN per event-loop turn:
        128 update calls sent in one turn held the loop (the rollouts' replies, the train loop's
        next `next_batch`) for tens of milliseconds."""
        for position, index in enumerate(list(self.generators)):
            if position and position % UPDATES_PER_TURN == 0:
                await asyncio.sleep(0)  # the rest of the loop's work runs between
            self._updates.add(self._spawn(self._update_generator(index, policy_version)))

    async def _tell_policy_generators(self, policy: str, policy_version: int) -> None:
        """Every generator of one of config.policies serves its `policy_version` (updated while
        decoding, as the run's own); a generator lost meanwhile loads the newest itself."""
        pool = self.actors.policy_generators[policy]
        size = next(p.num_generators for p in self.config.policies if p.name == policy)

        async def update(index: int) -> None:
            with self.timeline.busy(f"{policy}/weights{index}"):
                try:
                    self.calls[f"{policy}/generators.update_weights"] += 1
                    await pool.update_weights.call_one(index, policy_version)
                except Exception as e:
                    if generator_lost(e) is None:
                        raise

        await asyncio.gather(*(update(index) for index in range(size)))

    async def _update_generator(self, index: int, policy_version: int) -> None:
        """Tell generator `index` that `policy_version` is servable (it knows its weight store); it
        swaps while decoding."""
        self.gate.generator_updating(index, policy_version)
        with self.timeline.busy(f"weights{index}"):
            try:
                self.calls["generators.update_weights"] += 1
                result = await self.actors.generators.update_weights.call_one(index, policy_version)
            except Exception as e:
                if generator_lost(e) is None:
                    raise
                await self.gate.generator_update_abandoned(index)
                return  # its replacement loads the newest version itself
        await self.gate.generator_serves(index, result["policy_version"])
        self.last_weight_update = {k: v for k, v in result.items() if k.startswith("weights/")}
        self.weights_fetched_bytes += result.get(FETCHED_BYTES, 0)

    # Figures ----------------------------------------------------------------------------------

    async def _step_metrics(self) -> dict:
        """Generation since the previous step, idle fractions since the loops started, the buffer's
        and the scoring stage's counters, the newest weight update's figures."""
        timeline, now = self.timeline, self.timeline.now()
        generator_busy_s = [timeline.busy_s(f"generator{i}") for i in self.generators]
        generated_tokens_per_s = (self.num_generated_tokens - self._generated_tokens_at_last_step) / max(
            now - self._last_step_end_s, 1e-9
        )
        self._generated_tokens_at_last_step, self._last_step_end_s = self.num_generated_tokens, now
        await self._refresh_stage_stats()
        return {
            m.GENERATED_TOKENS_TOTAL: self.num_generated_tokens,
            m.GENERATED_TOKENS_PER_S: generated_tokens_per_s,
            m.GENERATORS_IDLE_FRACTION: idle_fraction(generator_busy_s, now),
            **self._episode_metrics(now),
            **(self.brancher.counts.metrics() if self.brancher is not None else {}),
            **self.buffer.stats(),
            **self._stage_stats,
            **self.last_weight_update,
            m.WEIGHTS_FETCHED_BYTES_TOTAL: self.weights_fetched_bytes,
            m.GENERATOR_POLICY_VERSIONS: [self.gate.generator_versions[i] for i in self.generators],
            m.NUM_GENERATORS: len(self.generators),
            ROLLOUT_CALLS_TOTAL: sum(self.calls.values()),
            **self.prompts.stats(),
        }

    async def _refresh_stage_stats(self) -> None:
        """Take the stage's counters read since the last step, and read them again in the
        background (a few calls per step, whatever the number of generators). The first step
        waits for its read: nothing was read before it."""
        if self._stage_stats_next is None:
            self._stage_stats_next = self._read_stage_stats()
            await asyncio.wait([self._stage_stats_next])
        if self._stage_stats_next.done():
            self._stage_stats = self._stage_stats_next.result()  # a failed read fails the step
            self._stage_stats_next = self._read_stage_stats()

    def _read_stage_stats(self) -> asyncio.Future:
        self.calls["stats"] += 1
        return asyncio.ensure_future(self.actors.stats())

    def _episode_metrics(self, now: float) -> dict:
        """Environment episodes played since the previous step, and the generators' idle time
        waiting on environments since the loops started (none without an environment)."""
        if self.make_env is None:
            return {}
        figures, self.episode_stats = self.episode_stats.figures(), EpisodeStats()
        waiting_s = sum(self.env_waits.idle_waiting_s(i) for i in self.generators)
        figures[m.GENERATORS_IDLE_ON_ENV_FRACTION] = waiting_s / max(now * len(self.generators), 1e-9)
        return figures

    # Tasks ------------------------------------------------------------------------------------

    def _spawn(self, coroutine) -> asyncio.Task:
        """Run `coroutine` in the background; its error (a cancellation aside) fails the run."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._updates.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is None:
            return
        if self._failure is not None and not self._failure.done():
            self._failure.set_exception(error)


async def _turn_unless_lost(
    pool: Any, index: int, prefix_token_ids: list[int], max_new_tokens: int
) -> SampledTurn | None:
    """`pool`'s generator `index` samples a turn after `prefix_token_ids`; None if it was lost
    mid-turn (GeneratorLost), ContextExhausted raised as itself."""
    try:
        return await pool.generate_turn.call_one(index, prefix_token_ids, max_new_tokens)
    except Exception as e:
        raised = raised_by_actor(e)
        if isinstance(raised, ContextExhausted):
            raise raised from None
        if not isinstance(raised, GeneratorLost):
            raise
        return None


async def _shared(table: dict, key: Any, start: Callable[[], Awaitable], takers: int) -> Any:
    """What `start()` returns, started by the first of `takers` callers with `key` and shared with
    the others; its entry in `table` goes once every one of them has it."""
    if key not in table:
        table[key] = [asyncio.ensure_future(start()), takers]
    shared = table[key]
    try:
        return await asyncio.shield(shared[0])
    finally:
        shared[1] -= 1
        if not shared[1]:
            del table[key]


def rollout_record(step: int, train_version: int, episode: Episode) -> dict:
    """One trained episode as RUN_DIR/rollouts.jsonl holds it (log.rollouts)."""
    return {
        "step": step,
        "train_version": train_version,
        "episode_id": episode.episode_id,
        "generator": episode.generator_index,
        "prompt_text": episode.prompt_text,
        "prompt_token_ids": episode.prompt_token_ids,
        "completions": [
            {
                "text": c.text,
                "reward": c.reward,
                "status": c.status.value,
                "token_ids": c.token_ids,
                "logprobs": c.logprobs,
                "policy_versions": c.policy_versions,
                "trained_tokens": sum(c.loss_mask),
                **({} if c.agent is None else {"agent": c.agent}),
                **({} if c.policy is None else {"policy": c.policy}),
            }
            for c in episode.completions
        ],
    }
