"""Compute threads per role chosen from the cores of the machine (`trainer.num_threads` and
`generator.cpu_threads` set to "auto").

A local run's compute processes share the machine's cores: each trainer rank runs torch with
`trainer.num_threads` threads, each CPU generator runs vLLM's worker with `generator.cpu_threads`.
More threads in all than cores makes each op's threads wait at every barrier on one that is
descheduled, so "auto" splits the cores instead of giving every role all of them:

1. Roles pinned to cores (`launch.placement.trainer_cpus` / `generator_cpus`) split their own
   cores among their processes.
2. The cores nobody pinned, less the threads of the roles set by number (frozen models, scorer
   models, a role not on "auto"), go in equal shares to the unpinned "auto" processes, at least
   one thread each.
3. What is left below one more share per process goes to the trainer ranks: a rank's forward and
   backward over the whole batch are wide matrix products that use more threads, where a
   generator's decode step of one token per sequence is narrow.

On 2 cores with one trainer rank and one generator this is one thread each.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeVar, cast

from forge_rl.errors import ConfigError


class _TrainerThreads(Protocol):
    """A dataclass config with `num_threads` (the trainer's)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def num_threads(self) -> int | Literal["auto"]: ...


class _GeneratorThreads(Protocol):
    """A dataclass config with `cpu_threads` (a generator's)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def cpu_threads(self) -> int | Literal["auto"]: ...


T = TypeVar("T", bound=_TrainerThreads)
G = TypeVar("G", bound=_GeneratorThreads)

AUTO = "auto"
"""The value of `trainer.num_threads` / `generator.cpu_threads` that asks for this rule."""


@dataclass(frozen=True)
class ThreadRoles:
    """The compute processes of a local run whose threads the rule chooses, and what else runs."""

    trainer_procs: int
    """Trainer ranks of every policy; 0: the trainer's threads are set by number (or simulated)."""
    generators: int
    """CPU generators of every policy; 0: their threads are set by number (or simulated)."""
    fixed_threads: int
    """Threads of the compute processes set by number that run on the unpinned cores."""


def choose_threads(
    cores: set[int],
    roles: ThreadRoles,
    trainer_cpus: tuple[int, ...] | None = None,
    generator_cpus: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """(threads per trainer rank, threads per generator) by the rule above; a role with no
    process chosen gets 0. `cores`: the cores this process may run on."""
    shared = len(set(cores) - set(trainer_cpus or ()) - set(generator_cpus or ()))
    trainer = _split(len(trainer_cpus), roles.trainer_procs) if trainer_cpus and roles.trainer_procs else 0
    generator = _split(len(generator_cpus), roles.generators) if generator_cpus and roles.generators else 0
    unpinned_trainer = roles.trainer_procs if not trainer_cpus else 0
    unpinned_generators = roles.generators if not generator_cpus else 0
    sharing = unpinned_trainer + unpinned_generators
    if sharing:
        free = max(0, shared - roles.fixed_threads)
        share = _split(free, sharing)
        left = max(0, free - share * sharing)
        if unpinned_trainer:
            trainer = share + left // unpinned_trainer
        if unpinned_generators:
            generator = share
    return trainer, generator


def _split(cores: int, processes: int) -> int:
    return max(1, cores // processes)


def with_chosen_threads(
    trainer: T | None,
    generator: G | None,
    *,
    trainer_procs: int,
    generators: int,
    fixed_threads: int = 0,
    trainer_cpus: tuple[int, ...] | None = None,
    generator_cpus: tuple[int, ...] | None = None,
    hosts: str = "local",
) -> tuple[T | None, G | None]:
    """`trainer` (a config with `num_threads`) and `generator` (one with `cpu_threads`), either
    None, with "auto" replaced by the rule's numbers for this process's cores. `trainer_procs` /
    `generators`: how many processes each config makes (0 for a simulated role, which runs no
    compute threads); a role set by number counts as `fixed_threads`. Refused unless `hosts` is
    "local" (`launch.hosts`): this process cannot count a worker host's cores."""
    trainer_auto = trainer is not None and trainer.num_threads == AUTO
    generator_auto = generator is not None and generator.cpu_threads == AUTO
    if not (trainer_auto or generator_auto):
        return trainer, generator
    if hosts != "local":
        names = [
            name
            for name, auto in (("trainer.num_threads", trainer_auto), ("generator.cpu_threads", generator_auto))
            if auto
        ]
        raise ConfigError(
            f"{' and '.join(names)} (auto) count the cores of this machine, but launch.hosts ({hosts}) places "
            "the roles on worker hosts. Set each to a number of threads per process on its host."
        )
    if trainer is not None and not trainer_auto:
        fixed_threads += trainer_procs * cast(int, trainer.num_threads)  # not "auto": a number
    if generator is not None and not generator_auto:
        fixed_threads += generators * cast(int, generator.cpu_threads)  # not "auto": a number
    roles = ThreadRoles(
        trainer_procs=trainer_procs if trainer_auto else 0,
        generators=generators if generator_auto else 0,
        fixed_threads=fixed_threads,
    )
    trainer_threads, generator_threads = choose_threads(os.sched_getaffinity(0), roles, trainer_cpus, generator_cpus)
    if trainer_auto and trainer is not None:
        trainer = dataclasses.replace(trainer, num_threads=max(1, trainer_threads))
    if generator_auto and generator is not None:
        generator = dataclasses.replace(generator, cpu_threads=max(1, generator_threads))
    return trainer, generator
