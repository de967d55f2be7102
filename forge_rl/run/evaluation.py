"""Evaluation at exact policy versions beside training: the controller's side (docs/evaluation.md).

    step s-1 accounted ──▶ reserve v+1 in the weight store (index rule 3a)    [when step s is due]
    step s   accounted, version v ──▶ queue v; the train loop goes on at once
    the worker (a task of this process): the evaluation's own generators load exactly v ──▶ sample
        every set's prompts ──▶ every token proved v's (`version_of`) ──▶ scored by the run's reward
        functions ──▶ eval/<set>/... to RUN_DIR/eval.jsonl and the dashboards, every prompt's
        samples to RUN_DIR/eval/<set>/version-<v>.jsonl ──▶ v's reservation released

Why the reservation comes a step early: the train loop sends step s+1 to the trainer before it
accounts for step s (one step ahead), so version v+1 can commit, and leave v to be collected,
before this process hears of v. Reserved while step s-1 is accounted for, when step s+1 has not been
sent, v is held from the moment it commits.

With eval.placement own the evaluation's requests go to generators of its own, which no one else
swaps: nothing the training generators do (swaps, aborts) reaches them. With shared they go to the
run's generators, each sampling its share of the prompts in one call pinned to v (its weight
updates wait behind the call; `generate_pinned`), and nothing is reserved: the generators hold v
themselves. Either way nothing here enters the rollouts' buffer, admission or accounting.
Evaluations run one at a time in version order; with eval.max_waiting
waiting, asking for a newer one drops the oldest waiting (counted), so a slow evaluation falls
behind in versions and never holds more than max_waiting + 1 versions in the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_rl.evaluation.config import EvalConfig, EvalSetConfig
from forge_rl.evaluation.results import summarize, version_of
from forge_rl.observability.metrics import progress
from forge_rl.pipeline.prompts import encode_row_prompt, open_file_source
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import build_scorer
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig
    from forge_rl.observability.sinks import MetricsLogger

READER_ID = "evaluation"
"""The evaluation's name as a weight-store reader: its reservations are held under it."""
PROMPTS_PER_CALL = 8
"""Prompts per generate call: each call is one message to a generator, with num_samples each."""
CALLS_PER_GENERATOR = 2
"""Generate calls in flight per evaluation generator: one decodes while the next one's arrive."""


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    row_number: int
    prompt_text: str
    answer: str
    prompt_token_ids: list[int]
    columns: dict[str, Any] | None


@dataclasses.dataclass
class EvalJob:
    step: int
    version: int
    reserved: bool
    """Whether this evaluation holds a reservation of its version (released when it ends)."""


def load_eval_set(
    eval_set: EvalSetConfig, config: GRPOConfig, tokenizer: PromptTokenizer, max_new_tokens: int, field: str
) -> list[EvalPrompt]:
    """The set's first `max_prompts` rows that fit the context with `max_new_tokens`, in the order
    of its data.seed (epoch 0), tokenized as the generators will see them; `field` names the set's
    DataConfig in messages (eval.sets[0].data)."""
    source = open_file_source(
        eval_set.data,
        lambda prompt: encode_row_prompt(config.task, tokenizer, prompt),
        config.max_model_len,
        max_new_tokens,
        field=field,
    )
    prompts = [
        EvalPrompt(
            row.row_number,
            row.prompt_text,
            "" if row.answer is None else row.answer,
            encode_row_prompt(config.task, tokenizer, row.prompt),
            row.columns,
        )
        for row in source.first_rows(eval_set.max_prompts)
    ]
    if source.num_rows > len(prompts) and len(prompts) == eval_set.max_prompts:
        progress(
            f"eval set {eval_set.name!r}: {source.num_rows} rows, of which the first {eval_set.max_prompts} (in the order of "
            f"its data.seed) are evaluated at every version; raise its max_prompts to evaluate more"
        )
    return prompts


