"""Which row of a source prompt i reads: row `permute(position, N, seed, epoch)` with epoch = i // N
and position = i % N, so each row is read exactly once per epoch and prompt i is a pure function of
(seed, N, i). No message carries a prompt and a resume at any index replays the same rows.

The permutation is a four-round Feistel network over the smallest even number of bits that covers
N, walked until it lands below N (cycle walking). It costs O(1) memory and time per index, so a
million-row file needs no million-entry array per epoch; and the order is defined here alone, so an
upgrade of numpy (whose `Generator` streams are not promised stable across versions) cannot change
which row a resumed run reads next.

Worked example (N = 5, seed 0): prompts 0-4 read rows permute(0..4, 5, 0, 0), each of rows 0-4 once;
prompt 7 is epoch 1, position 2, row permute(2, 5, 0, 1).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

_ROUNDS = 4
"""Four rounds of a pseudorandom round function make a strong pseudorandom permutation
(Luby-Rackoff); fewer leave the output halves visibly tied to the input's."""


class Position(NamedTuple):
    """Where prompt `index` falls in a source of `num_rows` rows."""

    epoch: int
    """index // num_rows: how many times every row has been read before this prompt."""
    position: int
    """index % num_rows: the place of this prompt in its epoch's order."""
    row_number: int
    """The row it reads, 0-based in storage order."""


def locate(index: int, num_rows: int, seed: int) -> Position:
    """The epoch, position and row of prompt `index` (index >= 0, num_rows >= 1)."""
    if index < 0:
        raise ValueError(f"prompt index ({index}) must be >= 0")
    if num_rows < 1:
        raise ValueError(f"num_rows ({num_rows}) must be >= 1")
    epoch, position = divmod(index, num_rows)
    return Position(epoch, position, permute(position, num_rows, seed, epoch))


def permute(position: int, num_rows: int, seed: int, epoch: int) -> int:
    """The row at `position` (0 <= position < num_rows) of epoch `epoch`'s order: a bijection of
    [0, num_rows) that depends only on (num_rows, seed, epoch)."""
    if not 0 <= position < num_rows:
        raise ValueError(f"position ({position}) must be in [0, {num_rows})")
    if num_rows == 1:
        return 0
    half_bits = ((num_rows - 1).bit_length() + 1) // 2
    key = seed.to_bytes(16, "little", signed=True) + epoch.to_bytes(16, "little", signed=True)
    value = position
    # The network permutes [0, 4**half_bits) and maps into [0, num_rows) only some of it; applying
    # it again from a value outside lands inside after fewer than four steps on average (the domain
    # is under 4 N), and the walk's map restricted to [0, num_rows) is itself a bijection.
    while True:
        value = _feistel(value, half_bits, key)
        if value < num_rows:
            return value


def _feistel(value: int, half_bits: int, key: bytes) -> int:
    mask = (1 << half_bits) - 1
    left, right = value >> half_bits, value & mask
    for round_index in range(_ROUNDS):
        left, right = right, left ^ (_round(round_index, right, key) & mask)
    return (left << half_bits) | right


def _round(round_index: int, half: int, key: bytes) -> int:
    data = round_index.to_bytes(1, "little") + half.to_bytes(16, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little")
