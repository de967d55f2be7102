"""A generator pool whose generator 0, in its first incarnation, holds the first continuation of a
group it is asked for (a segment after the first, generator.segment_tokens), for the migration
test (tests/integration/test_segment_migration.py): the group's first segment has been sampled and
returned, its next one never returns, and the test kills the generator while it is held.

What it held is written to HOLD_DIR_ENV's directory as held.json: the prompt, and each completion's
first piece as generator 0 returned it (token ids, logprobs, policy versions), which the trained
completion must begin with. A test fake: no library code holds a request.

A module of its own: the pool's process imports it (the pool spawns `SegmentHoldingGenerator`).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from monarch.actor import concurrent_endpoint

from forge_rl.actors.generator import GeneratorActor
from forge_rl.actors.generator_pool import GeneratorPool
from forge_rl.types import Completion

HOLD_DIR_ENV = "FORGE_RL_TEST_HOLD_DIR"
HELD_FILE = "held.json"
HOLDER = "generator0-r1"
"""The incarnation that holds (its weight-store reader id): a replacement serves normally."""


class SegmentHoldingGenerator(GeneratorActor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_pieces: dict[tuple[int, ...], list[Completion]] = {}
        self.holding = False

    @concurrent_endpoint
    async def generate_segment(self, prompt_token_ids, forced_length, heads, group_size, segment_tokens):
        if self.store_client_id != HOLDER:
            return await self._segment(prompt_token_ids, forced_length, heads, group_size, segment_tokens)
        key = tuple(prompt_token_ids)
        if heads is None:
            pieces = await self._segment(prompt_token_ids, forced_length, heads, group_size, segment_tokens)
            self.first_pieces[key] = [piece for piece, _ in pieces]
            return pieces
        if self.holding or key not in self.first_pieces:
            return await self._segment(prompt_token_ids, forced_length, heads, group_size, segment_tokens)
        self.holding = True
        first = self.first_pieces[key]
        held = {
            "prompt_token_ids": prompt_token_ids,
            "first_pieces": [
                {"token_ids": p.token_ids, "logprobs": p.logprobs, "policy_versions": p.policy_versions} for p in first
            ],
            "heads": heads,
        }
        path = Path(os.environ[HOLD_DIR_ENV]) / HELD_FILE
        path.with_suffix(".tmp").write_text(json.dumps(held))
        path.with_suffix(".tmp").rename(path)  # whole, or not there
        await asyncio.Event().wait()  # held until the test kills this process


class SegmentHoldingPool(GeneratorPool):
    """The run's generator pool, its generators `SegmentHoldingGenerator`s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, generator_class=SegmentHoldingGenerator, **kwargs)
