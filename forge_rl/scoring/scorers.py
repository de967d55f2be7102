"""The scorer interface: how completions get their rewards, whatever computes them.

A `Scorer` has two async hooks; implement either:
  score_completion(episode, completion)   one completion on its own (a verifier, a reward model,
                                          a process reward model grading its steps); may await models
  score_group(episode)                    the whole group of one prompt at once (a judge that ranks
                                          the group's completions against each other, or a scorer
                                          that batches a group into one round trip); by default it
                                          runs score_completion on every completion concurrently
Each returns, per completion, a `Score` (a reward, its named components, optionally per-step or
per-token rewards) or a `ScoreFailure` (why there is none). `WeightedSum` composes scorers.
`forge_rl.scoring.score_writer.ScoreWriter` runs them on a run's episodes: it writes the scores onto the completions,
turns every failure (a failure returned, an exception raised, a non-finite reward, a malformed
score) into an ERRORED completion with its reason, counts it, and never raises for one.

Implementations: `RewardFunctionScorer` (below: reward functions in the sandboxed worker processes
of `forge_rl.scoring.reward_workers`), `RewardModelScorer` (`forge_rl.scoring.reward_model`: a sequence-classification
model served
by its own actor mesh), `TeacherScorer` (`forge_rl.scoring.teacher`: on-policy distillation, a
frozen teacher's per-token logprobs as dense rewards) and `JudgeScorer` (`forge_rl.scoring.judge`: an LLM
judge on a generator mesh of its own, its verdicts parsed; unparsable ones and timeouts counted). How per-step and per-token rewards become advantages:
`forge_rl.core.advantages.token_advantages`, docs/scoring.md.

No Monarch here: a model-backed scorer holds a client, an async function the actor shell supplies.
"""

from __future__ import annotations

import asyncio
import math
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from forge_rl.errors import ScorerFailed, ScorerLost
from forge_rl.scoring.judge import JudgeConfig, parse_ranking, parse_verdict, render_judge_prompt, render_rank_prompt
from forge_rl.scoring.reward_model import RewardModelConfig, reward_model_input
from forge_rl.scoring.reward_workers import RewardWorkerPool
from forge_rl.scoring.teacher import TeacherConfig, reverse_kl_token_rewards
from forge_rl.tasks.rewards import resolve_reward_fn, reward_columns, reward_name
from forge_rl.types import Completion, Episode, check_steps


