"""How a batch's sequences are laid out for the model's forward pass: pad, bucket, pack or tree. Plain PyTorch.

`TrainBatch` keeps one sequence (prompt + completion) per row, right-padded to the longest; that
is the *logical* layout the loss reads. The forward pass may use another *physical* layout, and
the token logprobs are mapped back to the logical one, so the loss code never sees the difference:

    pad     one forward over the [N, L] rows as they are (every row as long as the longest).
    bucket  rows sorted by length and cut into up to `NUM_BUCKETS` micro-batches holding about
            equal numbers of real tokens; each pads only to its own longest row. The micro-batches'
            logprobs join one graph, so there is still one loss and one backward.
    pack    sequences placed first-fit-decreasing into rows as wide as the longest sequence; each
            token attends only to earlier tokens of its own sequence (a boolean block-diagonal
            causal mask, `document_mask`) and positions restart at 0 per sequence, so every
            sequence sees exactly what it sees alone in a row.
    tree    sequences that begin with the same tokens (a group's prompt, a branch's prefix) share
            them: each row holds a prefix tree, every shared token computed once, every token
            attending to its own path from the root only (`plan_prefix_tree`). Under causal
            attention a token's hidden state depends on its prefix alone, so each sequence sees
            what it sees alone in a row, and its tokens' logprobs, loss and gradients are the
            flat layouts' (the shared states' gradients are the sum of their sequences').

Worked example, lengths [5, 1, 4, 2] (N = 4, L = 5, 12 real tokens):

    pad:    1 forward of 4 x 5  = 20 slots, 8 of them padding
    bucket: [5, 4] -> 2 x 5, [2, 1] -> 2 x 2:  14 slots
    pack:   rows [5], [4, 1], [2] -> 3 x 5 = 15 slots; row 1 = seq 2 at 0..3, seq 1 at 4

    tree:   [5, 1, 4, 2] where sequences 0 and 2 begin with the same 3 tokens (a tree of 6):
            rows [seq 0 (5), seq 2's last 1], [seq 3 (2), seq 1 (1), 3 pad] -> 2 x 6 = 12 slots, 9 computed

All layouts give the same logprobs (within float rounding of a differently shaped matmul, about
1e-6): position 0 of each sequence and positions past its length are 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from forge_rl.core.batching import empty_kept_set, predicted_entropy, predicted_logprobs, token_entropy, token_logprobs
from forge_rl.training.trainer_config import BATCHING_MODES

# Each forward pass has a fixed cost (kernel launches, Python, FSDP all-gathers per block); 4
# buckets remove most of a long tail's padding for that cost.
NUM_BUCKETS = 4

# A prefix tree's row is as wide as the largest tree, up to this many times the longest sequence:
# wide enough to hold a group's prompt once and its branches after it, narrow enough that the
# dense attention over a row (its cost grows with the square of the width) stays near the flat
# layouts' for a long prefix.
TREE_ROW_WIDTHS = 4


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass over `num_rows` rows of `width` positions.

    `placements` holds (sequence index, row, offset): sequence i's tokens sit at
    row r, positions offset .. offset + length - 1. `packed` rows may hold several sequences.
    """

    num_rows: int
    width: int
    placements: tuple[tuple[int, int, int], ...]
    packed: bool = False

    @property
    def num_slots(self) -> int:
        return self.num_rows * self.width


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_microbatches(
    lengths: list[int], mode: str, length_multiple: int = 1, width: int | None = None
) -> list[MicroBatch]:
    """The forward passes that cover sequences of `lengths` in layout `mode` (see the module docstring).

    Widths are rounded up to `length_multiple` (sequence parallelism splits positions over TP ranks);
    `width` is the pad layout's width (the batch tensor's L; default the longest length).
    """
    if mode not in BATCHING_MODES:
        raise ValueError(f"batching mode {mode!r} is not one of {', '.join(BATCHING_MODES)}")
    if mode == "tree":
        raise ValueError("the tree layout is planned from the tokens, not the lengths: call plan_prefix_tree")
    if not lengths:
        return []
    longest = max(lengths)
    if mode == "pad":
        return [
            MicroBatch(
                len(lengths),
                _round_up(width or longest, length_multiple),
                tuple((i, i, 0) for i in range(len(lengths))),
            )
        ]
    # An empty sequence (an environment episode whose reset failed: no token at all) has nothing
    # to compute and would make a bucket of width 0; it is left out, its logprobs stay 0.
    order = sorted((i for i in range(len(lengths)) if lengths[i]), key=lambda i: (-lengths[i], i))
    if mode == "bucket":
        return [
            MicroBatch(
                len(group),
                _round_up(lengths[group[0]], length_multiple),
                tuple((i, row, 0) for row, i in enumerate(group)),
            )
            for group in _equal_token_groups(order, lengths, NUM_BUCKETS)
        ]
    capacity = _round_up(longest, length_multiple)
    free: list[int] = []  # free positions left in each packed row
    placements = []
    for i in order:  # first fit, longest first
        row = next((r for r, space in enumerate(free) if space >= lengths[i]), None)
        if row is None:
            row = len(free)
            free.append(capacity)
        placements.append((i, row, capacity - free[row]))
        free[row] -= lengths[i]
    return [MicroBatch(len(free), capacity, tuple(sorted(placements)), packed=True)]


