"""Values crossing a Monarch message as one bytes object of the C pickler's.

Monarch pickles every message with cloudpickle's Python-level pickler, whose Python hooks
(`reducer_override`, Monarch's `persistent_id`) run for every object of the message: for a prompt
or a scored group, hundreds of Python calls a message. At 128 generators that is a large share of
the rollouts' process (py-spy, `forge-rl bench scale`), the process whose
event-loop lag `bench scale` bounds. `packed(value)` pickles the value with the C pickler instead;
the message then holds one bytes object, and unpickling it calls `pickle.loads` on those bytes, so
the receiver gets `value` itself: nothing changes on its side.
"""

from __future__ import annotations

import pickle
from typing import Any


class _Packed:
    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (pickle.loads, (self.data,))


PACK_FROM_BYTES = 1024
"""Smaller values go as they are: the reference to `pickle.loads` costs Monarch's pickler more per
message than it spends on a few numbers (packed, a weight update's arguments take longer to flatten,
a prompt as long, a scored group of 8 completions several times less; `flatten` of the message's
arguments on one core)."""


def packed(value: Any) -> Any:
    """`value`, to cross a message as the C pickler's bytes (and arrive as itself); `value` as it is
    when it pickles to fewer than PACK_FROM_BYTES, or where the C pickler cannot pickle it
    (cloudpickle's cases: a lambda, a class defined in a function), so that Monarch's pickler takes
    it as before."""
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 -- any value the C pickler refuses goes the way it always went
        return value
    return _Packed(data) if len(data) >= PACK_FROM_BYTES else value
