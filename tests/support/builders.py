"""Small keyword builders of fabricated inputs for unit tests of the functional core."""

from __future__ import annotations

from forge_rl.types import Completion, CompletionStatus, Episode


def make_completion(
    num_tokens: int = 2,
    policy_version: int | list[int] = 0,
    reward: float = 0.0,
    status: CompletionStatus = CompletionStatus.OK,
    logprob: float = -0.5,
) -> Completion:
    versions = policy_version if isinstance(policy_version, list) else [policy_version] * num_tokens
    return Completion(
        token_ids=[10 + i for i in range(len(versions))],
        logprobs=[logprob] * len(versions),
        policy_versions=versions,
        reward=reward,
        status=status,
    )


def make_episode(
    episode_id: int = 0,
    policy_version: int = 0,
    rewards: tuple[float, ...] = (1.0, 0.0),
    prompt_token_ids: tuple[int, ...] = (1, 5, 6),
    num_tokens: int = 2,
) -> Episode:
    return Episode(
        episode_id=episode_id,
        prompt_text="M56=",
        answer="6",
        prompt_token_ids=list(prompt_token_ids),
        completions=[make_completion(num_tokens, policy_version, r) for r in rewards],
    )


def completion_advantages(batch) -> list[float]:
    """Each row's advantage, for batches whose completions carry no step or token rewards (so every
    generated token of a row has the same advantage, and prompt and padding have 0): the row's
    value of largest magnitude."""
    return [max(row.tolist(), key=abs) for row in batch.advantages_NL]
