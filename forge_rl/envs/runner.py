"""Plays one episode: reset, then generate a turn, step the environment, and so on, within the
episode's limits; returns the Trajectory.

The runner knows no engine: `generate` is any coroutine that, given the token prefix and a token
budget, samples the next turn. On the real engine it is `VLLMEngine.generate_turn`
(forge_rl/engines/vllm_engine.py) with the tokenizer's eos bound; tests of the core pass a named
fake (tests/fakes.py). Each turn continues the same token sequence (vLLM's prefix cache serves
the earlier turns' whole KV blocks), and every token keeps the policy version that decoded it, so
an episode may span weight updates.

What ends an episode (TrajectoryStatus):
    reset raises, or runs past env_step_timeout_s          ENV_ERROR, ENV_TIMEOUT
    the prompt leaves no room for a turn                   TRUNCATED_TOKENS
  then, turn after turn:
    max_turns turns were taken                             TRUNCATED_TURNS
    generate raises ContextExhausted (the engine's own     TRUNCATED_TOKENS
      context is full, whatever max_total_tokens allows)
    the turn used the last of max_total_tokens             TRUNCATED_TOKENS (the environment never sees it)
    step raises, or runs past env_step_timeout_s           ENV_ERROR, ENV_TIMEOUT
    step raises MalformedTurn once more than allowed       PARSE_ERROR (until then: its observation is shown)
    step says done                                         DONE, with its final reward
    the observation cannot be rendered                     ENV_ERROR
    the observation leaves no room for a turn              TRUNCATED_TOKENS

Nothing an environment does crashes the caller: an exception or a hang in reset or step (or an
observation that cannot be rendered) ends that episode ERRORED with the reason. Two kinds of
exception do propagate: the fatal ones of forge_rl/errors.py (ConfigError, SandboxUnavailable: the
machine or config cannot run any episode, so the run must stop and say why), and whatever
`generate` raises (a lost generator is the rollout shell's to handle: it hands the episode out
again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from forge_rl.envs.environment import Environment, MalformedTurn, Observation, StepResult
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.trajectory import GeneratedSpan, Trajectory, TrajectoryBuilder, TrajectoryStatus
from forge_rl.errors import ConfigError
from forge_rl.routing import RoutingRecord

T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeLimits:
    """What bounds one episode. The two token limits follow the model and the generator unless set:
    a run resolves them against its config (`resolved`) before anything plays."""

    max_turns: int = 8
    """Model turns per episode; an episode the environment has not closed by then is TRUNCATED_TURNS."""
    max_total_tokens: int | None = None
    """Longest token sequence of a sample (prompt, turns and observations): the context budget. At
    most the model's context length; unset: all of it (max_model_len, 128 for the tiny models)."""
    max_tokens_per_turn: int | None = None
    """Tokens one turn may sample (the engine's max_tokens for that request). Unset:
    generator.max_new_tokens, the bound of a single-turn completion."""
    max_malformed_turns: int = 1
    """Malformed turns (MalformedTurn) answered with an error observation; one more ends the
    episode as PARSE_ERROR. 0: the first one ends it."""
    env_step_timeout_s: float = 30.0
    """Seconds one reset or step may take; past it the episode is ENV_TIMEOUT."""

    @property
    def is_resolved(self) -> bool:
        return self.max_total_tokens is not None and self.max_tokens_per_turn is not None

    def resolved(self, max_model_len: int, max_new_tokens: int) -> EpisodeLimits:
        """These limits with the unset token limits derived: max_total_tokens the model's context
        `max_model_len`, max_tokens_per_turn `max_new_tokens` (generator.max_new_tokens), within it."""
        return dataclasses.replace(
            self,
            max_total_tokens=max_model_len if self.max_total_tokens is None else self.max_total_tokens,
            max_tokens_per_turn=(
                min(max_new_tokens, self.max_total_tokens or max_model_len)
                if self.max_tokens_per_turn is None else self.max_tokens_per_turn
            ),
        )

    @property
    def max_generated_tokens(self) -> int:
        """Most tokens a trajectory can generate: max_turns turns of max_tokens_per_turn, within
        its max_total_tokens budget (which its context shares)."""
        self.require_resolved()
        return min(self.max_turns * self.max_tokens_per_turn, self.max_total_tokens)

    def require_resolved(self) -> None:
        """ValueError unless both token limits are known (set, or `resolved` against the model)."""
        if not self.is_resolved:
            raise ValueError(
                f"EpisodeLimits(max_total_tokens={self.max_total_tokens}, max_tokens_per_turn={self.max_tokens_per_turn}) "
                "has an unset token limit, which follows the model: call limits.resolved(max_model_len, "
                "max_new_tokens) first (a run's GRPOConfig does), or set both."
            )

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_tokens_per_turn"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"environment.limits.{name} ({value}) must be >= 1. Set --environment.limits.{name.replace('_', '-')}"
                    + (", or unset it to follow the model." if name != "max_turns" else ".")
                )
        if self.max_malformed_turns < 0:
            raise ValueError(f"EpisodeLimits.max_malformed_turns ({self.max_malformed_turns}) must be >= 0.")
        if not 0 < self.env_step_timeout_s < math.inf:
            raise ValueError(
                f"EpisodeLimits.env_step_timeout_s ({self.env_step_timeout_s}) must be > 0 and finite: a "
                "hung environment would otherwise hold its episode forever."
            )