def _equal_token_groups(order: list[int], lengths: list[int], num_groups: int) -> list[list[int]]:
    """`order` (longest first) cut into at most `num_groups` runs of about equal total length."""
    total = sum(lengths[i] for i in order)
    groups: list[list[int]] = []
    current: list[int] = []
    seen = 0
    for i in order:
        current.append(i)
        seen += lengths[i]
        if seen >= total * (len(groups) + 1) / num_groups and len(groups) < num_groups - 1:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


def document_mask(microbatch: MicroBatch, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [R, W] int64, mask [R, 1, W, W] bool) of a packed micro-batch.

    mask[r, 0, q, k] is True when positions q and k of row r hold the same sequence and k <= q.
    Each row's unused tail is one more "sequence" of its own, so no query row is fully masked
    (an all-False row gives NaN in attention, and NaN poisons the backward even where unused).
    """
    rows, width = microbatch.num_rows, microbatch.width
    documents_RW = torch.full((rows, width), -1, dtype=torch.int64)
    positions_RW = torch.zeros((rows, width), dtype=torch.int64)
    used = [0] * rows
    for i, row, offset in microbatch.placements:
        n = lengths[i]
        documents_RW[row, offset : offset + n] = i
        positions_RW[row, offset : offset + n] = torch.arange(n)
        used[row] = max(used[row], offset + n)
    for row in range(rows):
        positions_RW[row, used[row] :] = torch.arange(width - used[row])
    causal_WW = torch.ones(width, width, dtype=torch.bool).tril()
    same_RWW = documents_RW[:, :, None] == documents_RW[:, None, :]
    return positions_RW, (same_RWW & causal_WW).unsqueeze(1)


# forward(input_ids [R, W], positions [R, W] or None, mask [R, 1, W, W] or None) -> logits [R, W, V];
# with a routing replay, forward(..., (expert ids [R, W, X, K], has-record [R, W])) (`forge_rl.routing`)
Forward = Callable[..., torch.Tensor]


def _replay_layout(
    mb: MicroBatch, lengths: list[int], expert_ids_NLXK: torch.Tensor, routed_NL: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's replay: token t's record at the position of token t-1 (see
    `forge_rl.routing`: the routing of the pass that sampled a token is its predecessor's)."""
    replay_RWXK = expert_ids_NLXK.new_zeros((mb.num_rows, mb.width, *expert_ids_NLXK.shape[2:]))
    replay_RW = torch.zeros((mb.num_rows, mb.width), dtype=torch.bool)
    for i, row, offset in mb.placements:
        n = min(lengths[i], mb.width - offset)
        if n > 1:
            replay_RWXK[row, offset : offset + n - 1] = expert_ids_NLXK[i, 1:n]
            replay_RW[row, offset : offset + n - 1] = routed_NL[i, 1:n]
    return replay_RWXK, replay_RW


