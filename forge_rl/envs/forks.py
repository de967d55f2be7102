"""Episode forks: an environment episode continued from one of its turns, on a fresh instance of
its environment brought back to that turn by replay (branch rollouts, docs/branches.md).

A fork at turn k of an episode makes the environment anew (`make_env(seed, index)`), and plays
it with a `generate` that hands back the episode's first k turns exactly as they were sampled
(ids, logprobs, versions), then samples from there. The runner renders the same observations
between them, so the fork's token sequence up to turn k is the episode's, and the generator's
prefix cache serves it while the weights that encoded it serve. That is exact only for an
environment whose reset and step depend on nothing but (seed, index) and the turns it is given:
one says so with a class attribute `replayable = True`; any other is refused. A replay that
sees another prefix than the episode's (the environment answered differently) raises
`ReplayDiverged` before anything is sampled, and that fork is dropped (counted).
"""

from __future__ import annotations

from forge_rl.core.branches import ReplayDiverged, turn_starts
from forge_rl.envs.graph import EpisodeGraph, is_multi_agent
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.rollout import check_step_timeout, gather_or_cancel, is_agent_environment, play_graph
from forge_rl.envs.runner import EpisodeLimits, GenerateTurn, SampledTurn
from forge_rl.errors import ConfigError
from forge_rl.types import Completion


def refuse_unless_replayable(env: object, name: str) -> None:
    """ConfigError naming the fix unless episodes of `env` (environment.name `name`) can be forked:
    a plain reset/step environment that declares `replayable = True`."""
    inner = getattr(env, "env", env)  # the rollouts' timing wrapper holds the environment itself
    if is_agent_environment(inner) or is_multi_agent(inner):
        kind = "plays its own episodes (play)" if is_agent_environment(inner) else "has several agents (seats)"
        raise ConfigError(
            f"branch.rule with environment.name ({name!r}): {type(inner).__name__} {kind}, and an episode fork "
            "replays a reset/step environment's turns. Set --branch.rule none."
        )
    if getattr(inner, "replayable", False) is not True:
        raise ConfigError(
            f"branch.rule with environment.name ({name!r}): {type(inner).__name__} cannot restore its state, and a "
            "fork replays the episode's turns up to the pivot on a fresh instance, which is exact only for an "
            "environment whose reset and step depend on nothing but (seed, index) and the turns. If that holds, "
            "declare it with a class attribute `replayable = True`; otherwise set --branch.rule none."
        )


def replayed_turns(parent: Completion, pivot: int) -> list[tuple[int, SampledTurn]]:
    """The turns of `parent` before turn start `pivot`, each with where it starts, as the
    generator returned them."""
    starts = turn_starts(parent)
    generated = parent.generated or [True] * parent.num_tokens
    turns = []
    for start, end in zip(starts, starts[1:] + [parent.num_tokens]):
        if start >= pivot:
            break
        stop = next((t for t in range(start, end) if not generated[t]), end)
        support = None if parent.sampling_support is None else parent.sampling_support[start:stop]
        turns.append(
            (
                start,
                SampledTurn(
                    parent.token_ids[start:stop],
                    parent.logprobs[start:stop],
                    parent.policy_versions[start:stop],
                    "stop",
                    sampling_support=support if support and any(support) else None,
                ),
            )
        )
    return turns


def replaying(generate: GenerateTurn, parent: Completion, pivot: int) -> GenerateTurn:
    """`generate` for one fork of `parent` at `pivot`: the turns before it replayed, then sampled."""
    turns = replayed_turns(parent, pivot)
    played = 0
    past_pivot = False

    async def replay(prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        nonlocal played, past_pivot
        if past_pivot:  # the fork's own turns
            return await generate(prefix_token_ids, max_new_tokens)
        expected = parent.token_ids[: turns[played][0] if played < len(turns) else pivot]
        if prefix_token_ids != expected:
            differs = next(
                (t for t, (a, b) in enumerate(zip(prefix_token_ids, expected)) if a != b),
                min(len(prefix_token_ids), len(expected)),
            )
            raise ReplayDiverged(
                f"turn {played + 1} of the replay follows {len(prefix_token_ids)} tokens that are not the episode's "
                f"{len(expected)} (the first difference at token {differs})"
            )
        if played < len(turns):
            turn = turns[played][1]
            played += 1
            if len(turn.token_ids) > max_new_tokens:
                raise ReplayDiverged(
                    f"turn {played} of the replay has {len(turn.token_ids)} tokens, over its budget ({max_new_tokens})"
                )
            return turn
        past_pivot = True
        return await generate(prefix_token_ids, max_new_tokens)

    return replay


async def play_forks(
    envs: list, generate: GenerateTurn, parent: Completion, pivot: int, renderer: Renderer, limits: EpisodeLimits
) -> list[EpisodeGraph]:
    """One fork of `parent` at `pivot` per fresh environment in `envs`, played concurrently; their
    episode graphs. ReplayDiverged when a replay does (the others are cancelled); whatever
    `generate` raises (a lost generator) propagates, as from `play_group`."""
    for env in envs:
        check_step_timeout(env, limits)
    return await gather_or_cancel(
        [play_graph(env, replaying(generate, parent, pivot), renderer, limits) for env in envs]
    )
