"""Named fakes for unit tests of core logic: stand-ins for actor handles, never for the real path.

A fake endpoint has the shape the loops call (`call_one`, and `call` whose result has
`.items()`, read by forge_rl/plumbing/replies.py), so forge_rl/run/loop.py runs against it without Monarch. `FakeGenerate` samples
scripted turns for forge_rl/envs/runner.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from forge_rl.envs.runner import ContextExhausted, SampledTurn
from forge_rl.tasks.synthetic import make_prompt
from forge_rl.types import Completion, Episode


class FakeEndpoint:
    def __init__(self, function: Callable[..., Awaitable[Any]]):
        self.function = function

    async def call_one(self, *args, **kwargs):
        return await self.function(*args, **kwargs)

    async def call(self, *args, **kwargs):
        return FakeValues(await self.function(*args, **kwargs))


class FakeValues:
    """What Monarch's `call()` returns, for a mesh of one."""

    def __init__(self, value):
        self.value = value

    def items(self):
        yield {"procs": 0}, self.value


class FakeActorError(Exception):
    """Stands in for Monarch's ActorError: the endpoint's exception travels as `.exception`."""

    def __init__(self, exception: BaseException):
        super().__init__(f"actor failed: {exception!r} (traceback of the remote process)")
        self.exception = exception


def endpoints(**functions) -> Any:
    """An object whose attributes are FakeEndpoints: `endpoints(stats=f).stats.call_one()`."""
    return type("FakeActor", (), {name: FakeEndpoint(f) for name, f in functions.items()})()


def pulling_trainer(train_step: Callable[[list[Episode]], Awaitable[Any]], rollouts: Any) -> Any:
    """A FAKE trainer mesh of one rank for the train loop: its `train_next_step` takes the step's
    batch from the rollouts as the real trainer does (forge_rl/training/trainer_steps.py
    `train_on_pulled_batch`), asking for the next step's ahead when told to, and trains it with
    `train_step(episodes)` (also reachable as `.train_step.function`). One call at a time, in the
    order they arrive, as Monarch runs the real trainer's plain endpoint.

    The batch comes as columns; `train_step` gets the episodes they were made of, which
    `rollouts` (the real Rollouts) holds while the step trains, after checking that the columns
    are exactly those episodes'."""
    from forge_rl.core.columns import batch_columns
    from forge_rl.training.trainer_steps import BatchPrefetch, train_on_pulled_batch

    prefetch, one_at_a_time = BatchPrefetch(), asyncio.Lock()
    loss = rollouts.config.trainer.loss

    async def train_next_step(step, rollouts_actor, num_ranks, prefetch_next):
        async def train_the_taken_episodes(columns):
            episodes = rollouts.taken[step].episodes
            assert columns == batch_columns(episodes, loss.normalize_advantage_std, loss.step_discount)
            return await train_step(episodes)

        async with one_at_a_time:
            return await train_on_pulled_batch(
                step, rollouts_actor, num_ranks, train_the_taken_episodes, prefetch, prefetch_next
            )

    async def wait_for_publish():
        pass

    trainer = endpoints(train_next_step=train_next_step, wait_for_publish=wait_for_publish)
    trainer.train_step = FakeEndpoint(train_step)
    return trainer


