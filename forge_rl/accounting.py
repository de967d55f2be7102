"""Where every prompt went: trained exactly once, dropped by the staleness bound, filtered by
dynamic sampling, skipped for a non-finite step, or unfinished.

Episode ids are dataset cursor positions (0, 1, 2, ...), so one byte per id counts how often each
was trained: a run of a million prompts costs a megabyte.
"""

from __future__ import annotations

import dataclasses

from forge_rl.types import Episode


@dataclasses.dataclass
class PromptAccounting:
    handed_out: int = 0
    """Prompts the dataset handed out (a re-queued prompt is not handed out again)."""
    requeued: int = 0
    """Times a prompt was generated again because its generator died mid-request."""
    skipped_nonfinite: int = 0
    """Prompts of batches whose step was skipped for a NaN/inf loss or gradient (never trained)."""
    filtered_zero_advantage: int = 0
    """Prompts whose whole group scored the same, filtered out by dynamic sampling (never trained)."""
    _times_trained: bytearray = dataclasses.field(default_factory=bytearray)

    def count_trained(self, episodes: list[Episode]) -> None:
        for episode in episodes:
            if episode.episode_id >= len(self._times_trained):
                self._times_trained.extend(bytes(episode.episode_id + 1 - len(self._times_trained)))
            self._times_trained[episode.episode_id] = min(self._times_trained[episode.episode_id] + 1, 255)

    def summary(self, num_dropped: int) -> dict:
        """Counts that add up: handed_out = trained + dropped + skipped_nonfinite +
        filtered_zero_advantage + unfinished_at_stop."""
        trained = sum(1 for count in self._times_trained if count)
        return {
            "prompts_handed_out": self.handed_out,
            "trained": trained,
            "dropped": num_dropped,
            "skipped_nonfinite": self.skipped_nonfinite,
            "filtered_zero_advantage": self.filtered_zero_advantage,
            "unfinished_at_stop": self.handed_out
            - trained
            - num_dropped
            - self.skipped_nonfinite
            - self.filtered_zero_advantage,
            "trained_more_than_once": sum(1 for count in self._times_trained if count > 1),
            "requeued_after_generator_failure": self.requeued,
        }