@dataclass(frozen=True)
class Score:
    """What a scorer says about one completion."""

    reward: float
    """What trains (through the group advantage)."""
    components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of `reward`, logged as `reward/components/<name>` (for example format and
    correctness); informative only, nothing trains on them."""
    step_ends: tuple[int, ...] | None = None
    """Process rewards: the exclusive end of each step in the completion's token_ids, [S], the
    last = its length (`step_ends` below finds them); with `step_rewards`."""
    step_rewards: tuple[float, ...] | None = None
    """Reward of each step, [S]."""
    token_rewards: tuple[float, ...] | None = None
    """Dense reward of each generated token, [T]."""


@dataclass(frozen=True)
class ScoreFailure:
    """Why a completion has no score; the completion becomes ERRORED (never trained, counted)."""

    error: str
    kind: str
    """Short class of the failure (an exception's type name, "timeout", "worker died",
    "non-finite"): the first of each kind is printed, the rest only counted."""

    @property
    def timed_out(self) -> bool:
        return self.kind == "timeout"


ScoreResult = Score | ScoreFailure


@dataclass(frozen=True)
class ScorerConfig:
    reward_timeout_s: float = 10.0
    """Seconds one completion's reward may take. Past it the completion is ERRORED, and the worker
    process running it is killed and replaced (a hung reward function cannot be interrupted)."""
    num_workers: int = 1
    """Reward worker processes; each scores one episode at a time, so this many episodes are
    scored in parallel."""
    reward_fn_weight: float = 1.0
    """Weight of the task's reward function (task.reward; with task.rewards, a factor on each of
    their weights) in the reward; with an environment, of
    the environment's reward (final and per turn), which takes its place. 0 with a reward model: the
    model's score is what trains, and the verifier still runs, logged as reward/components/reward_fn
    (how to see that the policy learns the task, not the reward model's mistakes). 0 with a
    teacher: distillation alone."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A learned reward model added to the reward (`forge_rl.scoring.reward_model`); off unless its path is set."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation (`forge_rl.scoring.teacher`): a frozen teacher's per-token reverse KL added to
    every token's advantage; off unless its path is set."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge's verdict added to the reward (`forge_rl.scoring.judge`); off unless its path is set."""
    max_restarts: int = 3
    """Times the scorer-side processes (scorer, reward model, judge) are restarted after one dies,
    their in-flight episodes scored again (`forge_rl.scoring.restarts`); one more death stops the
    run (a scorer that keeps dying will not recover). 0: the first death stops the run."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong penalty (`forge_rl.core.advantages.overlong_penalty`): a completion
    ending within the last `overlong_buffer` tokens of generator.max_new_tokens loses reward
    linearly, down to -1 for one that is truncated. Unset: no penalty."""

    def model_threads(self) -> dict[str, int]:
        """The compute threads of the scorer's own models, by the settings that make them: the
        reward model's replicas and the judge's engines. They run beside the scorer, on the
        services host (preflight counts them on this machine, placement on that host)."""
        threads: dict[str, int] = {}
        if self.reward_model.path is not None:
            reward_model = self.reward_model
            threads[
                f"scorer.reward_model.replicas ({reward_model.replicas}) x scorer.reward_model.num_threads ({reward_model.num_threads})"
            ] = reward_model.replicas * reward_model.num_threads
        if self.judge.path is not None:
            judge = self.judge
            assert isinstance(judge.generator.cpu_threads, int)  # GRPOConfig refuses "auto" for the judge
            threads[
                f"scorer.judge.replicas ({judge.replicas}) x scorer.judge.generator.cpu_threads ({judge.generator.cpu_threads})"
            ] = judge.replicas * judge.generator.cpu_threads
        return threads

    def __post_init__(self) -> None:
        if not 0 < self.reward_timeout_s < math.inf:
            raise ValueError(
                f"scorer.reward_timeout_s ({self.reward_timeout_s}) must be > 0 and finite. "
                "Set --scorer.reward-timeout-s."
            )
        if self.num_workers < 1:
            raise ValueError(f"scorer.num_workers ({self.num_workers}) must be >= 1. Set --scorer.num-workers.")
        if self.max_restarts < 0:
            raise ValueError(f"scorer.max_restarts ({self.max_restarts}) must be >= 0. Set --scorer.max-restarts.")
        if not math.isfinite(self.reward_fn_weight):
            raise ValueError(
                f"scorer.reward_fn_weight ({self.reward_fn_weight}) must be finite. Set --scorer.reward-fn-weight."
            )
        if (
            self.reward_fn_weight == 0
            and self.reward_model.path is None
            and self.judge.path is None
            and not self.teacher.enabled
        ):
            raise ValueError(
                "scorer.reward_fn_weight (0) with no scorer.reward_model.path, scorer.teacher.path nor "
                "scorer.judge.path leaves every reward 0: nothing would train. Set one of --scorer.reward-model.path, "
                "--scorer.teacher.path, --scorer.judge.path, or --scorer.reward-fn-weight above 0."
            )
        if self.overlong_buffer is not None and self.overlong_buffer < 1:
            # 0 would penalize only completions longer than generator.max_new_tokens, and the
            # engine stops every completion at that length: a penalty that never applies.
            raise ValueError(
                f"scorer.overlong_buffer ({self.overlong_buffer}) must be >= 1: with 0 the penalty applies "
                "only past generator.max_new_tokens, a length the engine never produces, so it would do "
                "nothing. Set --scorer.overlong-buffer 1 or more (1 penalizes truncated completions only), "
                "or leave it unset for no penalty."
            )


class Scorer:
    """Base class of scorers; see the module docstring. `name` keys its metrics and components."""

    name: str = "scorer"

    async def score_completion(self, episode: Episode, completion: Completion) -> ScoreResult:
        raise NotImplementedError(f"{type(self).__name__} implements neither score_completion nor score_group")

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        """One result per completion of `episode`, in order; by default score_completion on each,
        concurrently, where one that raises fails its own completion only."""
        results = await asyncio.gather(
            *(self.score_completion(episode, c) for c in episode.completions), return_exceptions=True
        )
        for result in results:
            if isinstance(result, (ScorerLost, ScorerFailed)):
                raise result
        return [_failure_of(r) if isinstance(r, BaseException) else r for r in results]

    def stats(self) -> dict[str, float]:
        """Counters of this scorer's own (worker restarts, batches...), reported as `scorer/<key>`."""
        return {}

    def close(self) -> None:
        """Release processes or connections; called once when the run stops."""


async def guarded_group(scorer: Scorer, episode: Episode) -> list[ScoreResult]:
    """`scorer.score_group(episode)`, with anything that goes wrong made a failure of each completion:
    an exception, a wrong number of results, a non-finite reward, steps that do not tile the tokens.
    Messages do not name the scorer (`WeightedSum` prefixes its parts' names). ScorerLost (a model's
    process died) is raised instead: it is no completion's failure (`forge_rl.scoring.restarts`);
    so is ScorerFailed (a model that kept dying past its restart budget: the run stops)."""
    try:
        results = await scorer.score_group(episode)
    except (ScorerLost, ScorerFailed):  # a model's process died: no completion is to blame
        raise
    except Exception as e:  # a scorer bug or a model's error costs this group, not the run
        return [_failure_of(e)] * len(episode.completions)
    if len(results) != len(episode.completions):
        failure = ScoreFailure(
            f"malformed score: {len(results)} results for {len(episode.completions)} completions", "malformed"
        )
        return [failure] * len(episode.completions)
    return [_checked(result, c) for result, c in zip(results, episode.completions)]


def _failure_of(error: BaseException) -> ScoreFailure:
    return ScoreFailure("".join(traceback.format_exception_only(error)).strip(), type(error).__name__)


def _checked(result: ScoreResult, completion: Completion) -> ScoreResult:
    if isinstance(result, ScoreFailure):
        return result
    values = [result.reward, *result.components.values(), *(result.step_rewards or ()), *(result.token_rewards or ())]
    if not all(math.isfinite(v) for v in values):
        return ScoreFailure(
            f"non-finite reward ({result.reward}, or in its parts): a reward must be finite", "non-finite"
        )
    try:
        check_steps(
            None if result.step_ends is None else list(result.step_ends),
            None if result.step_rewards is None else list(result.step_rewards),
            completion.num_tokens,
        )
        if result.token_rewards is not None and len(result.token_rewards) != completion.num_tokens:
            raise ValueError(f"{len(result.token_rewards)} token_rewards for {completion.num_tokens} tokens")
    except ValueError as e:
        return ScoreFailure(f"malformed score: {e}", "malformed")
    return result


class WeightedSum(Scorer):
    """reward = sum_i weight_i * reward_i over its scorers, run concurrently on each group.

    Components: each scorer's reward under its name, and its own components as "<name>/<component>".
    Step rewards: those of the one scorer that gives them, weighted (several must agree on the step
    boundaries, else the completion fails with the reason). Token rewards: the weighted sum. A
    completion any scorer fails is a failure (a partial sum is not the configured reward), counted
    in that scorer's `<name>/errored`."""

    name = "weighted_sum"

    def __init__(self, parts: Iterable[tuple[Scorer, float]]):
        self.parts = list(parts)
        names = [scorer.name for scorer, _ in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"scorer names must be unique (they key metrics): {names}")
        self.num_errored = {name: 0 for name in names}

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        per_part = await asyncio.gather(*(guarded_group(scorer, episode) for scorer, _ in self.parts))
        return [self._combine(list(results), c) for results, c in zip(zip(*per_part), episode.completions)]

    def _combine(self, results: list[ScoreResult], completion: Completion) -> ScoreResult:
        failures = [(scorer.name, r) for (scorer, _), r in zip(self.parts, results) if isinstance(r, ScoreFailure)]
        for name, _ in failures:
            self.num_errored[name] += 1
        if failures:
            name, first = failures[0]
            return ScoreFailure(f"{name}: {first.error}", first.kind)
        scores = cast("list[Score]", results)  # none is a ScoreFailure: those returned above
        weighted = [(scorer.name, weight, r) for (scorer, weight), r in zip(self.parts, scores)]
        components: dict[str, float] = {}
        for name, _, score in weighted:
            components[name] = score.reward
            components.update({f"{name}/{key}": value for key, value in score.components.items()})
        stepped = [(w, s) for _, w, s in weighted if s.step_ends is not None]
        if len({s.step_ends for _, s in stepped}) > 1:
            return ScoreFailure(
                f"scorers {[n for n, _, s in weighted if s.step_ends is not None]} split the completion into "
                "different steps; per-step rewards add only over the same steps",
                "malformed",
            )
        dense = [(w, s.token_rewards) for _, w, s in weighted if s.token_rewards is not None]
        return Score(
            reward=sum(w * s.reward for _, w, s in weighted),
            components=components,
            step_ends=stepped[0][1].step_ends if stepped else None,
            # _checked lets step_ends through only with their step_rewards.
            step_rewards=tuple(map(sum, zip(*([w * r for r in s.step_rewards or ()] for w, s in stepped))))
            if stepped
            else None,
            token_rewards=tuple(map(sum, zip(*([w * r for r in t] for w, t in dense)))) if dense else None,
        )

    def stats(self) -> dict[str, float]:
        counters: dict[str, float] = {}
        for scorer, _ in self.parts:
            counters[f"{scorer.name}/errored"] = self.num_errored[scorer.name]
            counters.update({f"{scorer.name}/{key}": value for key, value in scorer.stats().items()})
        return counters

    def close(self) -> None:
        for scorer, _ in self.parts:
            scorer.close()


class RewardFunctionScorer(Scorer):
    """The reward function `reward` (a registered name or "module:function", see
    `forge_rl.tasks.rewards`) on each completion's text, its row's answer and the row's columns the
    function names (`RewardColumns`), in `config.num_workers` worker processes: a group per round
    trip; a raise, a hang past `config.reward_timeout_s` or a dead worker fails that completion only.
    `name` keys its component in a weighted sum."""

    def __init__(self, reward: str, config: ScorerConfig, name: str = "reward_fn"):
        self.name = name
        self.columns = reward_columns(resolve_reward_fn(reward), reward)
        self.pool = RewardWorkerPool(reward, config)

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        columns = self.columns.select(episode.columns)
        results = await self.pool.score([(c.text, episode.answer, columns) for c in episode.completions])
        # The pool gives each result its reward, or its error with the error's kind.
        return [
            Score(cast(float, r.reward)) if r.error is None else ScoreFailure(r.error, cast(str, r.error_kind))
            for r in results
        ]

    def stats(self) -> dict[str, float]:
        return {"worker_restarts": self.pool.num_worker_restarts}

    def close(self) -> None:
        self.pool.close()


class EnvironmentRewardScorer(Scorer):
    """An environment's episodes as the environment rewarded them (`forge_rl.envs.rollout.trajectory_completion`):
    each trajectory's final reward and per-turn rewards (as steps),
    returned as they are. In a weighted sum it takes the task's reward function's place, so a
    teacher's per-token rewards are added to the environment's, which scorer.reward_fn_weight
    weights."""

    name = "environment"

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        return [
            Score(
                c.reward,
                step_ends=None if c.step_ends is None else tuple(c.step_ends),
                step_rewards=None if c.step_rewards is None else tuple(c.step_rewards),
            )
            for c in episode.completions
        ]


class RewardModelScorer(Scorer):
    """Scores each completion with `client(texts) -> scores` (the reward model actor's `score`
    endpoint), one request per group; the reward is the model's scalar."""

    name = "reward_model"

    def __init__(self, client: Callable[[list[str]], Awaitable[list[float]]]):
        self.client = client

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        texts = [reward_model_input(episode.prompt_text, c.text) for c in episode.completions]
        return [Score(float(value)) for value in await self.client(texts)]


class TeacherScorer(Scorer):
    """On-policy distillation (`forge_rl.scoring.teacher`): `client(episodes)` returns the teacher's logprob
    of every completion token ([episode][completion][token], the frozen-model actor's
    `token_logprobs`), one request per group. Each token's reward is the negative reverse KL on the
    sampled token, teacher logprob - student (behaviour) logprob, raw: the group baseline
    (scorer.teacher.baseline group) is taken by `ScoreWriter` once every scorer's dense rewards are
    added up and the usable completions are known. The completion's reward is 0 (the teacher has no
    opinion on the outcome). Component `reverse_kl`: its mean over the completion's tokens, the
    distance to the teacher that distillation drives down."""

    name = "teacher"

    def __init__(self, client: Callable[[list[Episode]], Awaitable[list[list[list[float]]]]]):
        self.client = client
        self.num_completions = 0
        self.num_tokens = 0

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        (per_completion,) = await self.client([episode])
        negative_kl = [
            reverse_kl_token_rewards(c, logprobs)
            for c, logprobs in zip(episode.completions, per_completion, strict=True)
        ]
        generated = [c.generated_mask for c in episode.completions]
        self.num_completions += len(episode.completions)
        self.num_tokens += sum(map(sum, generated))
        return [
            Score(0.0, components={"reverse_kl": -sum(raw) / max(sum(sampled), 1)}, token_rewards=tuple(raw))
            for raw, sampled in zip(negative_kl, generated)
        ]

    def stats(self) -> dict[str, float]:
        """The completions and the generated tokens the teacher scored."""
        return {"completions": self.num_completions, "tokens": self.num_tokens}


class JudgeScorer(Scorer):
    """An LLM judge (`forge_rl.scoring.judge`), asked through `client(prompt_text) -> verdict_text`. Mode
    grade: about each completion on its own (concurrently: the judge's engine batches them), its
    verdict parsed into a score. Mode rank: about the whole group at once, its verdict parsed into
    an order of the group. A verdict that cannot be parsed, or that comes too late, fails what it
    was about (a completion, or the whole group)."""

    name = "judge"

    def __init__(self, config: JudgeConfig, client: Callable[[str], Awaitable[str]]):
        self.config = config
        self.client = client
        self.num_judged = 0
        self.num_unparsable = 0
        self.num_timed_out = 0

    async def score_group(self, episode: Episode) -> list[ScoreResult]:
        if self.config.mode == "grade":
            return await super().score_group(episode)
        verdict = await self._verdict(render_rank_prompt(self.config.rank_template, episode))
        if isinstance(verdict, ScoreFailure):
            return [verdict] * len(episode.completions)
        rewards = parse_ranking(verdict, self.config.ranking_pattern, len(episode.completions))
        if rewards is None:
            self.num_unparsable += 1
            failure = ScoreFailure(
                f"unparsable ranking {verdict[:200]!r}: no match of scorer.judge.ranking_pattern "
                f"({self.config.ranking_pattern!r}) holding each of the numbers 1..{len(episode.completions)} once",
                "unparsable verdict",
            )
            return [failure] * len(episode.completions)
        return [Score(reward) for reward in rewards]

    async def score_completion(self, episode: Episode, completion: Completion) -> ScoreResult:
        verdict = await self._verdict(render_judge_prompt(self.config.template, episode, completion))
        if isinstance(verdict, ScoreFailure):
            return verdict
        reward = parse_verdict(verdict, self.config.verdict_pattern, self.config.score_min, self.config.score_max)
        if reward is None:
            self.num_unparsable += 1
            return ScoreFailure(
                f"unparsable verdict {verdict[:200]!r}: no match of scorer.judge.verdict_pattern "
                f"({self.config.verdict_pattern!r}) with a score in [{self.config.score_min}, {self.config.score_max}]",
                "unparsable verdict",
            )
        return Score(reward)

    async def _verdict(self, prompt: str) -> str | ScoreFailure:
        try:
            verdict = await asyncio.wait_for(self.client(prompt), self.config.timeout_s)
        except asyncio.TimeoutError:
            self.num_timed_out += 1
            return ScoreFailure(
                f"the judge gave no verdict within scorer.judge.timeout_s ({self.config.timeout_s} s)", "timeout"
            )
        self.num_judged += 1
        return verdict

    def stats(self) -> dict[str, float]:
        """Counted per verdict: one per completion in mode grade, one per group in mode rank."""
        return {"verdicts": self.num_judged, "unparsable": self.num_unparsable, "timed_out": self.num_timed_out}


def build_scorer(
    config: ScorerConfig,
    reward: str | Mapping[str, float] | None,
    reward_model: Callable[[list[str]], Awaitable[list[float]]] | None = None,
    teacher: Callable[[list[Episode]], Awaitable[list[list[list[float]]]]] | None = None,
    judge: Callable[[str], Awaitable[str]] | None = None,
) -> Scorer:
    """The run's scorer: the task's reward function `reward` alone (weight 1: today's run), or the
    weighted sum of the task's reward functions and whichever model scorers run: the reward model
    through its client `reward_model` (config.reward_model.weight), the distillation teacher through
    its client `teacher` (config.teacher.weight, on the per-token reverse KL), an LLM judge through
    its client `judge` (config.judge.weight). `reward`: one spec, or each spec with its weight
    (`TaskConfig.reward_weights`); one function is the part "reward_fn", several are parts under
    their own names (`reward_name`), each weighted by its weight times config.reward_fn_weight.
    `reward` None: the episodes are an environment's, and its rewards take the reward function's
    place (`EnvironmentRewardScorer`)."""
    if reward is None:
        parts: list[tuple[Scorer, float]] = [(EnvironmentRewardScorer(), config.reward_fn_weight)]
    else:
        weights = {reward: 1.0} if isinstance(reward, str) else dict(reward)
        if len(weights) == 1:
            ((spec, weight),) = weights.items()
            parts = [(RewardFunctionScorer(spec, config), config.reward_fn_weight * weight)]
        else:
            parts = [
                (RewardFunctionScorer(spec, config, reward_name(spec)), config.reward_fn_weight * weight)
                for spec, weight in weights.items()
            ]
    if reward_model is not None:
        parts.append((RewardModelScorer(reward_model), config.reward_model.weight))
    if teacher is not None:
        parts.append((TeacherScorer(teacher), config.teacher.weight))
    if judge is not None:
        parts.append((JudgeScorer(config.judge, judge), config.judge.weight))
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][0]
    return WeightedSum(parts)


def step_ends(token_ids: list[int], boundary_ids: set[int]) -> list[int]:
    """Where each step of a completion ends: after every token in `boundary_ids` (the ids whose text
    holds the delimiter: `boundary_token_ids`), and at the end. Steps are found on the sampled ids,
    never by re-tokenizing text, so each step's reward lands on the tokens that were trained.
    A trailing boundary token ends the last step; an empty completion has no steps."""
    ends = [i + 1 for i, token_id in enumerate(token_ids) if token_id in boundary_ids]
    if token_ids and (not ends or ends[-1] != len(token_ids)):
        ends.append(len(token_ids))
    return ends


def boundary_token_ids(token_texts: Mapping[int, str], delimiter: str = "\n") -> set[int]:
    """The ids whose decoded text contains `delimiter` ("\\n": a step per line), from the tokenizer's
    {id: text}. A BPE vocabulary merges delimiters into other tokens (".\\n", "\\n\\n"), so the set
    is read off every token's text, not the delimiter's own encoding."""
    if not delimiter:
        raise ValueError("the step delimiter must be a non-empty string (for one step per line: '\\n')")
    return {token_id for token_id, text in token_texts.items() if delimiter in text}
