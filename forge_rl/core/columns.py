"""A step's batch in columns: its episodes flattened, row by row, into the flat arrays that the
trainer's padded tensors are made of (`forge_rl.core.batching.make_train_batch`). Plain Python, no
torch: the rollouts' process builds them as the batch leaves the buffer.

Why columns, and why there. A batch sent as episodes (about a hundred dataclass objects for the
CPU demo) would have the trainer turn them into tensors itself, a Python walk over every token, on
its critical path: between the batch leaving the buffer and the step's compute. A few
`array.array`s cross a process as a few byte buffers, are unpickled in microseconds and become
tensors with `torch.frombuffer`, so the trainer's share of turning episodes into a batch is the
padding alone; the walk runs in the rollouts' process, where it costs the trainer nothing.
Figures: docs/benchmarks/README.md ("The demo and the test suite").

Row i is the prompt and completion i of its episode, rows one after another: the per-token
columns hold sum(lengths) values each, the per-row columns N.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from forge_rl.core.advantages import episode_advantages, is_plain, token_advantages
from forge_rl.types import Completion, Episode


@dataclass
class BatchColumns:
    """The rows of one trainer step, flat. `make_train_batch` pads them into a TrainBatch."""

    lengths: array
    """"q" [N]: tokens of each row, prompt and completion."""
    token_ids: array
    """"q" [sum(lengths)]."""
    loss_mask: array
    """"B" [sum(lengths)]: 1 where the token reaches the loss (`Completion.loss_mask`; 0 on the prompt)."""
    behaviour_logprobs: array
    """"f" [sum(lengths)]: the logprob each generated token was sampled with (0 on the prompt)."""
    advantages: array
    """"f" [sum(lengths)]: each token's advantage (`token_advantages`; 0 on the prompt)."""
    exact_versions: array
    """"q" [sum(lengths)]: `exact_versions` (-1 on the prompt and other context)."""
    temperatures: array
    """"f" [N]: the temperature each row was sampled at."""
    generators: array
    """"q" [N]: the generator that sampled each row (-1: unknown)."""
    reference_logprobs: array | None = None
    """"f" [sum(lengths)]: the reference model's logprobs (0 on the prompt); None when no row has them."""
    supports: list[list[list[int]] | None] | None = None
    """Per row, the kept ids at each of its positions ([] on the prompt), or None for a row sampled
    without filtering; None when no row was filtered (rare: top-k/top-p sampling)."""
    routings: list | None = None
    """Per row, its `Completion.routed_experts` (or None); None when no row has one (MoE only)."""
    generated: list[list[bool] | None] | None = None
    """Per row with a routing record, which of its positions were generated (False on the prompt);
    None where `routings` is."""

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        """Real tokens of every row together: what a step's forward reads, padding excluded."""
        return len(self.token_ids)

    @property
    def num_trained_tokens(self) -> int:
        """Tokens that reach the loss (`TrainBatch.num_generated_tokens` of the padded batch)."""
        return self.loss_mask.count(1)


def batch_columns(
    episodes: list[Episode], normalize_advantage_std: bool = True, step_discount: float = 1.0, local_weight: float = 1.0
) -> BatchColumns:
    """One row per completion. A token reaches the loss only where `Completion.loss_mask` says so:
    ERRORED completions and rows whose tokens are all untrainable keep their row (so N always
    equals the configured batch and splits evenly over data-parallel ranks) but are fully masked.

    `normalize_advantage_std` is `LossConfig.normalize_advantage_std` (False for Dr. GRPO),
    `step_discount` is `LossConfig.step_discount` (how far a process reward's credit reaches back),
    `local_weight` is `LossConfig.local_advantage_weight` (a branched group's local term).
    """
    lengths, token_ids, exact, generators = array("q"), array("q"), array("q"), array("q")
    loss_mask, behaviour, advantages, temperatures, references = (
        array("B"),
        array("f"),
        array("f"),
        array("f"),
        array("f"),
    )
    supports: list[list[list[int]] | None] = []
    routings, generated = [], []
    num_references = 0
    # Filled with C loops: `fromlist` where values differ, repeated arrays where they do not (the
    # prompt's zeros, a completion's one advantage and one version), `extend` by an array (a copy).
    # A Python walk over every token would hold the rollouts' event loop for as long as a large
    # batch has tokens.
    for episode in episodes:
        prompt = array("q", episode.prompt_token_ids)
        prompt_zeros, prompt_false, prompt_context = (
            array("f", bytes(4 * len(prompt))),
            bytes(len(prompt)),
            array("q", [-1]) * len(prompt),
        )
        generator = -1 if episode.generator_index is None else episode.generator_index
        advantage_columns = _advantage_columns(episode, normalize_advantage_std, step_discount, local_weight)
        for completion, completion_advantages in zip(episode.completions, advantage_columns):
            num_tokens = completion.num_tokens
            lengths.append(len(prompt) + num_tokens)
            token_ids.extend(prompt)
            token_ids.fromlist(completion.token_ids)
            loss_mask.frombytes(prompt_false)
            loss_mask.frombytes(bytes(completion.loss_mask))
            behaviour.extend(prompt_zeros)
            behaviour.fromlist(completion.logprobs)
            advantages.extend(prompt_zeros)
            advantages.extend(completion_advantages)
            exact.extend(prompt_context)
            exact.extend(_exact_version_column(completion))
            temperatures.append(episode.temperature)
            generators.append(generator)
            if completion.reference_logprobs is not None:
                num_references += 1
                references.extend(prompt_zeros)
                references.fromlist(completion.reference_logprobs)
            # Kept sets and routing records are rare (top-k/top-p sampling, MoE): their per-token
            # lists are built only for a row that has some.
            supports.append(
                None if completion.sampling_support is None else [[]] * len(prompt) + completion.sampling_support
            )
            routings.append(completion.routed_experts)
            generated.append(
                None if completion.routed_experts is None else [False] * len(prompt) + completion.generated_mask
            )
    if not lengths:
        raise ValueError("batch_columns got no completions")
    if num_references and num_references != len(lengths):
        raise ValueError(f"{len(lengths) - num_references} of {len(lengths)} completions lack reference logprobs")
    has_routing = any(r is not None for r in routings)
    return BatchColumns(
        lengths=lengths,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        advantages=advantages,
        exact_versions=exact,
        temperatures=temperatures,
        generators=generators,
        reference_logprobs=references if num_references else None,
        supports=supports if any(s is not None for s in supports) else None,
        routings=routings if has_routing else None,
        generated=generated if has_routing else None,
    )


