"""vLLM's outputs as forge_rl's types: a finished request's completion (token ids, logprobs, policy
versions, kept sets), top-k logprobs, and the rows of a routing record."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from forge_rl.types import Completion, CompletionStatus, TopK

if TYPE_CHECKING:
    import torch
    from vllm.outputs import CompletionOutput


def routing_tensor(rows) -> torch.Tensor:
    """vLLM's routed-experts rows (numpy uint8/uint16) as a RoutingRecord's uint8/int16 tensor."""
    import numpy as np
    import torch

    rows = np.asarray(rows)
    return torch.from_numpy(rows.astype(np.uint8 if rows.dtype == np.uint8 else np.int16))


def top_k_of(position: dict, k: int) -> TopK:
    """The k likeliest tokens of one position of vLLM's logprobs ({token id: Logprob}, which
    also holds the sampled or prompt token at its own rank), likeliest first. Tokens outside a
    top-k/top-p kept set (logprob -inf under processed logprobs) are left out."""
    ranked = sorted(
        (lp.rank, token, lp.logprob) for token, lp in position.items() if lp.rank is not None and lp.rank <= k
    )
    return [(token, logprob) for _, token, logprob in ranked if math.isfinite(logprob)]


def to_completion(output: CompletionOutput, support_source: str, max_support_ids: int | None) -> Completion:
    """Token ids as vLLM sampled them (EOS included), their logprobs, version spans and kept sets.

    `max_support_ids`: how many most likely logprobs vLLM returned per token, when a kept set
    that fills them may be larger; None when every kept set fits."""
    token_ids = list(output.token_ids)
    logprobs = [position[token].logprob for token, position in zip(token_ids, output.logprobs)]
    policy_versions = [int(span.version) for span in output.weight_versions or [] for _ in range(span.start, span.end)]
    status = CompletionStatus.TRUNCATED if output.finish_reason == "length" else CompletionStatus.OK
    support, num_truncated = None, 0
    if support_source == "sampling_mask":
        support = [list(ids) for ids in output.sampling_mask.token_ids]
    elif support_source == "top_logprobs":  # processed logprobs: -inf where top-k/top-p filtered
        support = [[t for t, lp in position.items() if lp.logprob > -math.inf] for position in output.logprobs]
        # Every one of the max_support_ids most likely tokens kept (the sampled token may add one):
        # the set may go on past what vLLM returned.
        if max_support_ids is not None:
            num_truncated = sum(len(kept) >= max_support_ids for kept in support)
    return Completion(
        token_ids,
        logprobs,
        policy_versions,
        status=status,
        sampling_support=support,
        num_truncated_support=num_truncated,
    )


async def already_done(completion: Completion) -> Completion:
    return completion
