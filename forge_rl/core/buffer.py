"""The replay buffer: bounded, version-aware, group-preserving. Plain Python (no Monarch).

Invariant: no trainable token that depends on weights more than `max_policy_age` versions behind
the trainer ever leaves `sample()`; a token depends on the weights that sampled it and on those that
encoded the KV it attended to (`forge_rl.core.columns.exact_versions`). The bound is applied where
episodes enter (`put`, at the version the next batch trains
at: `WaitingBuffer.trainer_version`) and again where they leave (`sample`), because the trainer's
version advances while episodes wait. `drop_policy` decides what an over-age
token costs: its whole episode (`drop_episode`), or only itself (`mask_tokens`: the token is marked
untrainable in `Completion.trainable`; the completion's reward still counts for its group's
baseline). Whatever is lost is counted with its completion lengths (`dropped`), beside the lengths
of what was handed to the trainer (`trained`): dropping stale work biases training toward short
completions, and the two length distributions show by how much. Admission control, which pauses
generation so that nothing needs dropping, is `forge_rl.core.admission`.

The buffer never holds more than `capacity_episodes` episodes nor `capacity_tokens` tokens: `put`
without room raises `BufferFull`; `WaitingBuffer` turns that into backpressure (the producer
waits until `has_room`) and lets the train loop wait for a batch.

A run with several policies (`forge_rl.core.policies`) holds each completion to its own policy's
bound (`Completion.policy`), against that policy's own version: versions advance together, one
per batch, but a policy whose step was skipped stays a version behind the others from then on
(`policy_offsets`).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from forge_rl.core.columns import exact_versions
from forge_rl.types import Completion, Episode


class BufferFull(RuntimeError):
    """Raised by `put` when the episode does not fit (episodes or tokens); the producer must wait."""


@dataclass(frozen=True)
class BufferConfig:
    max_policy_age: int = 1
    """Largest allowed (trainer version - token version) of any trained token. 0 = synchronous RL."""
    capacity_episodes: int = 64
    """Most episodes (prompt groups) held at once; producers are paced when it is full."""
    capacity_tokens: int | None = None
    """Most tokens held at once (each episode's prompt plus all its completions); producers are paced
    when the next episode would not fit. None: bounded by capacity_episodes only."""
    drop_policy: Literal["drop_episode", "mask_tokens"] = "drop_episode"
    """What a token older than max_policy_age costs: its whole episode (drop_episode), or only itself
    (mask_tokens: it gets no loss; a completion left with no trainable token counts as dropped)."""
    admission: Literal["pause", "drop"] = "pause"
    """How the age bound is kept. pause: admission control (`forge_rl.core.admission`) starts a
    rollout only if its episodes can still be trained in time, and the trainer waits for
    stragglers that the next step is the last chance for, so nothing needs dropping. drop:
    generation never waits for the bound; episodes that grow too old are dropped (and counted,
    with their lengths, which skew long: `buffer/dropped_completion_len_*` vs
    `buffer/trained_completion_len_*`)."""
    wait_for_stragglers: bool = True
    """With admission pause: whether the trainer waits for an episode still being generated whose
    last chance under the age bound is the next step. False (partial rollouts): the trainer takes a
    batch as soon as a full one is buffered; a straggler decodes on past its deadline (the engine
    stamps its later tokens with the newer versions it decodes them under) and, once it arrives,
    is trained with every token that depends on weights older than max_policy_age masked
    (drop_policy mask_tokens, which this needs): under generator.swap_kv reuse its later tokens
    attend to the KV its start version encoded, and count as that version (`exact_versions`).
    It spends a long completion's oldest tokens to keep the trainer from idling on
    it; the masked tokens are counted (`buffer/dropped_tokens`)."""
    sampling: Literal["fifo", "freshest"] = "fifo"
    """Which episodes a batch takes first. fifo: the earliest admitted first (`Episode.schedule_version`:
    the version its rollout started at), in arrival order within a version, so an episode that
    finished late is trained before it can expire (what admission control relies on). freshest:
    the newest version first."""

    def __post_init__(self) -> None:
        if self.max_policy_age < 0:
            raise ValueError(
                f"buffer.max_policy_age ({self.max_policy_age}) must be >= 0. "
                "Use --buffer.max-policy-age 0 for synchronous RL."
            )
        if self.capacity_episodes < 1:
            raise ValueError(
                f"buffer.capacity_episodes ({self.capacity_episodes}) must be >= 1. "
                "Set --buffer.capacity-episodes to at least one step's prompts."
            )
        if self.sampling == "freshest" and self.admission == "pause":
            raise ValueError(
                "buffer.sampling (freshest) cannot go with buffer.admission (pause): admission control "
                "admits a rollout only if the oldest-first order trains it before it expires, and "
                "freshest-first lets an admitted episode age past buffer.max_policy_age while newer ones "
                "are trained (then it is dropped, or the trainer waits for it). Set --buffer.sampling fifo, "
                "or --buffer.admission drop to sample freshest-first and drop what expires."
            )
        if not self.wait_for_stragglers and self.admission == "drop":
            raise ValueError(
                "buffer.wait_for_stragglers (false) is an option of buffer.admission pause: with "
                "buffer.admission drop the trainer never waits for a straggler. Drop "
                "--buffer.no-wait-for-stragglers, or set --buffer.admission pause."
            )
        if not self.wait_for_stragglers and self.drop_policy == "drop_episode":
            raise ValueError(
                "buffer.wait_for_stragglers (false) with buffer.drop_policy (drop_episode) would drop a "
                "straggler that passed its deadline whole, every token it generated with it. Set "
                "--buffer.drop-policy mask_tokens (its tokens older than max_policy_age get no loss, "
                "the rest are trained), or keep --buffer.wait-for-stragglers."
            )
        if self.capacity_tokens is not None and self.capacity_tokens < 1:
            raise ValueError(
                f"buffer.capacity_tokens ({self.capacity_tokens}) must be >= 1, or unset. "
                "Set --buffer.capacity-tokens to at least one step's tokens."
            )


@dataclass
class CompletionTally:
    """What left the buffer one way (dropped, or handed to the trainer), with the length (generated
    tokens) of every completion counted, for the length-distribution metrics."""

    episodes: int = 0
    """Whole episodes."""
    completions: int = 0
    """Completions that had trainable tokens (dropped: that lost their last one)."""
    tokens: int = 0
    """Trainable tokens."""
    completion_lengths: dict[int, int] = field(default_factory=dict)
    """Histogram (length -> completions) of the completions counted in `completions`; bounded by
    generator.max_new_tokens, so a long run's memory does not grow with it."""
    episode_ids: list[int] | None = field(default_factory=list)
    """Id of each episode counted in `episodes`; None where they are not kept (the trained tally:
    the prompts' accounting holds which were trained at a byte a prompt, where this list would
    grow by a Python int an episode for the whole run and cross to every checkpoint)."""

    def length_metrics(self, prefix: str) -> dict[str, float]:
        """Mean, median, 90th percentile and max completion length, names starting with `prefix`."""
        histogram = sorted(self.completion_lengths.items()) or [(0, 1)]
        total = sum(count for _, count in histogram)

        def quantile(q: float) -> float:
            rank, seen = int(q * (total - 1)), 0
            for length, count in histogram:
                seen += count
                if seen > rank:
                    return float(length)
            return float(histogram[-1][0])

        return {
            f"{prefix}completion_len_mean": sum(length * count for length, count in histogram) / total,
            f"{prefix}completion_len_p50": quantile(0.5),
            f"{prefix}completion_len_p90": quantile(0.9),
            f"{prefix}completion_len_max": float(histogram[-1][0]),
        }

    def count_completion(self, completion: Completion, num_tokens: int) -> None:
        self.completions += 1
        self.tokens += num_tokens
        self.completion_lengths[completion.num_tokens] = self.completion_lengths.get(completion.num_tokens, 0) + 1

    def count_episode(self, episode: Episode) -> None:
        """The episode and each of its completions that has trainable tokens."""
        self.episodes += 1
        if self.episode_ids is not None:
            self.episode_ids.append(episode.episode_id)
        for completion in episode.completions:
            if completion.num_trainable_tokens:
                self.count_completion(completion, completion.num_trainable_tokens)


class ReplayBuffer:
    def __init__(self, config: BufferConfig, max_ages: Mapping[str | None, int] | None = None):
        self.config = config
        self.max_ages: dict[str | None, int] = {None: config.max_policy_age, **(max_ages or {})}
        """Each policy's age bound, by `Completion.policy` (None: the run's own, buffer.max_policy_age)."""
        self.policy_offsets: dict[str, int] = {}
        """Per other policy, its version minus the run's own policy's (0 unless one's step was
        skipped and the other's was not); set with `set_policy_offsets`."""
        self._episodes: collections.deque[Episode] = collections.deque()
        self._num_tokens = 0
        """Tokens of the held episodes."""
        self._oldest_versions: collections.Counter[int] = collections.Counter()
        """`_expiry` of each held episode with completions: while the least of them is at least
        the trainer's version, `evict_stale` needs no pass over the held tokens."""
        self.dropped = CompletionTally()
        """Lost to the age bound."""
        self.trained = CompletionTally(episode_ids=None)
        """Handed to the trainer by `sample`."""

    def __len__(self) -> int:
        return len(self._episodes)

    @property
    def num_tokens(self) -> int:
        """Tokens held (what capacity_tokens bounds)."""
        return self._num_tokens

    def _held(self, episodes: list[Episode]) -> None:
        """Set the held episodes, and the counts kept beside them."""
        self._episodes = collections.deque(episodes)
        self._num_tokens = sum(e.num_tokens for e in episodes)
        self._oldest_versions = collections.Counter(self._expiry(e) for e in episodes if e.completions)

    def set_policy_offsets(self, offsets: Mapping[str, int]) -> None:
        """Each other policy's version minus the run's own policy's, from now on."""
        offsets = {policy: offset for policy, offset in offsets.items() if offset}
        if offsets != self.policy_offsets:
            self.policy_offsets = offsets
            self._held(list(self._episodes))  # the held episodes' expiries move with them

    def _oldest_allowed(self, policy: str | None, trainer_version: int) -> int:
        """The oldest version of `policy` whose tokens train at the run's own `trainer_version`."""
        offset = 0 if policy is None else self.policy_offsets.get(policy, 0)
        return trainer_version + offset - self.max_ages[policy]

    def _expiry(self, episode: Episode) -> int:
        """The newest trainer version (the run's own policy's) at which none of the episode's
        tokens is over its policy's age bound (counted from each completion's oldest version)."""
        if len(self.max_ages) == 1:  # one policy: no walk over the completions
            return episode.oldest_policy_version + self.config.max_policy_age
        return min(c.oldest_policy_version - self._oldest_allowed(c.policy, 0) for c in episode.completions)

    @property
    def num_free_slots(self) -> int:
        return self.config.capacity_episodes - len(self._episodes)

    def schedule_versions(self) -> list[int]:
        """`Episode.schedule_version` of each held episode (what the admission gate counts)."""
        return [e.schedule_version for e in self._episodes]

    def has_room(self, episode: Episode) -> bool:
        """Whether `put(episode)` fits now, in episodes and in tokens."""
        capacity_tokens = self.config.capacity_tokens
        fits_tokens = capacity_tokens is None or self.num_tokens + episode.num_tokens <= capacity_tokens
        return self.num_free_slots > 0 and fits_tokens

    def put(self, episode: Episode, trainer_version: int) -> bool:
        """Add an episode; returns False if the age bound left it nothing to train (it is counted).

        Raises BufferFull when it does not fit now, and ValueError when it never can.
        """
        capacity_tokens = self.config.capacity_tokens
        if capacity_tokens is not None and episode.num_tokens > capacity_tokens:
            raise ValueError(
                f"episode {episode.episode_id} holds {episode.num_tokens} tokens, more than "
                f"buffer.capacity_tokens ({capacity_tokens}); it could never be stored. Raise "
                "--buffer.capacity-tokens to at least group_size * (prompt + generator.max_new_tokens)."
            )
        aged = self._apply_age_bound(episode, trainer_version)
        if aged is None:
            return False
        if not self.has_room(aged):
            raise BufferFull(
                f"replay buffer holds {len(self._episodes)} episodes and {self.num_tokens} tokens; "
                f"episode {episode.episode_id} ({episode.num_tokens} tokens) does not fit"
            )
        self._episodes.append(aged)
        self._num_tokens += aged.num_tokens
        if aged.completions:
            self._oldest_versions[self._expiry(aged)] += 1
        return True

    def evict_stale(self, trainer_version: int) -> list[Episode]:
        """Apply the age bound at `trainer_version` to every held episode; returns the dropped ones."""
        if min(self._oldest_versions, default=trainer_version) >= trainer_version:
            return []  # nothing held is over age (admission control keeps it so)
        aged = [(e, self._apply_age_bound(e, trainer_version)) for e in self._episodes]
        self._held([kept for _, kept in aged if kept is not None])
        return [e for e, kept in aged if kept is None]

    def sample(self, num_episodes: int, trainer_version: int) -> list[Episode] | None:
        """Take `num_episodes` whole groups trainable at `trainer_version`, or None if too few."""
        self.evict_stale(trainer_version)
        if len(self._episodes) < num_episodes:
            return None
        # sorted() is stable: episodes of one version keep their arrival order.
        self._episodes = collections.deque(
            sorted(self._episodes, key=lambda e: e.schedule_version, reverse=self.config.sampling == "freshest")
        )
        batch = [self._episodes.popleft() for _ in range(num_episodes)]
        for episode in batch:
            self.trained.count_episode(episode)
            self._num_tokens -= episode.num_tokens
            if episode.completions:
                self._oldest_versions[self._expiry(episode)] -= 1
        self._oldest_versions = +self._oldest_versions  # drops the versions none holds
        return batch

    def state_dict(self, include_episodes: bool = True) -> dict[str, Any]:
        """Held episodes (in order; none unless `include_episodes`) and both tallies, as plain
        lists, numbers and strings."""
        return {
            "episodes": [e.to_dict() for e in self._episodes] if include_episodes else [],
            "dropped": dataclasses.asdict(self.dropped),
            "trained": dataclasses.asdict(self.trained),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; the buffer then behaves exactly as the saved one did."""
        state = copy.deepcopy(state)
        episodes = [Episode.from_dict(e) for e in state["episodes"]]
        if len(episodes) > self.config.capacity_episodes:
            raise ValueError(
                f"buffer.capacity_episodes ({self.config.capacity_episodes}) is below the {len(episodes)} "
                "episodes in the checkpoint. Raise --buffer.capacity-episodes."
            )
        num_tokens = sum(e.num_tokens for e in episodes)
        if self.config.capacity_tokens is not None and num_tokens > self.config.capacity_tokens:
            raise ValueError(
                f"buffer.capacity_tokens ({self.config.capacity_tokens}) is below the {num_tokens} tokens "
                "in the checkpoint. Raise --buffer.capacity-tokens."
            )
        self._held(episodes)
        self.dropped = _tally_from_dict(state["dropped"])
        self.trained = dataclasses.replace(
            _tally_from_dict(state["trained"]), episode_ids=None
        )  # an older checkpoint kept them

    def _apply_age_bound(self, episode: Episode, trainer_version: int) -> Episode | None:
        """`episode` with no trainable token older than its policy's age bound, or None if it is
        dropped; counts what was lost. Returns `episode` itself when nothing was over age."""
        if not episode.completions or self._expiry(episode) >= trainer_version:
            return episode  # the common case, without copying any token list
        aged = dataclasses.replace(
            episode,
            completions=[
                _without_tokens_before(c, self._oldest_allowed(c.policy, trainer_version)) for c in episode.completions
            ],
        )
        if aged.num_trainable_tokens == episode.num_trainable_tokens:
            return episode
        if self.config.drop_policy == "drop_episode" or aged.num_trainable_tokens == 0:
            self.dropped.count_episode(episode)
            return None
        for before, after in zip(episode.completions, aged.completions):
            lost = before.num_trainable_tokens - after.num_trainable_tokens
            if lost and after.num_trainable_tokens == 0:
                self.dropped.count_completion(before, lost)
            elif lost:
                self.dropped.tokens += lost
        return aged


class WaitingBuffer:
    """The replay buffer with waiting, for one event loop (the rollouts' process,
    `forge_rl.pipeline.rollouts`): `put` waits for room, `sample` waits for a batch."""

    def __init__(self, config: BufferConfig, max_ages: Mapping[str | None, int] | None = None):
        self.buffer = ReplayBuffer(config, max_ages)
        self.trainer_version = 0
        """Version the next sampled batch trains at; staleness is measured against it, at `put`
        too, so an episode that batch could not train is refused at once instead of held until the
        next `sample` evicts it. A batch taken at v leaves it at v + 1 (the trainer publishes a
        version per batch), a skipped step takes it back to v (`step_skipped`), as the admission
        gate counts `next_train_version`."""
        self.changed = asyncio.Condition()

    async def put(self, episodes: list[Episode]) -> int:
        """Adds episodes, waiting while the buffer is full; returns how many were too stale to keep."""
        num_stale = 0
        async with self.changed:
            for episode in episodes:
                await self.changed.wait_for(functools.partial(self.buffer.has_room, episode))
                num_stale += not self.buffer.put(episode, self.trainer_version)
            self.changed.notify_all()
        return num_stale

    async def sample(self, num_episodes: int, trainer_version: int) -> tuple[list[Episode], list[int], float]:
        """Waits until `num_episodes` groups trainable at `trainer_version` are available.

        Returns the batch, the `schedule_version` of each held episode this call evicted as stale
        (the admission gate's bookkeeping), and the seconds it waited for episodes to arrive (the
        train loop's data wait). Episodes that `put` refused meanwhile are not among the evicted:
        `put` reports those to its own caller, and counting them twice would make the admission
        gate admit too much.
        """
        evicted: list[Episode] = []
        waited_s = 0.0
        async with self.changed:
            self.trainer_version = trainer_version
            while True:
                evicted += self.buffer.evict_stale(trainer_version)
                batch = self.buffer.sample(num_episodes, trainer_version)
                if batch is not None:
                    break
                self.changed.notify_all()  # eviction may have freed room for waiting producers
                wait_start = time.perf_counter()
                await self.changed.wait()
                waited_s += time.perf_counter() - wait_start
            self.trainer_version += 1
            self.changed.notify_all()
        return batch, [e.schedule_version for e in evicted], waited_s

    def step_skipped(self) -> None:
        """The last batch's step was skipped (non-finite loss): no version was published, so the
        next batch trains at the version that one did."""
        self.trainer_version -= 1

    async def load_state_dict(self, state: dict, trainer_version: int) -> list[int]:
        """Restore a checkpoint's buffer; returns the `schedule_version` of each episode it holds now."""
        async with self.changed:
            self.buffer.load_state_dict(state)
            self.trainer_version = trainer_version
            self.changed.notify_all()
        return self.buffer.schedule_versions()

    def stats(self) -> dict:
        dropped = self.buffer.dropped
        return {
            "buffer/size": len(self.buffer),
            "buffer/trainer_version": self.trainer_version,
            "buffer/tokens": self.buffer.num_tokens,
            "buffer/dropped_episodes": dropped.episodes,
            "buffer/dropped_completions": dropped.completions,
            "buffer/dropped_tokens": dropped.tokens,
            **dropped.length_metrics("buffer/dropped_"),
            **self.buffer.trained.length_metrics("buffer/trained_"),
        }


def _tally_from_dict(state: dict[str, Any]) -> CompletionTally:
    # A JSON round trip turns the histogram's int keys into strings.
    lengths = {int(length): count for length, count in state["completion_lengths"].items()}
    return CompletionTally(**{**state, "completion_lengths": lengths})


def _without_tokens_before(completion: Completion, oldest_allowed_version: int) -> Completion:
    """`completion` with every token that depends on weights older than `oldest_allowed_version`
    marked untrainable: by `exact_versions`, not by the version that sampled it, since a straggler
    that decoded on across swaps that kept its KV attends to a prefix encoded by the version it
    started at, however new the weights that sample its later tokens (context tokens, -1 there,
    never reach a loss and keep their mark)."""
    depends_on = exact_versions(completion)
    assert completion.trainable is not None  # __post_init__ fills it
    trainable = [t and (v < 0 or v >= oldest_allowed_version) for t, v in zip(completion.trainable, depends_on)]
    return dataclasses.replace(completion, trainable=trainable)