def local_actor(obj: Any, *names: str) -> Any:
    """`obj`'s methods `names` behind FakeEndpoints: the loops call a real object (not a fake) in
    this event loop as they would call it as an actor."""

    def as_async(method):
        async def call(*args, **kwargs):
            result = method(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return call

    return endpoints(**{name: as_async(getattr(obj, name)) for name in names})


class FakePrompts:
    """Prompts of the max_of_two task with three-token prompts (no tokenizer): the rollouts' view of
    forge_rl/pipeline/prompts.py."""

    tokenizer_fingerprint = None

    def __init__(self):
        self.cursor = 0

    def next_episodes(self, num_prompts: int) -> list[Episode]:
        episodes = []
        for _ in range(num_prompts):
            prompt = make_prompt("max_of_two", 0, self.cursor)
            episodes.append(Episode(self.cursor, prompt.text, prompt.answer, [1, 2, 3]))
            self.cursor += 1
        return episodes

    def state(self) -> dict:
        return {"cursor": self.cursor, "reissue": []}

    def load_state(self, cursor: int, reissue: list[int], data_fingerprint: str | None = None) -> None:
        self.cursor = cursor

    def stats(self) -> dict:
        return {}


def completions_for(episode: Episode, group_size: int, policy_version: int) -> list[Completion]:
    """`group_size` two-token completions sampled at `policy_version`, half of them rewarded."""
    return [Completion([5, 2], [-0.5, -0.5], [policy_version] * 2, reward=float(i % 2)) for i in range(group_size)]


class FakeLifecycle:
    """Checkpoints nothing and never stops: the loops' view of forge_rl/run/lifecycle.py."""

    step_at_stop_s = 30.0

    def checkpoint_due(self, step: int) -> bool:
        return False

    async def after_step(self, pipeline) -> None:
        pass

    @property
    def stop_waits_for_steps(self) -> bool:
        return False

    def stop_began(self) -> None:
        pass

    def stop_timeout(self, bound_s: float) -> float:
        return bound_s

    async def checkpoint_at_stop(self, pipeline) -> None:
        pass


class FakeGenerate:
    """A fake of a generator's turn sampler (forge_rl/envs/runner.py `GenerateTurn`): returns the
    scripted turns in order, cut to the budget it is given as an engine would ("length"), and
    records every prefix and budget it was asked for."""

    def __init__(self, turns: list[SampledTurn]):
        self.turns = list(turns)
        self.calls: list[tuple[list[int], int]] = []

    async def __call__(self, prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        self.calls.append((list(prefix_token_ids), max_new_tokens))
        turn = self.turns.pop(0)
        if len(turn.token_ids) <= max_new_tokens:
            return turn
        return SampledTurn(
            turn.token_ids[:max_new_tokens],
            turn.logprobs[:max_new_tokens],
            turn.policy_versions[:max_new_tokens],
            "length",
        )


class FakeGeneratorHost:
    """Stands in for the Monarch host a GeneratorPool spawns its generators on (its placement's
    `host`): every `spawn_procs` is one incarnation of a generator, named as the pool names its mesh
    ("generator0-r1"), whose FakeGenerator answers at once, except the endpoints `hang` lists for
    that incarnation, which never return (a hung generator, by construction)."""

    def __init__(self, hang: dict[str, set[str]] | None = None):
        self.hang = hang or {}
        self.meshes: list[FakeGeneratorProcs] = []
        """Every incarnation spawned, in order."""

    def spawn_procs(self, per_host: dict, name: str, bootstrap_command=None) -> FakeGeneratorProcs:
        procs = FakeGeneratorProcs(name, self.hang.get(name, set()))
        procs.bootstrap_command = bootstrap_command
        self.meshes.append(procs)
        return procs


class FakeGeneratorProcs:
    """One incarnation's proc mesh: spawns its FakeGenerator, records being stopped."""

    def __init__(self, name: str, hung_endpoints: set[str]):
        self.name = name
        self.hung_endpoints = hung_endpoints
        self.stopped = False

    def spawn(self, name: str, actor_class: type, *args) -> FakeGenerator:
        return FakeGenerator(self.hung_endpoints)

    async def stop(self) -> None:
        self.stopped = True


class FakeGenerator:
    """A generator actor's endpoints (`start`, `generate`, `generate_turn`, `update_weights`,
    `shutdown`) without an engine: completions are `completions_for` at the version it serves; a
    turn is one eos token, and a prefix of `CONTEXT` tokens or more raises ContextExhausted as the
    actor would (wrapped, as Monarch delivers an endpoint's exception)."""

    CONTEXT = 64

    def __init__(self, hung_endpoints: set[str]):
        self.hung_endpoints = hung_endpoints
        self.policy_version = 0
        self.start = FakeEndpoint(self._start)
        self.generate = FakeEndpoint(self._generate)
        self.generate_turn = FakeEndpoint(self._generate_turn)
        self.update_weights = FakeEndpoint(self._update_weights)
        self.shutdown = FakeEndpoint(self._shutdown)

    async def _start(self) -> dict:
        await self._hang_if("start")
        # Another host's name: the pool then leaves its processes to Monarch's supervision (there are none).
        return {"engine_start_s": 0.0, "hostname": "fake-generator-host", "pid": 0, "engine_pids": [], "devices": []}

    async def _generate(self, episodes: list[Episode], group_size: int) -> list[Episode]:
        await self._hang_if("generate")
        return [
            dataclasses.replace(e, completions=completions_for(e, group_size, self.policy_version)) for e in episodes
        ]

    async def _generate_turn(self, prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        await self._hang_if("generate_turn")
        if len(prefix_token_ids) >= self.CONTEXT:
            raise FakeActorError(ContextExhausted(f"the prefix has {len(prefix_token_ids)} tokens"))
        return SampledTurn([2], [-0.1], [self.policy_version], "stop")

    async def _update_weights(self, policy_version: int, exact: bool = False) -> dict:
        await self._hang_if("update_weights")
        self.policy_version = max(self.policy_version, policy_version)
        return {"policy_version": self.policy_version}

    async def _shutdown(self) -> None:
        pass

    async def _hang_if(self, endpoint: str) -> None:
        if endpoint in self.hung_endpoints:
            await asyncio.Event().wait()  # never set: this call never returns
