"""The policies of a run: which seats of a multi-agent environment each plays and trains, and the
age bound each one's tokens are held to. Plain Python (no Monarch, vLLM or torch).

A run trains its own policy (MAIN_POLICY: the model, trainer and generators its config describes)
and, with `policies` set, one more per entry: a policy of its own weights, from the same starting
model, with its own trainer, generators, weight store and version count. A seat an entry names is
played by that policy's generators, and its tokens train that policy only; every other seat is the
run's own policy's. Each step trains every policy on its part of the batch, so versions advance
together, step by step, unless a policy's step is skipped (a non-finite loss): its version then
stays, the others' advance, and each token's age is counted against its own policy's version."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from forge_rl.errors import ConfigError
from forge_rl.types import Episode

MAIN_POLICY = "main"
"""The run's own policy, in per-policy metrics (`policy_version/main`); `Completion.policy` None."""

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class PolicyConfig:
    """One more policy of the run (docs/environments.md, "Several policies")."""

    name: str
    """Its name in metrics, processes.json and `Completion.policy`: lower-case letters, digits
    and underscores, a letter first; not "main" (the run's own policy)."""
    seats: tuple[str, ...] = ()
    """The environment's seats it plays and trains (at least one; `Seat.name`s)."""
    max_policy_age: int | None = None
    """The most versions of this policy any of its trained tokens may be behind its trainer;
    None: buffer.max_policy_age."""
    lr: float | None = None
    """Its trainer's learning rate; None: trainer.lr."""
    num_generators: int = 1
    """Generators serving its weights; a rollout on the run's generator i samples this policy's
    turns on its generator i mod num_generators."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name == MAIN_POLICY:
            raise ConfigError(
                f"policies: name {self.name!r} is not a policy name: use lower-case letters, digits and "
                f"underscores, a letter first, at most 32 characters, and not {MAIN_POLICY!r} (the run's own policy)."
            )
        if not self.seats:
            raise ConfigError(f"policies.{self.name}.seats is empty: name the environment seats this policy plays.")
        if self.max_policy_age is not None and self.max_policy_age < 0:
            raise ConfigError(
                f"policies.{self.name}.max_policy_age ({self.max_policy_age}) must be >= 0, or unset for buffer.max_policy_age."
            )
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"policies.{self.name}.lr ({self.lr}) must be > 0, or unset for trainer.lr.")
        if self.num_generators < 1:
            raise ConfigError(f"policies.{self.name}.num_generators ({self.num_generators}) must be >= 1.")


class Policies:
    """The run's policies resolved: who plays each seat, and each policy's age bound."""

    def __init__(self, extra: Iterable[PolicyConfig], default_max_policy_age: int):
        self.extra = tuple(extra)
        self.default_max_policy_age = default_max_policy_age
        names = [p.name for p in self.extra]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"policies: {repeated} named more than once; give each policy its own name.")
        self._seat_policy: dict[str, str] = {}
        for policy in self.extra:
            for seat in policy.seats:
                if seat in self._seat_policy:
                    raise ConfigError(
                        f"policies: seat {seat!r} is named by both {self._seat_policy[seat]!r} and {policy.name!r}; "
                        "a seat is played by one policy."
                    )
                self._seat_policy[seat] = policy.name
        self.max_ages: dict[str | None, int] = {
            None: default_max_policy_age,
            **{p.name: default_max_policy_age if p.max_policy_age is None else p.max_policy_age for p in self.extra},
        }
        """Each policy's age bound, by `Completion.policy` (None: the run's own)."""

    @property
    def names(self) -> list[str]:
        """Every policy of the run, its own first."""
        return [MAIN_POLICY, *(p.name for p in self.extra)]

    def of_agent(self, agent: str | None) -> str | None:
        """The policy (`Completion.policy`) of an agent ("solver/2" is seat "solver"'s); None: the
        run's own."""
        if agent is None:
            return None
        return self._seat_policy.get(agent.split("/", 1)[0])

    def of_seat(self, seat: str) -> str | None:
        return self._seat_policy.get(seat)

    def max_age(self, policy: str | None) -> int:
        return self.max_ages[policy]

    def check_seats(self, trainable: Mapping[str, bool], environment: str) -> None:
        """ConfigError naming a seat a policy names that the environment does not declare, or
        declares untrainable (`Seat.trainable`: its turns would train no policy). `trainable`:
        each declared seat's."""
        declared = list(trainable)
        for policy in self.extra:
            unknown = [s for s in policy.seats if s not in trainable]
            if unknown:
                raise ConfigError(
                    f"policies.{policy.name}.seats names {unknown}, which environment {environment!r} does not "
                    f"declare (its seats: {declared}). Name seats the environment has."
                )
            frozen = [s for s in policy.seats if not trainable[s]]
            if frozen:
                raise ConfigError(
                    f"policies.{policy.name}.seats names {frozen}, which environment {environment!r} declares "
                    "untrainable (Seat.trainable false): no token of theirs would train the policy. Leave them "
                    "to the run's own policy."
                )


def metric_name(policy: str | None) -> str:
    """A policy's name in metrics: MAIN_POLICY for the run's own."""
    return MAIN_POLICY if policy is None else policy


def episodes_of_policy(episodes: list[Episode], policy: str | None) -> list[Episode]:
    """The part of a batch one policy trains: each episode with only that policy's completions
    (`Completion.policy`), in order; an episode with none of them is left out. Advantages are
    baselined within a seat (`Completion.baseline_group`), and a seat is one policy's, so each
    part's advantages are those of the whole batch."""
    parts = []
    for episode in episodes:
        mine = [c for c in episode.completions if c.policy == policy]
        if mine:
            parts.append(dataclasses.replace(episode, completions=mine))
    return parts
