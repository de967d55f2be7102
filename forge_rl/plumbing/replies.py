"""Replies of a call on a whole mesh (Monarch's ValueMesh), read without Monarch's tensor engine."""

from __future__ import annotations

from typing import Any


def rank_zero(replies: Any) -> Any:
    """The reply of the mesh's first rank (rank 0 of the trainer or a frozen model): what
    `replies.item(procs=0)` returns, except that `item` imports Monarch's tensor engine, and with
    it torch, seconds of CPU the run's controller would pay at its first step for nothing else. `replies`
    may also be the list a port call on the mesh answers
    (`forge_rl.plumbing.port_calls.PortCalls.call_each`, in rank order)."""
    for value in replies if isinstance(replies, list) else (value for _, value in replies.items()):
        return value
    raise ValueError("a call on an empty mesh has no rank 0 reply")
