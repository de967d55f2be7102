"""A GeneratorActor whose engine the test can hold (tests/support/held_engine.py), for the
generator pool's tests: a generate call that carries the holder's prompt never returns.

A call whose first episode is `held_episode` (HOLD_PROMPT, one token) and whose others run to
max_new_tokens hangs by construction: the engine core takes requests in arrival order and the
holder's is sent first, so the holder finishes in the first step that schedules it, and the
engine pauses itself in that step (HoldingScheduler) with every other request of the call either
mid-decode or still waiting; nothing resumes it. Only the pool's generate timeout ends the call.

A module of its own: it imports the generator actor (and so Monarch), which the engine-core
process, importing held_engine.py for HOLD_PROMPT, must not.
"""

from __future__ import annotations

from forge_rl.actors.generator import GeneratorActor
from forge_rl.types import Episode
from tests.support.held_engine import HOLD_PROMPT, HoldableEngine


class HeldGeneratorActor(GeneratorActor):
    """GeneratorActor serving with a HoldableEngine (the pool's `generator_class`)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.engine = HoldableEngine(config, self.engine.cuda_devices)


def held_episode(episode_id: int) -> Episode:
    """The holder: put first in a generate call, it leaves the rest of the call held."""
    return Episode(episode_id, "holder", "", list(HOLD_PROMPT), forced_length=1)