class Evaluation:
    """The run's evaluations (module docstring). `generators` is the evaluation's own generator
    pool (`forge_rl.actors.generator_pool`), `store_index` the weight store's index actor.
    `on_sampled(num_prompts)` hears of each generate call's prompts as they come back.

    `forge-rl eval` uses the same object without a store: `load_sets`, then `evaluate_served` on
    generators that already serve the version, then `finish`."""

    def __init__(
        self,
        config: GRPOConfig,
        generators,
        store_index,
        run_path: Path,
        model_dir: Path,
        on_sampled: Callable[[int], None] | None = None,
    ):
        self.config = config
        self.eval: EvalConfig = config.eval
        self.generators = generators
        self.store_index = store_index
        self.on_sampled = on_sampled
        self.run_path = Path(run_path)
        self.tokenizer = PromptTokenizer(model_dir)
        self.max_new_tokens = self.eval.max_new_tokens or config.generator.max_new_tokens
        self.shared = self.eval.placement == "shared"
        """The evaluation samples on the run's generators (`generators` is the run's pool)."""
        self.sets: dict[str, list[EvalPrompt]] = {}
        self.due_steps: set[int] = set()
        self.reserved: set[int] = set()
        """Versions reserved ahead of their step, not yet handed to an evaluation."""
        self.waiting: list[EvalJob | None] = []
        self.results: dict[str, dict] = {}
        """The newest figures of each set (the run's summary holds them)."""
        self.num_evaluated = 0
        self.num_dropped = 0
        self.num_failed = 0
        self._last_queued: int | None = None
        self.metrics_logger: MetricsLogger | None = None
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._scoring = ScoreWriter(
            build_scorer(dataclasses.replace(config.scorer, reward_fn_weight=1.0), config.task.reward_weights)
        )

    @staticmethod
    def generator_config(config: GRPOConfig):
        """The evaluation's engines: the run's generator config, with the evaluation's sampling."""
        return dataclasses.replace(
            config.generator,
            temperature=config.eval.temperature,
            max_new_tokens=config.eval.max_new_tokens or config.generator.max_new_tokens,
        )

    async def start(self, step: int, version: int, metrics_logger: MetricsLogger) -> None:
        """Load the sets; evaluate `version` (the one training starts from) if eval.at_start;
        reserve the next version if the next step is due."""
        self.metrics_logger = metrics_logger
        self.load_sets()
        self.due_steps = set(self.eval.steps(step, self.config.steps))
        self._worker = asyncio.create_task(self._work())
        if self.eval.at_start:
            # A fresh run's version 0 is the model directory's weights, which every engine starts
            # from: it is never in the store. A resumed run's version is (the resume published it).
            in_store = not self.shared and await self.store_index.latest_version.call_one() is not None
            if in_store:
                await self.store_index.reserve.call_one(READER_ID, version)
            await self._queue(EvalJob(step, version, reserved=in_store))
        await self._reserve_if_next_due(step, version)

    def load_sets(self) -> None:
        """Read every eval set's prompts (`load_eval_set`) and make RUN_DIR/eval."""
        for i, eval_set in enumerate(self.eval.sets):
            self.sets[eval_set.name] = load_eval_set(
                eval_set, self.config, self.tokenizer, self.max_new_tokens, f"eval.sets[{i}].data"
            )
        (self.run_path / "eval").mkdir(parents=True, exist_ok=True)

    async def published(self, step: int, version: int) -> None:
        """Step `step` is accounted for, at policy version `version` (the same as before if the
        step was skipped): queue its evaluation if due, reserve the next version if the next step is."""
        if step in self.due_steps and version != self._last_queued and self.shared:
            # The run's generators serve the version themselves: nothing to hold in the store.
            await self._queue(EvalJob(step, version, reserved=False))
        elif step in self.due_steps and version != self._last_queued:
            if version not in self.reserved:
                # This step was skipped (its loss not finite), so it made no version and the one
                # reserved ahead is not it: the step's version is the newest, which no commit can
                # collect before the next step is sent.
                await self.store_index.reserve.call_one(READER_ID, version)
            self.reserved.discard(version)
            await self._queue(EvalJob(step, version, reserved=True))
        for ahead in list(self.reserved):
            # Reserved for a step that was skipped: the version is made by a later step, if any.
            if not (step + 1 in self.due_steps and ahead == version + 1):
                await self._cancel(ahead)
        await self._reserve_if_next_due(step, version)

    async def finish(self) -> dict[str, dict]:
        """Wait for every evaluation asked for (the end's included); the newest figures of each set."""
        if self._worker is not None:
            await self._queue(None)
            await self._worker
            self._worker = None
        for version in list(self.reserved):
            await self._cancel(version)
        self._scoring.close()
        return self.results

    def counts(self) -> dict[str, int]:
        """Evaluations made, failed (counted, never mixed) and dropped (fallen behind) so far."""
        return {"evaluated": self.num_evaluated, "failed": self.num_failed, "dropped": self.num_dropped}

    async def stop(self) -> None:
        """A stopped run: no evaluation more; what waits is dropped, reservations released."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        for job in self.waiting:
            if job is not None and job.reserved:
                await self._cancel(job.version)
        self.waiting.clear()
        self._scoring.close()

    async def _reserve_if_next_due(self, step: int, version: int) -> None:
        if self.shared:
            return
        if step + 1 in self.due_steps and version + 1 not in self.reserved:
            await self.store_index.reserve.call_one(READER_ID, version + 1)
            self.reserved.add(version + 1)

    async def _cancel(self, version: int) -> None:
        self.reserved.discard(version)
        await self.store_index.cancel_reservation.call_one(READER_ID, version)

    async def _queue(self, job: EvalJob | None) -> None:
        """Queue `job` behind the others (None: the end); with eval.max_waiting waiting, the oldest
        waiting is dropped first."""
        if job is not None:
            self._last_queued = job.version
            while len(self.waiting) >= self.eval.max_waiting:
                dropped = self.waiting.pop(0)
                assert dropped is not None  # the end is queued last (finish)
                self.num_dropped += 1
                progress(
                    f"evaluation of policy version {dropped.version} dropped: evaluations fall behind training "
                    f"({len(self.waiting) + 1} waiting, eval.max_waiting {self.eval.max_waiting}); counted in eval/dropped"
                )
                if dropped.reserved:
                    await self.store_index.cancel_reservation.call_one(READER_ID, dropped.version)
        self.waiting.append(job)
        self._wake.set()

    async def _work(self) -> None:
        """Run the queued evaluations in order until the end. One that fails (a lost generator, a
        sampling error) is reported and counted (eval/failed); the run goes on."""
        while True:
            while not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            job = self.waiting.pop(0)
            if job is None:
                return
            try:
                await self._evaluate(job)
            except Exception as e:
                self.num_failed += 1
                progress(
                    f"evaluation of policy version {job.version} failed, counted in eval/failed: {type(e).__name__}: {e}"
                )
            finally:
                if job.reserved:
                    await self.store_index.cancel_reservation.call_one(READER_ID, job.version)

    async def _evaluate(self, job: EvalJob) -> None:
        started = time.monotonic()
        if self.shared:  # the run's generators: each call waits for the version (`sample`)
            await self.evaluate_served(job.step, job.version, started)
            return
        if job.reserved:  # reserved ahead, so held from its commit: wait for that commit
            await self.store_index.wait_for_version.call_one(job.version)
        await asyncio.gather(
            *(self.generators.update_weights.call_one(i, job.version, True) for i in range(self.eval.num_generators))
        )
        await self.evaluate_served(job.step, job.version, started)

    async def evaluate_served(
        self, step: int, version: int, started: float | None = None, stamped: int | None = None
    ) -> dict[str, Any]:
        """Evaluate every set on the generators, which serve exactly `version` now: sampled, proved
        `version`'s, scored, written (eval.jsonl, eval/<set>/version-<v>.jsonl) and logged. Returns
        the record eval.jsonl got; its eval/seconds count from `started` (default: now).
        `stamped`: the version the generators stamp on its tokens, when it is not `version` (an
        engine started from a checkpoint's export serves it as its own version 0)."""
        started = time.monotonic() if started is None else started
        record: dict[str, Any] = {"step": step, "policy_version": version}
        for name, prompts in self.sets.items():
            episodes = await (self._sample_pinned(prompts, version) if self.shared else self.sample(prompts))
            version_of(episodes, version if stamped is None else stamped)
            await self._scoring.score(episodes)
            result = summarize(
                name, version, episodes, [p.row_number for p in prompts], self.eval.k_values, self.eval.pass_threshold
            )
            self._write_prompts(name, version, result.prompts)
            self.results[name] = result.metrics
            record.update(result.metrics)
        self.num_evaluated += 1
        record.update(
            {
                "eval/seconds": time.monotonic() - started,
                "eval/dropped": self.num_dropped,
                "eval/failed": self.num_failed,
            }
        )
        with open(self.run_path / "eval.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
        if self.metrics_logger is not None:
            self.metrics_logger.log_to_sinks(record)
        figures = ", ".join(
            f"{name} pass@{self.eval.k_values[0]} {self.results[name][f'eval/{name}/pass@{self.eval.k_values[0]}']:.3f}"
            for name in self.sets
        )
        progress(f"eval of policy version {version} (step {step}): {figures} ({record['eval/seconds']:.1f} s)")
        return record

    async def sample(self, prompts: list[EvalPrompt]) -> list[Episode]:
        """Every prompt's num_samples samples, spread over the evaluation's generators, in the
        order of `prompts`."""
        chunks = [prompts[i : i + PROMPTS_PER_CALL] for i in range(0, len(prompts), PROMPTS_PER_CALL)]
        pending: asyncio.Queue[tuple[int, list[EvalPrompt]]] = asyncio.Queue()
        for position, chunk in enumerate(chunks):
            pending.put_nowait((position, chunk))
        sampled: list[list[Episode] | None] = [None] * len(chunks)

        async def feed(generator: int) -> None:
            while not pending.empty():
                position, chunk = pending.get_nowait()
                episodes = [_episode(p) for p in chunk]
                sampled[position] = await self.generators.generate.call_one(generator, episodes, self.eval.num_samples)
                if self.on_sampled is not None:
                    self.on_sampled(len(chunk))

        await asyncio.gather(
            *(feed(generator) for generator in range(self.eval.num_generators) for _ in range(CALLS_PER_GENERATOR))
        )
        return [episode for chunk in sampled if chunk is not None for episode in chunk]  # the calls filled every chunk

    async def _sample_pinned(self, prompts: list[EvalPrompt], version: int) -> list[Episode]:
        """eval.placement shared: every prompt's samples from the run's generators, each taking its
        share of the prompts in one pinned call (`forge_rl.actors.generator.GeneratorActor.generate_pinned`):
        sampled while it serves exactly `version`, its weight updates waiting behind the call, at
        most eval.shared_prompts_in_flight prompts at once beside the run's requests."""
        num_generators = self.config.num_generators
        shares = [prompts[i::num_generators] for i in range(num_generators)]

        async def pinned(generator: int, share: list[EvalPrompt]) -> list[Episode]:
            if not share:
                return []
            sampled = await self.generators.generate_pinned.call_one(
                generator,
                version,
                [_episode(p) for p in share],
                self.eval.num_samples,
                self.eval.temperature,
                self.max_new_tokens,
                self.eval.shared_prompts_in_flight,
            )
            if sampled is None:
                raise VersionGone(
                    f"generator {generator} served a newer version than {version} before the evaluation's call reached "
                    "it (training ran ahead of evaluation); evaluate on generators of its own (eval.placement own) to "
                    "evaluate every version asked for"
                )
            if self.on_sampled is not None:
                self.on_sampled(len(share))
            return sampled

        by_generator = await asyncio.gather(*(pinned(i, share) for i, share in enumerate(shares)))
        episodes: list[Episode | None] = [None] * len(prompts)
        for i, sampled in enumerate(by_generator):  # generator i sampled prompts i, i + n, ...
            episodes[i::num_generators] = sampled
        return [episode for episode in episodes if episode is not None]  # the shares filled every slot

    def _write_prompts(self, name: str, version: int, prompts: list[dict]) -> None:
        directory = self.run_path / "eval" / name
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"version-{version}.jsonl", "w") as file:
            for prompt in prompts:
                file.write(json.dumps(prompt) + "\n")


class VersionGone(RuntimeError):
    """A shared-placement evaluation's version is no longer served by a generator it needed."""


def _episode(prompt: EvalPrompt) -> Episode:
    return Episode(
        episode_id=prompt.row_number,
        prompt_text=prompt.prompt_text,
        answer=prompt.answer,
        prompt_token_ids=prompt.prompt_token_ids,
        columns=prompt.columns,
    )