@dataclass(frozen=True)
class SampledTurn:
    """What `generate` returns: one turn, as sampled."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: Literal["stop", "length"]
    """"stop": it ended on a stop token (included in token_ids, as sampled); "length": it used its
    whole token budget."""
    sampling_support: list[list[int]] | None = None
    """Per token, the ids top-k/top-p kept when it was sampled (the trainer renormalizes its
    logprobs over them); None when nothing was filtered out or the generator does not record them."""
    routed_experts: RoutingRecord | None = None
    """Mixture-of-experts policies: the experts each token was sampled through, [T, layers, top_k]
    (forge_rl/routing.py); None when not recorded."""
    num_truncated_support: int = 0
    """Tokens whose kept set may be incomplete (`Completion.num_truncated_support`)."""


GenerateTurn = Callable[[list[int], int], Awaitable[SampledTurn]]
"""generate(prefix_token_ids, max_new_tokens) -> the turn sampled after exactly that prefix.
May sample fewer than max_new_tokens ("length") where its own context ends, and raises
ContextExhausted when that context has no room left for one token."""


class ContextExhausted(Exception):
    """Raised by `generate` when the prefix leaves no room in the generator's context (its
    max_model_len) for one more token, before anything is sent to the engine. The runner ends the
    episode TRUNCATED_TOKENS with this message: the model's context is full, as when
    max_total_tokens is, and the episode is trained with the reward it earned (none)."""


async def run_episode(
    env: Environment, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits
) -> Trajectory:
    """Play `env` to its end (or its limits) with turns from `generate`; see the module docstring."""
    limits.require_resolved()
    builder = TrajectoryBuilder(renderer, limits.max_total_tokens)
    record = _Record()

    def end(status: TrajectoryStatus, error: str | None = None, final_reward: float = 0.0) -> Trajectory:
        return Trajectory(
            samples=builder.samples, status=status, final_reward=final_reward, error=error,
            conversation=builder.conversation, turn_rewards=record.turn_rewards, num_turns=record.num_turns,
            num_malformed_turns=record.num_malformed_turns, env_latencies_s=record.env_latencies_s,
        )

    no_room = f"does not leave room for a turn within max_total_tokens ({limits.max_total_tokens})"
    try:
        observation = await _call_env(env.reset(), limits.env_step_timeout_s, record)
        if not _render(builder.start, observation):
            return end(TrajectoryStatus.TRUNCATED_TOKENS, f"the prompt {no_room}")
    except MalformedTurn:
        return end(TrajectoryStatus.ENV_ERROR, "reset raised MalformedTurn, which only step may raise")
    except _EnvFailed as failure:
        return end(failure.status, f"reset: {failure}")
    while True:
        if record.num_turns == limits.max_turns:
            return end(TrajectoryStatus.TRUNCATED_TURNS, f"max_turns ({limits.max_turns}) reached")
        room = limits.max_total_tokens - builder.num_tokens
        max_new_tokens = min(limits.max_tokens_per_turn, room)
        try:
            turn = await generate(builder.prefix, max_new_tokens)
        except ContextExhausted as full:
            return end(TrajectoryStatus.TRUNCATED_TOKENS, f"turn {record.num_turns + 1}: {full}")
        check_turn(turn, max_new_tokens)
        turn_text = builder.add_turn(turn_span(turn))
        record.num_turns += 1
        if turn.finish_reason == "length" and max_new_tokens == room:
            reason = f"turn {record.num_turns} used the last of max_total_tokens ({limits.max_total_tokens})"
            return end(TrajectoryStatus.TRUNCATED_TOKENS, reason)
        try:
            result = await _call_env(env.step(turn_text), limits.env_step_timeout_s, record)
            if not isinstance(result, StepResult):
                raise _EnvFailed(TrajectoryStatus.ENV_ERROR, f"returned {type(result).__name__}, not a StepResult")
        except MalformedTurn as malformed:
            record.num_malformed_turns += 1
            if record.num_malformed_turns > limits.max_malformed_turns:
                reason = f"turn {record.num_turns} malformed: {malformed.observation!r}"
                return end(TrajectoryStatus.PARSE_ERROR, reason)
            result = StepResult(observation=malformed.observation)
        except _EnvFailed as failure:
            return end(failure.status, f"step {record.num_turns}: {failure}")
        record.turn_rewards.append(result.turn_reward)
        if result.done:
            return end(TrajectoryStatus.DONE, final_reward=result.final_reward)
        try:
            if not _render(builder.add_observation, result.observation):
                return end(TrajectoryStatus.TRUNCATED_TOKENS, f"observation {record.num_turns} {no_room}")
        except _EnvFailed as failure:
            return end(failure.status, f"step {record.num_turns}: {failure}")


def _render(add: Callable[[Observation], bool], observation: Observation) -> bool:
    """`add(observation)`; an observation that cannot be rendered (characters the tokenizer cannot
    spell, a role the chat template rejects) is the environment's failure, not the model's."""
    try:
        return add(observation)
    except Exception as e:
        reason = f"its observation cannot be rendered: {type(e).__name__}: {e}"
        raise _EnvFailed(TrajectoryStatus.ENV_ERROR, reason) from e


@dataclass
class _Record:
    num_turns: int = 0
    num_malformed_turns: int = 0
    turn_rewards: list[float | None] = field(default_factory=list)
    env_latencies_s: list[float] = field(default_factory=list)


class _EnvFailed(Exception):
    def __init__(self, status: TrajectoryStatus, reason: str):
        super().__init__(reason)
        self.status = status


async def _call_env(call: Awaitable[T], timeout_s: float, record: _Record) -> T:
    """The environment call's result; _EnvFailed if it raised or ran past `timeout_s`.
    MalformedTurn and fatal errors (ConfigError) pass through."""
    started = time.monotonic()
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:  # the episode itself is being cancelled: take the call with it
        task.cancel()
        raise
    if not task.done():
        # Cancelled, not awaited: an environment that ignores cancellation must not hold its
        # episode. Retrieving its eventual exception keeps asyncio from logging it as lost.
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise _EnvFailed(TrajectoryStatus.ENV_TIMEOUT, f"no answer within env_step_timeout_s ({timeout_s} s)")
    if task.cancelled():
        raise _EnvFailed(TrajectoryStatus.ENV_ERROR, "the environment's call was cancelled from inside")
    error = task.exception()
    if isinstance(error, (MalformedTurn, ConfigError)):
        raise error
    if error is not None:
        raise _EnvFailed(TrajectoryStatus.ENV_ERROR, f"{type(error).__name__}: {error}") from error
    record.env_latencies_s.append(time.monotonic() - started)
    return task.result()


def turn_span(turn: SampledTurn) -> GeneratedSpan:
    """The sampled turn as a trajectory span, its ids, logprobs and versions as `generate` returned them."""
    support = None if turn.sampling_support is None else tuple(tuple(kept) for kept in turn.sampling_support)
    return GeneratedSpan(
        tuple(turn.token_ids), tuple(turn.logprobs), tuple(turn.policy_versions), support, turn.routed_experts,
        turn.num_truncated_support,
    )


def check_turn(turn: SampledTurn, max_new_tokens: int) -> None:
    """A broken `generate` is a bug of the caller's, not an episode outcome: raise."""
    lengths = {len(turn.token_ids), len(turn.logprobs), len(turn.policy_versions)}
    num_supports = "no" if turn.sampling_support is None else len(turn.sampling_support)
    if turn.sampling_support is not None:
        lengths.add(len(turn.sampling_support))
    if len(lengths) > 1 or not 1 <= len(turn.token_ids) <= max_new_tokens:
        raise ValueError(
            f"generate returned {len(turn.token_ids)} token ids, {len(turn.logprobs)} logprobs, "
            f"{len(turn.policy_versions)} policy versions and {num_supports} kept sets for a turn of 1 to "
            f"{max_new_tokens} tokens: they must agree, within the budget it was given."
        )