def _advantage_columns(
    episode: Episode, normalize_advantage_std: bool, step_discount: float, local_weight: float
) -> list[array]:
    """`token_advantages` of each completion as a "f" column: one value repeated for plain GRPO
    (`is_plain`: every token carries its completion's advantage)."""
    if is_plain(episode):
        per_completion = episode_advantages(episode, normalize_advantage_std)
        return [array("f", [a]) * c.num_tokens for a, c in zip(per_completion, episode.completions)]
    return [array("f", a) for a in token_advantages(episode, normalize_advantage_std, step_discount, local_weight)]


def _exact_version_column(completion: Completion) -> array:
    """`exact_versions` as a "q" column."""
    if completion.generated is None and completion.kv_versions is not None:
        return array("q", completion.kv_versions)
    versions = completion.policy_versions
    if completion.generated is None and versions and min(versions) == versions[0]:
        return array("q", versions[:1]) * len(versions)  # exact_versions' common case, in C
    return array("q", exact_versions(completion))


def exact_versions(completion: Completion) -> list[int]:
    """Per token, [T]: for a generated token, the oldest weights it depends on (those that sampled
    it, and those that encoded the KV it attended to); -1 for context. What every age bound is
    applied to (`forge_rl.core.buffer`).

    Where the engine recorded them (`Completion.kv_versions`: a single-turn completion of the vLLM
    engine), they are its record: the version a request was submitted under, lowered by each swap
    that kept the request's KV (swap_mode keep, swap_kv reuse), and reset to the new version by a
    swap that re-encoded it (swap_kv recompute) and by the resubmission of an aborted request
    (swap_mode abort; an adapter retired under a request, `VLLMEngine.load_adapter`).

    Otherwise, the oldest version among its turn's generated tokens up to it. A turn is one vLLM
    request, whose prefix is encoded by the version that samples its first token (a request is
    salted with the version it is submitted under, and one arriving during a swap is held until
    the swap ends: `forge_rl.engines.vllm_engine`). A swap in the middle of a turn leaves the rest
    of the turn attending to KV of the older weights, so those tokens count as that older version;
    after a swap that re-encoded the prefix they would be exact, but without a record nothing says
    which swap it was, so they count as older all the same. A turn is a run of generated tokens;
    context tokens end it.

        versions [3, 3, 4, 4] generated [T, T, T, T] -> [3, 3, 3, 3]   (swap mid-turn)
        versions [3, 3, 3, 4] generated [T, F, F, T] -> [3, -1, -1, 4] (swap between two turns)
        versions [3, 3, 4, 4] kv_versions [3, 3, 4, 4] -> [3, 3, 4, 4] (a swap that re-encoded)
    """
    if completion.kv_versions is not None:
        return [v if generated else -1 for v, generated in zip(completion.kv_versions, completion.generated_mask)]
    out, oldest = [], None
    for version, generated in zip(completion.policy_versions, completion.generated_mask):
        if not generated:
            out.append(-1)
            oldest = None
            continue
        oldest = version if oldest is None else min(oldest, version)
        out.append(oldest)
    return out
