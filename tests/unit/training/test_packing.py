"""Forward layouts (forge_rl/training/packing.py): the plans, the document mask, and the mapping back to rows."""

import pytest
import torch

from forge_rl.core.batching import kept_sets
from forge_rl.training.packing import document_mask, layout_token_logprobs, plan_microbatches


def _covered(microbatches, lengths):
    """Every sequence placed once, inside its row, with no two sequences overlapping."""
    seen = []
    for mb in microbatches:
        used = torch.zeros(mb.num_rows, mb.width, dtype=torch.int64)
        for i, row, offset in mb.placements:
            assert offset + lengths[i] <= mb.width
            used[row, offset : offset + lengths[i]] += 1
            seen.append(i)
        assert used.max() <= 1
    return sorted(seen) == list(range(len(lengths)))


def test_the_docstring_example():
    lengths = [5, 1, 4, 2]
    (pad,) = plan_microbatches(lengths, "pad")
    assert (pad.num_rows, pad.width) == (4, 5)
    buckets = plan_microbatches(lengths, "bucket")
    assert sum(mb.num_slots for mb in buckets) < pad.num_slots
    (pack,) = plan_microbatches(lengths, "pack")
    assert (pack.num_rows, pack.width) == (3, 5)
    assert set(pack.placements) == {(0, 0, 0), (2, 1, 0), (1, 1, 4), (3, 2, 0)}


@pytest.mark.parametrize("mode", ["pad", "bucket", "pack"])
@pytest.mark.parametrize("multiple", [1, 2])
def test_every_layout_places_each_sequence_once_in_widths_of_the_tp_multiple(mode, multiple):
    lengths = [int(2 / (1 - (i * 0.37) % 1)) for i in range(30)]
    microbatches = plan_microbatches(lengths, mode, length_multiple=multiple)
    assert _covered(microbatches, lengths)
    assert all(mb.width % multiple == 0 for mb in microbatches)


def test_a_long_tail_packs_into_far_fewer_slots_than_padding():
    lengths = [3] * 28 + [40, 64, 20, 9]
    pad = plan_microbatches(lengths, "pad")[0].num_slots
    assert sum(mb.num_slots for mb in plan_microbatches(lengths, "bucket")) < pad / 2
    assert plan_microbatches(lengths, "pack")[0].num_slots < pad / 4


def test_document_mask_is_causal_within_each_sequence_and_restarts_positions():
    (pack,) = plan_microbatches([2, 3], "pack", length_multiple=1)  # width 3: rows [3], [2 + 1 pad]
    positions, mask = document_mask(pack, [2, 3])
    assert positions.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert mask[1, 0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    assert mask.any(-1).all()  # no query attends to nothing (that would be NaN)


def _bag_of_prefix_forward(vocab: int = 8):
    """Logits that depend on the whole visible prefix (a causal mean of one-hots) and position."""

    def forward(ids_RW, positions, mask):
        one_hot = torch.nn.functional.one_hot(ids_RW, vocab).float()
        width = ids_RW.shape[1]
        visible = torch.ones(width, width).tril().expand(ids_RW.shape[0], width, width)
        if mask is not None:
            visible = mask[:, 0].float()
        positions = torch.arange(width).expand_as(ids_RW) if positions is None else positions
        return visible @ one_hot / visible.sum(-1, keepdim=True) + 0.1 * positions[..., None]

    return forward


@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_layouts_map_logprobs_back_to_the_padded_rows(mode):
    lengths = [6, 1, 3, 2, 5]
    ids = torch.randint(0, 8, (5, 6), generator=torch.Generator().manual_seed(0))
    forward = _bag_of_prefix_forward()
    padded = layout_token_logprobs(forward, ids, lengths, plan_microbatches(lengths, "pad"))
    other = layout_token_logprobs(forward, ids, lengths, plan_microbatches(lengths, mode))
    assert torch.allclose(padded, other, atol=1e-6)
    for i, n in enumerate(lengths):
        assert padded[i, 0] == 0 and (padded[i, n:] == 0).all() and (padded[i, 1:n] != 0).all()


@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_an_empty_sequence_gets_no_forward_pass_and_zero_logprobs(mode):
    """An environment episode whose reset failed has no token: it keeps its (fully masked) row."""
    lengths = [4, 0, 2]
    ids = torch.randint(1, 8, (3, 4), generator=torch.Generator().manual_seed(0))
    microbatches = plan_microbatches(lengths, mode)
    assert all(mb.width > 0 for mb in microbatches)
    assert all(i != 1 for mb in microbatches for i, _, _ in mb.placements)
    forward = _bag_of_prefix_forward()
    padded = layout_token_logprobs(forward, ids, lengths, plan_microbatches(lengths, "pad"))
    assert torch.allclose(layout_token_logprobs(forward, ids, lengths, microbatches), padded, atol=1e-6)
    assert (padded[1] == 0).all()


@pytest.mark.parametrize("encoding", ["ids", "bitmask"])
@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_layouts_keep_each_sequences_temperature_and_kept_sets(mode, encoding):
    lengths = [6, 1, 3, 2, 5]
    ids = torch.randint(0, 8, (5, 6), generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3])
    support = torch.full((5, 6, 3), -1, dtype=torch.int32)
    support[0, 2] = torch.tensor([ids[0, 2].item(), (ids[0, 2].item() + 1) % 8, (ids[0, 2].item() + 2) % 8])
    support[4, 3, 0] = ids[4, 3]  # a kept set of one token: logprob 0
    if encoding == "bitmask":  # what `kept_sets` picks for sets this large against a vocabulary of 8
        support = kept_sets([[[v for v in k.tolist() if v >= 0] for k in row] for row in support], 6)
        assert support.dtype == torch.uint8
    forward = _bag_of_prefix_forward()
    padded = layout_token_logprobs(forward, ids, lengths, plan_microbatches(lengths, "pad"), temperature, support)
    other = layout_token_logprobs(forward, ids, lengths, plan_microbatches(lengths, mode), temperature, support)
    assert torch.allclose(padded, other, atol=1e-6)
    assert padded[4, 3].item() == pytest.approx(0.0, abs=1e-6)
    plain = layout_token_logprobs(forward, ids, lengths, plan_microbatches(lengths, "pad"))
    assert not torch.allclose(plain[0], padded[0])  # temperature 0.5 changes row 0


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'zip' is not one of pad, bucket, pack"):
        plan_microbatches([1], "zip")
