"""Where every prompt went: trained exactly once, dropped by the staleness bound, filtered by
dynamic sampling, skipped for a non-finite step, or unfinished.

Episode ids are dataset prompt indices (0, 1, 2, ...), so one byte per id counts how often each
was trained: a run of a million prompts costs a megabyte. The counts survive a resume
(`state_dict`): a checkpoint re-issues the prompts it left unsettled (`forge_rl.core.checkpoint`), and
`trained_more_than_once` then covers the whole run, across resumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from forge_rl.types import Episode


@dataclasses.dataclass
class PromptAccounting:
    handed_out: int = 0
    """Prompts the dataset handed out (a re-queued prompt is not handed out again; a prompt
    re-issued after a resume is, since the checkpoint did not count it)."""
    requeued: int = 0
    """Times a prompt was generated again because its generator died mid-request."""
    continued_after_generator_failure: int = 0
    """Times a re-queued prompt's group continued from what its dead generator had sampled
    (generator.segment_tokens) instead of starting afresh."""
    continued_after_resume: int = 0
    """Prompts re-issued after a resume whose group continued from the checkpoint's partial group
    (generator.segment_tokens) instead of starting afresh."""
    salvaged_tokens: int = 0
    """Tokens sampled before a generator died or the run was checkpointed that such a
    continuation kept."""
    salvage_discarded_tokens: int = 0
    """Such tokens thrown away instead, already too old to be trained
    (`forge_rl.pipeline.rollouts.Rollouts._salvage`)."""
    turns_moved_after_generator_failure: int = 0
    """Turns of environment episodes sampled again on another generator because theirs was lost
    mid-turn: the episodes so far, and their environments, were kept."""
    reissued_after_resume: int = 0
    """Prompts that were unsettled at the checkpoint a resume started from, so were handed out again."""
    skipped_ids: list[int] = dataclasses.field(default_factory=list)
    """Prompts of batches whose step was skipped for a NaN/inf loss or gradient (never trained)."""
    filtered_ids: list[int] = dataclasses.field(default_factory=list)
    """Prompts whose whole group scored the same, filtered out by dynamic sampling (never trained)."""
    _times_trained: bytearray = dataclasses.field(default_factory=bytearray)

    def count_trained(self, episodes: list[Episode]) -> None:
        for episode in episodes:
            if episode.episode_id >= len(self._times_trained):
                self._times_trained.extend(bytes(episode.episode_id + 1 - len(self._times_trained)))
            self._times_trained[episode.episode_id] = min(self._times_trained[episode.episode_id] + 1, 255)

    def count_skipped(self, episodes: list[Episode]) -> None:
        self.skipped_ids.extend(episode.episode_id for episode in episodes)

    def count_filtered(self, episodes: list[Episode]) -> None:
        self.filtered_ids.extend(episode.episode_id for episode in episodes)

    def untrained_ids(self, below: int) -> Iterator[int]:
        """Prompt indices below `below` never trained, ascending: the zeros of the one-byte-a-prompt
        tally, found by C scans (a few in flight among a long run's many thousands trained)."""
        counts, end = self._times_trained, min(below, len(self._times_trained))
        index = counts.find(0, 0, end)
        while index != -1:
            yield index
            index = counts.find(0, index + 1, end)
        yield from range(end, below)  # past the tally's end: none trained yet

    def unsettled_ids(self, below: int, settled_elsewhere: Iterable[int]) -> list[int]:
        """Prompt indices below `below` neither trained, skipped, filtered nor in
        `settled_elsewhere` (dropped by the buffer, or held in a checkpoint's buffer): what a
        resume hands out again (`forge_rl.core.checkpoint`). Made where the accounting is, so a
        checkpoint sends no list of every settled prompt across processes."""
        settled = {*self.skipped_ids, *self.filtered_ids, *settled_elsewhere}
        return [index for index in self.untrained_ids(below) if index not in settled]

    def summary(self, num_dropped: int) -> dict:
        """Counts that add up: handed_out = trained + dropped + skipped_nonfinite +
        filtered_zero_advantage + unfinished_at_stop."""
        trained = sum(1 for count in self._times_trained if count)
        num_skipped, num_filtered = len(self.skipped_ids), len(self.filtered_ids)
        return {
            "prompts_handed_out": self.handed_out,
            "trained": trained,
            "dropped": num_dropped,
            "skipped_nonfinite": num_skipped,
            "filtered_zero_advantage": num_filtered,
            "unfinished_at_stop": self.handed_out - trained - num_dropped - num_skipped - num_filtered,
            "trained_more_than_once": sum(1 for count in self._times_trained if count > 1),
            "requeued_after_generator_failure": self.requeued,
            "continued_after_generator_failure": self.continued_after_generator_failure,
            "continued_after_resume": self.continued_after_resume,
            "salvaged_tokens": self.salvaged_tokens,
            "salvage_discarded_tokens": self.salvage_discarded_tokens,
            "turns_moved_after_generator_failure": self.turns_moved_after_generator_failure,
            "reissued_after_resume": self.reissued_after_resume,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything but `handed_out`, which a resume derives from the prompts it re-issues."""
        return {
            "requeued": self.requeued,
            "continued_after_generator_failure": self.continued_after_generator_failure,
            "continued_after_resume": self.continued_after_resume,
            "salvaged_tokens": self.salvaged_tokens,
            "salvage_discarded_tokens": self.salvage_discarded_tokens,
            "turns_moved_after_generator_failure": self.turns_moved_after_generator_failure,
            "reissued_after_resume": self.reissued_after_resume,
            "skipped_ids": list(self.skipped_ids),
            "filtered_ids": list(self.filtered_ids),
            "times_trained": self._times_trained.hex(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], handed_out: int) -> PromptAccounting:
        return cls(
            handed_out=handed_out,
            requeued=state["requeued"],
            continued_after_generator_failure=state.get("continued_after_generator_failure", 0),
            continued_after_resume=state.get("continued_after_resume", 0),
            salvaged_tokens=state.get("salvaged_tokens", 0),
            salvage_discarded_tokens=state.get("salvage_discarded_tokens", 0),
            turns_moved_after_generator_failure=state.get("turns_moved_after_generator_failure", 0),
            reissued_after_resume=state["reissued_after_resume"],
            skipped_ids=list(state["skipped_ids"]),
            filtered_ids=list(state["filtered_ids"]),
            _times_trained=bytearray.fromhex(state["times_trained"]),
        )
