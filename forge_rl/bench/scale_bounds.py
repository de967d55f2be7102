"""The analytic bounds `forge-rl bench scale`'s async-vs-sync part holds its runs to (the module
docstring of `forge_rl.bench.scale` derives them): what a step's generation, its stragglers and one
batch size allow at best."""

from __future__ import annotations

import math
import random

from forge_rl.config import GRPOConfig


def steady_trained_tokens_per_step(metrics: list[dict], warmup_steps: int) -> float:
    """Mean tokens that reached the loss per step (`num_tokens`: masked tokens excluded), over the
    steps after the first `warmup_steps`, as the steady-state step times."""
    steady = metrics[warmup_steps:] or metrics
    return sum(m["num_tokens"] for m in steady) / len(steady)


def _decode_step_s(config: GRPOConfig, batch: int, mean_completion: float) -> float:
    """Wall seconds of one simulated decode step of `batch` sequences, each holding a prompt and
    half a completion of mean length `mean_completion` (its mean context over its life)."""
    sim = config.generator.sim
    return sim.latency.step_s(batch, int(batch * (8 + mean_completion / 2))) * sim.time_scale


def generation_s(config: GRPOConfig, tokens_per_step: float) -> float:
    """Wall seconds the engines need for one step's tokens at the batch the asynchronous run keeps
    (every rollout loop's group in flight): tokens / (G x B / step_s(B, B x c)), with B sequences
    per engine and c the mean context of a sequence (prompt + half a completion)."""
    batch = min(config.prompts_in_flight_per_generator * config.group_size, config.generator.max_num_seqs)
    return _batch_timing(config, tokens_per_step, batch)[1]


def _batch_timing(config: GRPOConfig, tokens_per_step: float, batch: int) -> tuple[float, float]:
    """At `batch` sequences per engine: (its decode step step_s(B), the engines' time Gen(B) for a
    step's `tokens_per_step`)."""
    mean_completion = tokens_per_step / (config.prompts_per_step * config.group_size)
    step_s = _decode_step_s(config, batch, mean_completion)
    return step_s, tokens_per_step / (config.num_generators * batch) * step_s


def expected_longest_completion(config: GRPOConfig, num_steps: int = 1) -> float:
    """Expected longest of `num_steps` steps' P x group_size simulated completion lengths each (n in
    all; log-normal, median m, sigma s, cut at generator.max_new_tokens L): E[max] = integral over
    0..L of 1 - F(x)^n dx, F the log-normal's distribution function."""
    sim, cut = config.generator.sim, config.generator.max_new_tokens
    n = num_steps * config.prompts_per_step * config.group_size

    def below(x: float) -> float:
        if x <= 0:
            return 0.0
        if sim.length_sigma == 0:
            return float(x >= sim.length_median_tokens)
        return 0.5 * (1 + math.erf(math.log(x / sim.length_median_tokens) / (sim.length_sigma * math.sqrt(2))))

    points = 4096
    width = cut / points
    return sum((1 - below((k + 0.5) * width) ** n) * width for k in range(points))


def uniform_batch_floor(
    config: GRPOConfig, tokens_per_step: float, train_s: float, max_policy_age: int, longest: float
) -> tuple[float, int]:
    """The asynchronous step's floor when every engine decodes batches of one size B, whichever B
    is best (docs/benchmarks/README.md): min over B of max(T, Gen(B), Lmax x step_s(B) / (A + 1)). A larger
    batch generates a step's tokens sooner (Gen falls) but decodes each sequence's tokens slower,
    the step's longest completion (`longest` = Lmax tokens, `expected_longest_completion`, which
    must be trained within A + 1 versions of its admission) among them. Returns (floor, B)."""
    floors = [
        (max(train_s, generate, longest * step_s / (max_policy_age + 1)), batch)
        for batch, step_s, generate in _uniform_batches(config, tokens_per_step)
    ]
    return min(floors)


def _uniform_batches(config: GRPOConfig, tokens_per_step: float):
    """For each batch size B an engine may keep: (B, step_s(B), Gen(B)), as `_batch_timing`."""
    for batch in range(1, config.generator.max_num_seqs + 1):
        yield batch, *_batch_timing(config, tokens_per_step, batch)


def waiting_straggler_floor(config: GRPOConfig, max_policy_age: int) -> tuple[float, float]:
    """A floor on the asynchronous step of any run that trains every admitted group whole within
    A + 1 versions of its admission and waits for its stragglers, however it schedules: the
    longest of A + 1 steps' completions (Lwin tokens, `expected_longest_completion`) decodes no
    faster than alone on its engine (batch 1, the latency model's fastest step), from its first
    token to its last, and the A + 1 steps it may span must last that long:
    Lwin x step_s(1) / (A + 1). Even a scheduler that knew every length in advance meets it; one
    that does not decodes the straggler among others, slower. Returns (floor, Lwin)."""
    longest = expected_longest_completion(config, num_steps=max_policy_age + 1)
    return longest * _decode_step_s(config, 1, longest) / (max_policy_age + 1), longest


def whole_group_masking_ceiling(
    config: GRPOConfig, tokens_per_step: float, train_s: float, max_policy_age: int, groups: int = 20_000, seed: int = 0
) -> dict:
    """What partial rollouts (over-age tokens masked) can reach in tokens that reached the loss,
    when a group trains only once its last completion ends (GRPO's baseline needs all of it) and
    every engine decodes batches of one size B: a token may be at most A versions old when trained,
    so of a group whose last completion ends late, the tokens of every member generated more than
    (A + 1) x step before that end are masked, the short members' included. For each B, the step
    is max(T, Gen(B)), a sequence gains a token per decode step step_s(B), and the masked fraction
    is measured on `groups` groups of the simulated lengths (`SimEngineConfig.draw_length`, seeded);
    the ceiling is the best B's (trained tokens per second over the bound's, at most 1 per step).
    A scheduler that decoded the long completions on emptier engines could mask less; one that
    trains no group whole is not GRPO. Returns the ceiling, its B, its masked fraction, and the
    masked fraction by each completion's own length alone (what the group's wait adds is the rest)."""
    import numpy as np

    sim, cut, size = config.generator.sim, config.generator.max_new_tokens, config.group_size
    rng = random.Random(seed)
    lengths = np.array([[sim.draw_length(rng, cut) for _ in range(size)] for _ in range(groups)], dtype=float)
    group_end = lengths.max(axis=1, keepdims=True)
    total = lengths.sum()
    best = None
    for batch, token_s, generate in _uniform_batches(config, tokens_per_step):
        step_s = max(train_s, generate)
        window = (max_policy_age + 1) * step_s / token_s  # tokens a sequence gains while A + 1 steps pass
        masked = np.minimum(lengths, np.maximum(group_end - window, 0.0)).sum() / total
        ceiling = train_s / step_s * (1.0 - masked)
        if best is None or ceiling > best[0]:
            own = np.minimum(lengths, np.maximum(lengths - window, 0.0)).sum() / total
            best = (ceiling, batch, masked, own)
    assert best is not None  # generator.max_num_seqs >= 1: at least one batch size
    ceiling, batch, masked, own = best
    return {
        "ceiling": float(ceiling),
        "batch": batch,
        "masked_fraction": float(masked),
        "masked_by_own_length_fraction": float(own),
    }
