"""Run-health checks on the per-step metrics: warnings a person would want before the reward shows it.

`MismatchAlarm` watches each generator's trainer-vs-sampler mismatch KL over its exact tokens: those
whose turn so far was sampled at the trainer's own version, so that its weights computed the token
and every KV it attended to (`mismatch_kl_fresh/generator/<i>`, reported by the trainer;
`forge_rl.core.columns.exact_versions`). There the two logprobs differ only by numerics and the KL
sits at a steady small level (rounding error). A generator that serves other weights than
its version labels say (an update that silently failed to apply, a stale adapter, another request's
weights) samples from another distribution: its KL jumps by orders of magnitude at once. Elsewhere
this is how silently stale weights are caught. The alarm compares each generator's KL with its own
running level and with the other generators' at the same step, and warns with the step, the
generator and the versions its tokens were labelled with.

Other tokens are left out: the trainer no longer holds the weights that sampled them (older
tokens), or they attended to KV of older weights (tokens after a mid-turn swap, swap_kv reuse), so
their KL adds the policy lag, the size of the updates since, which no running level predicts. One
step without a gradient (weights unchanged) leaves it at numerics, the next real update raises it a
thousandfold: on the calculator recipe (max_policy_age 1) the all-token KL spans orders of magnitude,
and an alarm on it warns at many steps of healthy runs (docs/recipes.md, the calculator recipe).

A step may hold no exact token of a generator: single-turn async batches hold almost none (the
demo at max_policy_age 1 holds one at hardly any step; presumably because each batch is taken while the step
before it trains, before the trainer's version is published). Then only the other generators' KL
over all their tokens at the same step compares (the same updates lag them all); a lone generator
goes unchecked that step.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from forge_rl.observability.metric_names import MISMATCH_KL_BY_GENERATOR, MISMATCH_KL_FRESH_BY_GENERATOR
from forge_rl.types import Episode


@dataclasses.dataclass(frozen=True)
class MismatchAlarmConfig:
    factor: float = 10.0
    """Warn when a generator's mismatch KL exceeds this many times its reference level (its own
    running level, or the other generators' median at the same step, whichever is lower). 0 turns
    the alarm off."""
    min_kl: float = 1e-3
    """Never warn below this KL: tiny models at fp32 sit near 1e-10, where any ratio is noise."""
    warmup_steps: int = 3
    """Steps with exact tokens a generator's running level is learned over before its own history
    can raise the alarm."""

    def __post_init__(self) -> None:
        if self.factor < 0 or (0 < self.factor <= 1):
            raise ValueError(
                f"log.mismatch_alarm.factor ({self.factor}) must be > 1, or 0 to turn the alarm off. "
                "Set --log.mismatch-alarm.factor."
            )
        if self.min_kl < 0:
            raise ValueError(
                f"log.mismatch_alarm.min_kl ({self.min_kl}) must be >= 0. Set --log.mismatch-alarm.min-kl."
            )


class MismatchAlarm:
    # A generator's running level = median of its last few steps: one spike (the alarm itself, or
    # a noisy step) cannot raise it enough to hide the next.
    _HISTORY_STEPS = 8

    def __init__(self, config: MismatchAlarmConfig):
        self.config = config
        self._history: dict[int, collections.deque[float]] = {}
        """generator -> fresh mismatch KL of its recent steps that had exact tokens."""

    def observe(self, step: int, metrics: dict, token_versions: Mapping[int, str], train_version: int) -> list[str]:
        """The warnings for this step (empty when all is well); updates the running levels.
        `token_versions`: the versions the batch's tokens are labelled with, by generator
        (`token_versions_by_generator`), for the warning's text."""
        if not self.config.factor:
            return []
        exact = _by_generator(metrics, MISMATCH_KL_FRESH_BY_GENERATOR)
        all_tokens = _by_generator(metrics, MISMATCH_KL_BY_GENERATOR)
        warnings = []
        for generator in sorted(exact.keys() | all_tokens.keys()):
            if generator in exact:
                kl, reference, which = (
                    exact[generator],
                    self._reference_level(generator, exact),
                    "tokens of the trainer's own version",
                )
                self._history.setdefault(generator, collections.deque(maxlen=self._HISTORY_STEPS)).append(kl)
            else:  # no exact token: only the other generators, lagged by the same updates, compare
                others = [value for g, value in all_tokens.items() if g != generator]
                kl, reference, which = (
                    all_tokens[generator],
                    statistics.median(others) if others else None,
                    "all its tokens",
                )
            if reference is not None and kl >= self.config.min_kl and kl > self.config.factor * reference:
                warnings.append(
                    f"step {step}: generator {generator}'s sampler mismatch KL {kl:.3g} on {which} is "
                    f"{kl / max(reference, 1e-30):.3g}x its reference level {reference:.3g}; its tokens are labelled "
                    f"with policy versions {token_versions.get(generator, 'none')} (trained at {train_version}). Its "
                    "weights may not be what their version says (an update that did not apply?)."
                )
        return warnings

    def _reference_level(self, generator: int, exact: dict[int, float]) -> float | None:
        """The lower of its own running level (after warm-up) and the others' median this step."""
        levels = []
        history = self._history.get(generator, ())
        if len(history) >= self.config.warmup_steps:
            levels.append(statistics.median(history))
        others = [kl for g, kl in exact.items() if g != generator]
        if others:
            levels.append(statistics.median(others))
        return min(levels) if levels else None


def _by_generator(metrics: dict, prefix: str) -> dict[int, float]:
    """{generator: value} of the metrics named `<prefix>/<generator>`."""
    return {int(name.rsplit("/", 1)[1]): value for name, value in metrics.items() if name.startswith(prefix + "/")}


TOKEN_VERSIONS_BY_GENERATOR = "_token_versions_by_generator"
"""The key under which the rollouts' `step_done` reply carries `token_versions_by_generator` of the
step's batch (the train loop takes it out before logging)."""


def token_versions_by_generator(episodes: Sequence[Episode]) -> dict[int, str]:
    """Generator -> the policy versions its tokens in `episodes` are labelled with ("3", "2..4")."""
    versions: dict[int, list[int]] = collections.defaultdict(list)
    for episode in episodes:
        if episode.generator_index is None:  # made outside the generator pool: no generator to label
            continue
        for completion in episode.completions:
            versions[episode.generator_index] += completion.policy_versions
    return {
        generator: str(min(v)) if min(v) == max(v) else f"{min(v)}..{max(v)}"
        for generator, v in sorted(versions.items())
        if v
    }