def layout_token_logprobs(
    forward: Forward,
    input_ids_NL: torch.Tensor,
    lengths: list[int],
    microbatches: list[MicroBatch],
    temperature_N: torch.Tensor | None = None,
    support_NLK: torch.Tensor | None = None,
    entropy_NL: torch.Tensor | None = None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[N, L] fp32 logprob of each token given its own sequence's prefix, through `microbatches`,
    under each sequence's sampling temperature and kept sets (`forge_rl.core.batching.token_logprobs`).

    Position 0 of every sequence and positions at or past its length are 0. Differentiable: the
    gathers from each micro-batch's logprobs join one autograd graph. Given `entropy_NL` (an [N, L]
    tensor), also fills it with the policy's entropy at each position (`token_entropy`), from the
    same forward passes.

    `routing` ([N, L, X, K] recorded experts, [N, L] has-record: `TrainBatch.routed_experts_NLXK`,
    `routed_NL`) is replayed: a token's record belongs to the position that predicts it, so it is
    placed one position back in the micro-batch and passed to `forward` as a fourth argument.
    """
    num_rows, length = input_ids_NL.shape
    values, entropies, destinations = [], [], []
    for mb in microbatches:
        ids_RW = torch.zeros((mb.num_rows, mb.width), dtype=input_ids_NL.dtype)
        temperature_RW = None if temperature_N is None else torch.ones((mb.num_rows, mb.width))
        support_RWK = (
            None
            if support_NLK is None
            else support_NLK.new_full((mb.num_rows, mb.width, support_NLK.shape[-1]), empty_kept_set(support_NLK))
        )
        for i, row, offset in mb.placements:
            n = min(lengths[i], mb.width - offset)
            ids_RW[row, offset : offset + n] = input_ids_NL[i, :n]
            if temperature_RW is not None and temperature_N is not None:  # set together
                temperature_RW[row, offset : offset + n] = temperature_N[i]
            if support_RWK is not None and support_NLK is not None:  # set together
                support_RWK[row, offset : offset + n] = support_NLK[i, :n]
        positions_RW, mask = document_mask(mb, lengths) if mb.packed else (None, None)
        if routing is None:
            logits_RWV = forward(ids_RW, positions_RW, mask)
        else:
            logits_RWV = forward(ids_RW, positions_RW, mask, _replay_layout(mb, lengths, *routing))
        logprobs_RW = token_logprobs(logits_RWV, ids_RW.to(logits_RWV.device), temperature_RW, support_RWK)
        if entropy_NL is not None:
            entropies.append(token_entropy(logits_RWV, temperature_RW).flatten())
        source, destination = [], []
        for i, row, offset in mb.placements:
            n = max(min(lengths[i], length), 1)  # an empty sequence (pad layout) predicts nothing, like one of 1
            # position t of sequence i is predicted at row `row`, position offset + t
            source.append(torch.arange(row * mb.width + offset + 1, row * mb.width + offset + n))
            destination.append(torch.arange(i * length + 1, i * length + n))
        source_index = torch.cat(source).to(logprobs_RW.device)
        values.append(logprobs_RW.flatten().index_select(0, source_index))
        if entropy_NL is not None:
            entropies[-1] = entropies[-1].index_select(0, source_index)
        destinations.append(torch.cat(destination).to(logprobs_RW.device))
    flat, destination_index = torch.cat(values), torch.cat(destinations)
    if entropy_NL is not None:
        entropy_NL.view(-1).index_copy_(0, destination_index.to(entropy_NL.device), torch.cat(entropies).to(entropy_NL))
    out = torch.zeros(num_rows * length, dtype=flat.dtype, device=flat.device)
    return out.index_copy(0, destination_index, flat).view(num_rows, length)


@dataclass(frozen=True)
class PrefixTree:
    """Rows that hold prefix trees (the `tree` layout): `num_rows` rows of `width` slots.

    `slot_NL[i, t]` is the flat slot (row * width + position) holding token t of sequence i (-1 at
    or past its length); sequences that share their first tokens share those slots. `unique_NL[i,
    t]` (t >= 1) indexes the distinct predictions (slot of token t - 1, token t, temperature, kept
    set): the prediction of a token two sequences share is computed once. `positions_RW` is each
    slot's depth in its tree, `mask_R1WW[r, 0, q, k]` True where slot k lies on slot q's path from
    its tree's root (k = q included); a slot no sequence uses attends to itself alone, so no
    query's row is all False (NaN in attention, and in the backward even where unused).
    """

    num_rows: int
    width: int
    ids_RW: torch.Tensor
    positions_RW: torch.Tensor
    mask_R1WW: torch.Tensor
    slot_NL: torch.Tensor
    unique_NL: torch.Tensor
    unique_slot_U: torch.Tensor
    unique_index_U: torch.Tensor  # the flat [N * L] index of the token each distinct prediction targets
    num_computed: int

    @property
    def num_slots(self) -> int:
        return self.num_rows * self.width


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    return int((a[:n] == b[:n]).to(torch.int64).cumprod(0).sum())


def plan_prefix_tree(
    input_ids_NL: torch.Tensor,
    lengths: list[int],
    temperature_N: torch.Tensor | None = None,
    support_NLK: torch.Tensor | None = None,
    length_multiple: int = 1,
) -> PrefixTree:
    """The `tree` layout of a batch: sequences in lexicographic order (so a sequence's longest
    common prefix with any earlier one is its common prefix with the one just before it), each
    placed in the row of the sequence before it when its unshared tail fits there, sharing their
    common prefix's slots, else first fit into a row of its own path. Rows are as wide as the
    largest tree, within [longest sequence, `TREE_ROW_WIDTHS` x longest]; a larger tree is split
    over rows of about equal share. Sequences sampled at
    different temperatures share nothing (their predictions differ from the first token on).
    """
    num_rows_N, length = input_ids_NL.shape
    ids = input_ids_NL.cpu()
    temperatures = [1.0] * num_rows_N if temperature_N is None else [float(t) for t in temperature_N.cpu()]
    order = sorted(
        (i for i in range(num_rows_N) if lengths[i]), key=lambda i: (temperatures[i], ids[i, : lengths[i]].tolist())
    )
    common_N = [0] * num_rows_N  # shared with the sequence before in `order`, rows aside
    for before, i in zip(order, order[1:]):
        if temperatures[before] == temperatures[i]:
            common_N[i] = _common_prefix(ids[i, : lengths[i]], ids[before, : lengths[before]])
    tree_sizes, size = [], 0
    for i in order:
        if not common_N[i] and size:
            tree_sizes.append(size)
            size = 0
        size += lengths[i] - common_N[i]
    tree_sizes.append(size)
    longest = max(lengths, default=1) or 1
    largest, cap = max(tree_sizes), TREE_ROW_WIDTHS * longest
    if largest > cap:
        # Split over rows of about equal share, each with room for its copy of the prefix (at most
        # the longest sequence): a row just narrower than the tree would leave one branch and a
        # copy of the prefix to a second row of the full width, mostly padding.
        parts = -(-largest // cap)
        largest = min(cap, -(-largest // parts) + longest)
    width = _round_up(max(longest, largest), length_multiple)
    free: list[int] = []
    slot_NL = torch.full((num_rows_N, length), -1, dtype=torch.int64)
    row_of = [-1] * num_rows_N
    shared_N = [0] * num_rows_N
    previous: int | None = None
    row: int | None
    for i in order:
        n, common = lengths[i], common_N[i]
        # Only a sequence after the first shares a prefix with the one before it.
        row = row_of[previous] if common and previous is not None else -1
        if not common or free[row] < n - common:
            common = 0
            row = next((r for r, space in enumerate(free) if space >= n), None)
            if row is None:
                row = len(free)
                free.append(width)
        start = row * width + width - free[row]
        if common:
            slot_NL[i, :common] = slot_NL[previous, :common]
        slot_NL[i, common:n] = torch.arange(start, start + n - common)
        free[row] -= n - common
        row_of[i], shared_N[i], previous = row, common, i
    rows = max(len(free), 1)
    ids_RW = torch.zeros(rows * width, dtype=input_ids_NL.dtype)
    positions_RW = torch.zeros(rows * width, dtype=torch.int64)
    mask_RWW = torch.zeros((rows, width, width), dtype=torch.bool)
    used = torch.zeros(rows * width, dtype=torch.bool)
    for i in order:
        n, common = lengths[i], shared_N[i]
        slots = slot_NL[i, :n]
        ids_RW[slots[common:]] = ids[i, common:n]
        positions_RW[slots[common:]] = torch.arange(common, n)
        used[slots[common:]] = True
        # each new slot q = token t attends to the slots of tokens 0..t of its own path
        queries, keys = torch.tril_indices(n, n, offset=0)
        new = queries >= common
        queries, keys = slots[queries[new]], slots[keys[new]]
        mask_RWW[queries // width, queries % width, keys % width] = True
    unused = (~used).nonzero().squeeze(-1)
    mask_RWW[unused // width, unused % width, unused % width] = True
    unique_NL, unique_slot, unique_index = _distinct_predictions(ids, lengths, order, shared_N, slot_NL, support_NLK)
    return PrefixTree(
        num_rows=rows,
        width=width,
        ids_RW=ids_RW.view(rows, width),
        positions_RW=positions_RW.view(rows, width),
        mask_R1WW=mask_RWW.unsqueeze(1),
        slot_NL=slot_NL,
        unique_NL=unique_NL,
        unique_slot_U=unique_slot,
        unique_index_U=unique_index,
        num_computed=int(used.sum()),
    )


def _distinct_predictions(
    ids: torch.Tensor,
    lengths: list[int],
    order: list[int],
    shared_N: list[int],
    slot_NL: torch.Tensor,
    support_NLK: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unique_NL, and per distinct prediction its predicting slot and its target's flat index.
    Token t of sequence i (t >= 1) is the prediction of the sequence before it in `order` when
    both share token t (t < shared) and its kept set (prompt tokens have none; sampled ones may
    differ across policy versions); else a new one."""
    num_rows_N, length = ids.shape
    unique_NL = torch.zeros((num_rows_N, length), dtype=torch.int64)
    slots, targets = [], []
    count, previous = 0, None
    for i in order:
        n, common = lengths[i], shared_N[i]
        fresh = torch.ones(n, dtype=torch.bool)
        fresh[0] = False  # token 0 is predicted by nothing
        if common:
            same = torch.ones(common, dtype=torch.bool)
            if support_NLK is not None:
                same = (support_NLK[i, :common] == support_NLK[previous, :common]).all(-1).cpu()
            fresh[1:common] = ~same[1:]
            unique_NL[i, 1:common] = unique_NL[previous, 1:common]
        positions = fresh.nonzero().squeeze(-1)
        unique_NL[i, positions] = torch.arange(count, count + len(positions))
        count += len(positions)
        slots.append(slot_NL[i, positions - 1])
        targets.append(i * length + positions)
        previous = i
    if not slots:
        return unique_NL, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return unique_NL, torch.cat(slots), torch.cat(targets)


