"""The prefix-tree layout (forge_rl/training/packing.py `plan_prefix_tree`): shared prefixes
computed once, each token attending to its own path, and the same logprobs and gradients as the
flat layouts."""

import pytest
import torch

from forge_rl.core.batching import kept_sets
from forge_rl.training.packing import layout_token_logprobs, plan_microbatches, plan_prefix_tree, tree_token_logprobs

VOCAB = 8


class PrefixModel(torch.nn.Module):
    """A differentiable stand-in for a causal model whose logits depend on the whole visible
    prefix (a masked mean of embeddings) and on the position: what the layouts must preserve."""

    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, 6, generator=generator))
        self.position = torch.nn.Parameter(torch.randn(64, 6, generator=generator))
        self.out = torch.nn.Parameter(torch.randn(6, vocab, generator=generator))

    def forward(self, ids_RW, positions=None, mask=None):
        width = ids_RW.shape[1]
        visible = (
            torch.ones(width, width).tril().expand(ids_RW.shape[0], width, width)
            if mask is None
            else mask[:, 0].float()
        )
        positions = torch.arange(width).expand_as(ids_RW) if positions is None else positions
        hidden = visible @ self.embed[ids_RW] / visible.sum(-1, keepdim=True) + self.position[positions]
        return torch.tanh(hidden) @ self.out


def _groups(prompt_lengths, group, completion_max, seed=0):
    """Rows of groups: each group's `group` sequences share a random prompt, then differ."""
    generator = torch.Generator().manual_seed(seed)
    rows, lengths = [], []
    for prompt_length in prompt_lengths:
        prompt = torch.randint(0, VOCAB, (prompt_length,), generator=generator)
        for _ in range(group):
            n = int(torch.randint(1, completion_max + 1, (1,), generator=generator))
            rows.append(torch.cat([prompt, torch.randint(0, VOCAB, (n,), generator=generator)]))
            lengths.append(len(rows[-1]))
    ids = torch.zeros((len(rows), max(lengths)), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, lengths


def _padded(model, ids, lengths, temperature=None, support=None):
    return layout_token_logprobs(model, ids, lengths, plan_microbatches(lengths, "pad"), temperature, support)


def _tree(model, ids, lengths, temperature=None, support=None, entropy=None):
    tree = plan_prefix_tree(ids, lengths, temperature, support)
    return tree_token_logprobs(model, ids, lengths, tree, temperature, support, entropy)


def test_the_docstring_example():
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 0, 0, 0, 0], [1, 2, 3, 7, 0], [4, 4, 0, 0, 0]])
    tree = plan_prefix_tree(ids, [5, 1, 4, 2])
    assert (tree.num_rows, tree.width, tree.num_computed) == (2, 6, 9)
    assert tree.slot_NL[2, :3].tolist() == tree.slot_NL[0, :3].tolist()  # the shared first 3 tokens


def test_a_group_computes_its_prompt_once():
    prompt, completions = list(range(1, 7)), [[1, 2], [3], [4, 5, 6]]
    rows = [prompt + c for c in completions]
    ids = torch.zeros((3, 9), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    tree = plan_prefix_tree(ids, [len(r) for r in rows])
    assert tree.num_computed == 6 + 2 + 1 + 3
    # each token attends to its own path only: the prompt and its own completion's earlier tokens
    mask, slots = tree.mask_R1WW[0, 0], tree.slot_NL
    last = slots[2, 8].item()
    assert mask[last].nonzero().squeeze(-1).tolist() == sorted(slots[2, :9].tolist())
    assert tree.positions_RW.flatten()[slots[1, 6]].item() == 6  # a branch's positions continue its prefix


@pytest.mark.parametrize("multiple", [1, 4])
def test_tree_logprobs_are_the_padded_layouts(multiple):
    ids, lengths = _groups([5, 3, 9], group=4, completion_max=6)
    model = PrefixModel()
    tree = plan_prefix_tree(ids, lengths, length_multiple=multiple)
    assert tree.width % multiple == 0
    assert torch.allclose(tree_token_logprobs(model, ids, lengths, tree), _padded(model, ids, lengths), atol=1e-6)


def test_tree_gradients_are_the_padded_layouts():
    ids, lengths = _groups([7, 4], group=8, completion_max=5, seed=1)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for logprobs in (_padded, _tree):
        model = PrefixModel()
        (logprobs(model, ids, lengths) * weights).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for padded, tree in zip(*grads):
        assert torch.allclose(padded, tree, atol=1e-5)


def test_identical_sequences_and_a_sequence_that_is_anothers_prefix():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 0, 0], [5, 0, 0, 0]])
    lengths = [4, 4, 2, 1]
    tree = plan_prefix_tree(ids, lengths)
    assert tree.num_computed == 5
    model = PrefixModel()
    assert torch.allclose(tree_token_logprobs(model, ids, lengths, tree), _padded(model, ids, lengths), atol=1e-6)


