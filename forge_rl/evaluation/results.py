"""What one evaluation of one policy version on one eval set found: plain Python, no Monarch.

`version_of` proves a result version-pure: every sampled token, and the context every token
attended to, came from the one version under evaluation, or it raises `MixedVersions` naming what
it found. `summarize` turns the scored samples of each prompt into the set's figures (pass@k by the
unbiased estimator, mean reward, mean tokens) and one readable record per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forge_rl.evaluation.pass_at_k import mean_pass_at_k, pass_at_k
from forge_rl.types import Completion, CompletionStatus, Episode


class MixedVersions(RuntimeError):
    """An evaluation's samples came from more than the version it evaluates: no result is kept."""


def version_of(episodes: Sequence[Episode], version: int) -> int:
    """`version` if every token of every completion was sampled by it over a context it encoded
    (`Completion.policy_versions`, `kv_versions`); else MixedVersions."""
    found: set[int] = set()
    for episode in episodes:
        for completion in episode.completions:
            found.update(completion.policy_versions)
            found.update(completion.kv_versions or ())
    if found - {version}:
        raise MixedVersions(
            f"an evaluation of policy version {version} sampled tokens with versions {sorted(found)}: its generator "
            "swapped weights under it; its results are discarded"
        )
    return version


@dataclass(frozen=True)
class SetResult:
    """One eval set at one version: the figures (`metrics`) and a record per prompt (`prompts`)."""

    metrics: dict[str, float]
    """eval/<set>/{pass@k..., mean_reward, mean_tokens, num_prompts, num_errored, version}."""
    prompts: list[dict]
    """Per prompt: row number, prompt, answer, and each sample's text, reward, tokens and ending."""


def summarize(
    set_name: str,
    version: int,
    episodes: Sequence[Episode],
    row_numbers: Sequence[int],
    k_values: Sequence[int],
    pass_threshold: float,
) -> SetResult:
    """The figures of scored `episodes` (one per prompt, its completions the samples, each with
    its reward or ERRORED). An errored sample (its reward function raised or hung) counts as not
    passed and is left out of the mean reward; it is counted in num_errored."""
    if not episodes:
        raise ValueError(f"eval set {set_name!r}: no prompts to summarize")
    num_samples, num_passed, rewards, tokens, prompts = [], [], [], [], []
    num_errored = 0
    for episode, row_number in zip(episodes, row_numbers, strict=True):
        samples = []
        passed = 0
        for completion in episode.completions:
            errored = completion.status == CompletionStatus.ERRORED
            num_errored += errored
            if not errored:
                rewards.append(completion.reward)
                passed += completion.reward >= pass_threshold
            tokens.append(completion.num_tokens)
            samples.append(_sample_record(completion, errored))
        num_samples.append(len(episode.completions))
        num_passed.append(passed)
        prompts.append(
            {
                "row": row_number,
                "prompt": episode.prompt_text,
                "answer": episode.answer,
                "num_passed": passed,
                **{f"pass@{k}": pass_at_k(len(episode.completions), passed, k) for k in k_values},
                "samples": samples,
            }
        )
    prefix = f"eval/{set_name}/"
    metrics = {
        **{f"{prefix}pass@{k}": mean_pass_at_k(num_samples, num_passed, k) for k in k_values},
        f"{prefix}mean_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
        f"{prefix}mean_tokens": sum(tokens) / len(tokens),
        f"{prefix}num_prompts": len(episodes),
        f"{prefix}num_errored": num_errored,
        f"{prefix}version": version,
    }
    return SetResult(metrics, prompts)


def _sample_record(completion: Completion, errored: bool) -> dict:
    return {
        "text": completion.text,
        "reward": None if errored else completion.reward,
        "num_tokens": completion.num_tokens,
        "status": completion.status.value,
        **({"error": completion.error} if errored else {}),
    }
