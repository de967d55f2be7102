"""Demonstrations: well-formed episodes of an environment, for the supervised warm-up on its turn
format (`forge_rl.training.warmup`). Functional core: no Monarch, no vLLM, no torch.

An environment that can show a well-formed episode implements `demonstration()`: the model turns
of one (for the calculator, ["C37*52", "1924"]). `demonstration_samples` plays those turns through
the same runner, trajectory builder and renderer as RL episodes (`forge_rl.envs.runner`), with a
scripted `generate` in place of the engine, so the warm-up trains exactly the token layout RL later
samples and trains: prompt and observations are context (never in the loss), turns and their eos
are generated.

What the demonstrations teach is the environment's choice. The calculator's teach the call and
the answer's form on too few examples, and too few steps, for the model to copy the tool's result
reliably: the warm-up alone leaves the reward low and RL is what raises it (docs/environments.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from forge_rl.envs.environment import Environment, Message
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.runner import EpisodeLimits, SampledTurn, run_episode
from forge_rl.envs.trajectory import TrajectorySample, TrajectoryStatus


@runtime_checkable
class Demonstrable(Protocol):
    def demonstration(self) -> list[str]:
        """The model turns of one well-formed episode of this environment, in order."""
        ...


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up of a from-scratch model on demonstrations of the environment, before RL."""

    episodes: int = 0
    """Demonstration episodes (environment instances `make_env(seed, i)`, i < episodes). 0: no warm-up."""
    steps: int = 40
    """Optimizer steps of cross-entropy on the demonstrations' generated tokens."""
    batch_size: int = 32
    """Demonstrations per step, taken in order and wrapping around."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    seed: int = 1_000_003
    """Seed of the demonstrations' environments; differs from task.seed, so RL's problems are not
    the warm-up's."""

    def __post_init__(self) -> None:
        for name, least in (("episodes", 0), ("steps", 1), ("batch_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(
                    f"environment.warmup.{name} ({getattr(self, name)}) must be >= {least}. "
                    f"Set --environment.warmup.{name.replace('_', '-')}."
                )
        if not self.lr > 0:
            raise ValueError(f"environment.warmup.lr ({self.lr}) must be > 0. Set --environment.warmup.lr.")


async def demonstration_sample(
    env: Environment, renderer: PlainTextRenderer, limits: EpisodeLimits
) -> TrajectorySample:
    """The one sample of `env`'s demonstration, played within `limits`. ValueError when the
    environment cannot demonstrate, or its demonstration does not end DONE with reward 1: the
    warm-up would teach a format that fails."""
    if not isinstance(env, Demonstrable):
        raise ValueError(
            f"{type(env).__name__} has no demonstration() method, so there is nothing to warm up on. Implement "
            "demonstration() (forge_rl/envs/demonstrations.py), or set --environment.warmup.episodes 0."
        )
    turns = iter(env.demonstration())
    bos_length = len(renderer.render([]))

    async def scripted_generate(prefix: list[int], max_new_tokens: int) -> SampledTurn:
        # The plain renderer writes an assistant turn as its text then eos, whatever came before.
        token_ids = renderer.render([Message("assistant", next(turns))])[bos_length:]
        if len(token_ids) > max_new_tokens:
            raise ValueError(
                f"a demonstration turn of {type(env).__name__} has {len(token_ids)} tokens, over the "
                f"{max_new_tokens} the limits leave; raise --environment.limits.max-tokens-per-turn."
            )
        return SampledTurn(token_ids, [0.0] * len(token_ids), [0] * len(token_ids), "stop")

    trajectory = await run_episode(env, scripted_generate, renderer, limits)
    if trajectory.status != TrajectoryStatus.DONE or trajectory.final_reward != 1.0 or trajectory.num_forks:
        raise ValueError(
            f"the demonstration of {env!r} ended {trajectory.status.value} with reward {trajectory.final_reward} "
            f"({trajectory.error}); a demonstration must end DONE with reward 1.0 in one sample. Fix its "
            "demonstration() or the environment.limits it must fit in."
        )
    return trajectory.samples[0]


async def demonstration_samples(
    make_env, seed: int, count: int, renderer: PlainTextRenderer, limits: EpisodeLimits
) -> list[TrajectorySample]:
    """Samples of the demonstrations of `make_env(seed, i)` for i < count."""
    return [await demonstration_sample(make_env(seed, index), renderer, limits) for index in range(count)]
