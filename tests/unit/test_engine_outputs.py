"""How `VLLMEngine` turns vLLM's outputs into Completions (no engine: outputs built by hand)."""

import math
from types import SimpleNamespace

from forge_rl.engines.vllm_engine import _join, _to_completion


def output(kept_per_token: list[list[int]], returned: int, finish_reason: str = "stop") -> SimpleNamespace:
    """A CompletionOutput of the CPU path: per token the `returned` most likely processed
    logprobs (-inf for those top-p/top-k filtered), the sampled token first."""
    token_ids = [kept[0] for kept in kept_per_token]
    logprobs = []
    for kept in kept_per_token:
        ids = kept + [100 + i for i in range(max(0, returned - len(kept)))]
        logprobs.append({t: SimpleNamespace(logprob=-1.0 if t in kept else -math.inf) for t in ids[:returned]})
    span = SimpleNamespace(version="3", start=0, end=len(token_ids))
    return SimpleNamespace(token_ids=token_ids, logprobs=logprobs, weight_versions=[span], finish_reason=finish_reason)


def test_kept_sets_that_fill_every_returned_logprob_are_counted_as_possibly_truncated():
    completion = _to_completion(output([[5, 6], [7, 8, 9, 10], [11]], returned=4), "top_logprobs", 4)

    assert completion.sampling_support == [[5, 6], [7, 8, 9, 10], [11]]
    assert completion.num_truncated_support == 1
    assert completion.policy_versions == [3, 3, 3]


def test_nothing_is_counted_when_every_kept_set_fits():
    """top_k <= max_support_ids: the engine passes None, a full set is the whole set."""
    completion = _to_completion(output([[7, 8, 9, 10]], returned=4), "top_logprobs", None)
    assert completion.num_truncated_support == 0


def test_a_resubmitted_completion_keeps_the_count_of_both_pieces():
    head = _to_completion(output([[7, 8, 9, 10]], returned=4, finish_reason="abort"), "top_logprobs", 4)
    tail = _to_completion(output([[1, 2, 3, 4], [5]], returned=4), "top_logprobs", 4)
    assert _join(head, tail).num_truncated_support == 2
