"""Admission control: start a rollout only if its episodes can be trained within the age bound.

Episodes are trained in the order they were handed out (FIFO), `episodes_per_step` at a time, so
the j-th queued episode will be trained at version `next_train_version + j // episodes_per_step`.
A rollout of `num_new_episodes` generated under `generator_version` is admitted only if the last of
its episodes will then be at most `max_policy_age` versions old. Pausing generation here, instead of
generating and dropping, keeps long completions from being starved (they are the ones a drop would
hit). The buffer still enforces the bound on its own; this gate only avoids wasted work.

Completions finish out of order, so a slow episode can be overtaken by later ones and miss the last
batch that may train it. The train loop therefore also waits (`batch_may_be_sampled`) until every
episode that the coming step is the last chance for has reached the buffer, and the buffer serves
the stalest episodes first. Together: nothing the gate admitted is ever dropped.
"""

from __future__ import annotations


def rollout_may_start(
    generator_version: int,
    next_train_version: int,
    num_episodes_queued: int,
    num_new_episodes: int,
    episodes_per_step: int,
    max_policy_age: int,
) -> bool:
    last_position = num_episodes_queued + num_new_episodes - 1
    train_version_of_last = next_train_version + last_position // episodes_per_step
    return train_version_of_last - generator_version <= max_policy_age


def batch_may_be_sampled(in_flight_versions: dict[int, int], train_version: int, max_policy_age: int) -> bool:
    """False while an episode started at a version that this step is the last to accept is still
    being generated (`in_flight_versions`: start version -> episodes in flight)."""
    last_chance_version = train_version - max_policy_age
    return not any(count > 0 and version <= last_chance_version for version, count in in_flight_versions.items())