def test_an_empty_sequence_gets_zero_logprobs():
    ids = torch.tensor([[1, 2, 3], [0, 0, 0], [1, 2, 0]])
    model = PrefixModel()
    logprobs = _tree(model, ids, [3, 0, 2])
    assert (logprobs[1] == 0).all() and torch.allclose(logprobs, _padded(model, ids, [3, 0, 2]), atol=1e-6)


@pytest.mark.parametrize("encoding", ["ids", "bitmask"])
def test_each_sequences_temperature_and_kept_sets_are_kept(encoding):
    ids, lengths = _groups([6], group=5, completion_max=4, seed=3)
    temperature = torch.tensor([0.5, 1.0, 1.0, 0.7, 1.0])
    support = torch.full((*ids.shape, 3), -1, dtype=torch.int32)
    support[1, 6] = torch.tensor([ids[1, 6].item(), (ids[1, 6].item() + 1) % VOCAB, -1])
    support[2, 7, 0] = ids[2, 7]  # a kept set of one token: logprob 0
    if encoding == "bitmask":
        support = kept_sets([[[v for v in k.tolist() if v >= 0] for k in row] for row in support], ids.shape[1])
        assert support.dtype == torch.uint8
    model = PrefixModel()
    entropy_tree, entropy_pad = torch.zeros(ids.shape), torch.zeros(ids.shape)
    tree = _tree(model, ids, lengths, temperature, support, entropy_tree)
    padded = layout_token_logprobs(
        model, ids, lengths, plan_microbatches(lengths, "pad"), temperature, support, entropy_pad
    )
    assert torch.allclose(tree, padded, atol=1e-6) and torch.allclose(entropy_tree, entropy_pad, atol=1e-5)
    assert tree[2, 7].item() == pytest.approx(0.0, abs=1e-6)


def test_sequences_at_other_temperatures_share_nothing():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4]])
    assert plan_prefix_tree(ids, [3, 3], torch.tensor([1.0, 0.5])).num_computed == 6
    assert plan_prefix_tree(ids, [3, 3], torch.tensor([1.0, 1.0])).num_computed == 4


def test_branches_that_overflow_a_row_start_another_with_their_prefix_again():
    # a tree of 6 + 12 x 4 = 54 slots, more than 4 x the longest (40): split over 2 rows of 54 / 2
    # + 10 (room for the prompt's copy) = 37; the prompt and 7 branches fill 34 of the first, the
    # eighth carries the prompt again into the second
    ids = torch.tensor([[1] * 6 + [b] * 4 for b in range(2, 14)])
    lengths = [10] * 12
    tree = plan_prefix_tree(ids, lengths)
    assert (tree.num_rows, tree.width, tree.num_computed) == (2, 37, 6 + 7 * 4 + 6 + 5 * 4)
    model = PrefixModel(vocab=16)
    assert torch.allclose(tree_token_logprobs(model, ids, lengths, tree), _padded(model, ids, lengths), atol=1e-6)


def test_rows_are_as_wide_as_the_largest_tree():
    rows = [[1, 1, 1, 2], [1, 1, 1, 3, 3], [1, 1, 1, 4], [5, 5, 6], [5, 5, 7]]  # trees of 3 + 4 and 2 + 2
    ids = torch.zeros((5, 5), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    tree = plan_prefix_tree(ids, [len(r) for r in rows])
    assert (tree.num_rows, tree.width, tree.num_computed) == (2, 7, 11)


def test_the_tree_layout_is_not_planned_from_lengths():
    with pytest.raises(ValueError, match="plan_prefix_tree"):
        plan_microbatches([3], "tree")