def tree_token_logprobs(
    forward: Forward,
    input_ids_NL: torch.Tensor,
    lengths: list[int],
    tree: PrefixTree,
    temperature_N: torch.Tensor | None = None,
    support_NLK: torch.Tensor | None = None,
    entropy_NL: torch.Tensor | None = None,
) -> torch.Tensor:
    """`layout_token_logprobs` through a `PrefixTree`: one forward over its rows, each distinct
    prediction's logprob computed once, and every token's taken from its prediction (so a shared
    prediction's gradient is the sum of its tokens')."""
    num_rows_N, length = input_ids_NL.shape
    logits_RWV = forward(tree.ids_RW, tree.positions_RW, tree.mask_R1WW)
    device = logits_RWV.device
    logits_UV = logits_RWV.flatten(0, 1).index_select(0, tree.unique_slot_U.to(device))
    index_U = tree.unique_index_U
    temperature_U = None if temperature_N is None else temperature_N.cpu().float()[index_U // length]
    support_UK = None if support_NLK is None else support_NLK.flatten(0, 1)[index_U.to(support_NLK.device)]
    logprobs_U = predicted_logprobs(
        logits_UV, input_ids_NL.flatten()[index_U.to(input_ids_NL.device)], temperature_U, support_UK
    )
    real_NL = tree.slot_NL >= 0
    real_NL[:, 0] = False
    destination = real_NL.flatten().nonzero().squeeze(-1)
    source = tree.unique_NL.flatten()[destination]
    if entropy_NL is not None:
        entropy_U = predicted_entropy(logits_UV, temperature_U)
        entropy_NL.view(-1).index_copy_(
            0, destination.to(entropy_NL.device), entropy_U[source.to(device)].to(entropy_NL)
        )
    out = torch.zeros(num_rows_N * length, dtype=logprobs_U.dtype, device=device)
    return out.index_copy(0, destination.to(device), logprobs_U.index_select(0, source.to(device))).view(
        num_rows_N, length
    )
