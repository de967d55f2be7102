"""The scorer's supervisor: owns the scorer-side proc meshes, so a dead scorer is restarted, not fatal.

The scorer-side processes of one incarnation: the ScorerActor (`forge_rl.actors.scorer`, with its
reward worker processes), and, when configured, the reward model (RewardModelActor) and the LLM
judge (a GeneratorActor serving the judge), each on a proc mesh of its own that this actor spawns.
Monarch reports a failure to the owner of the failed mesh: owning them here, not in the controller,
means a crash reaches `__supervise__` instead of the controller's fault hook (which stops the run).
Like the generator pool (`forge_rl.actors.generator_pool`), it also polls the OS pids of the
processes on its own host, and acts on a death within POLL_INTERVAL_S, before Monarch's slower report.

Any death retires the whole incarnation (its meshes stopped without waiting on them) and starts a
fresh one on fresh proc meshes (spawning onto a damaged mesh hangs): the scorer holds its models'
handles, so a new reward model or judge needs a new scorer anyway, and a scorer alone restarts in
seconds. What happens to the calls in flight, the restart budget (scorer.max_restarts) and the
counters is the core's: `forge_rl.scoring.restarts`. The distillation teacher and the reference
model are not owned here: each has a supervisor of its own (`forge_rl.actors.frozen_model_supervisor`,
the same restart core), which the scorer (teacher) and the controller (reference) call, so a dead
teacher is restarted without restarting the scorer, and the scorer never sees the death. A teacher
that died past scorer.teacher.max_restarts raises ScorerFailed through the scorer, which passes it
on to the controller as its own.

The controller calls `score(episodes)` and `stats()` here as it called the scorer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import HostMesh, MeshFailure, ProcMesh, concurrent_endpoint, endpoint, this_host

from forge_rl.actors.generator import GeneratorActor
from forge_rl.actors.restarting_owner import RestartingOwner
from forge_rl.actors.reward_model import RewardModelActor
from forge_rl.actors.scorer import ScorerActor
from forge_rl.errors import ScorerFailed, ScorerLost, raised_by_actor
from forge_rl.plumbing.port_calls import PortCalls, PortServed
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.scoring.restarts import RestartingScorer, ScorerState
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.types import Episode


@dataclasses.dataclass
class ScorerMeshes:
    """One incarnation's processes."""

    scorer: ScorerActor
    judge: GeneratorActor | None
    procs: dict[str, ProcMesh]
    """Mesh name (`<role>-r<incarnation>`, so Monarch's failure reports name it) -> mesh."""
    pids: list[int]
    """Its processes on this actor's host (the scorer's, the reward model's, the judge's and its engine's)."""


class ScorerSupervisor(PortServed, RestartingOwner):
    def __init__(
        self, config: ScorerConfig, reward: str | None, max_new_tokens: int, teacher=None, host: HostMesh | None = None
    ):
        """`reward`, `max_new_tokens`, `teacher`: what each incarnation's ScorerActor is built with
        (`forge_rl.actors.scorer`). `host`: where the scorer-side processes run (the services'
        host, `forge_rl.run.launch.Hosts.owned_host`); None: this actor's own host."""
        super().__init__()
        self.config, self.reward, self.max_new_tokens, self.teacher = config, reward, max_new_tokens, teacher
        self.host = host
        self.restarts = RestartingScorer(self._start_incarnation, self._retire, config.max_restarts)
        self.what_exited = "a scorer-side process exited"
        self._calls = PortCalls()
        """The scorer's `score` calls (`forge_rl.plumbing.port_calls`): a dead scorer's calls are cancelled by
        `restarts.lost` (the watchdog, `__supervise__`) and sent again."""

    @concurrent_endpoint
    async def score(self, episodes: list[Episode]) -> list[Episode]:
        """The scorer's `score`; if the scorer dies meanwhile, the same episodes are scored again
        by its replacement. Raises ScorerFailed once it died more than scorer.max_restarts times."""
        return await self.restarts.call(
            lambda meshes: _lost_if_dead(self._calls.call(meshes.scorer, "score", episodes)), len(episodes)
        )

    @concurrent_endpoint
    async def stats(self) -> dict:
        """The scorer's counters over all its incarnations, and scorer/restarts."""
        await self.restarts.read_stats(lambda meshes: _lost_if_dead(self._calls.call(meshes.scorer, "stats")))
        return self.restarts.stats()

    @endpoint
    async def shutdown(self) -> None:
        """Stops the reward workers and the judge's engine (their processes are children of the
        actors' processes, not of Monarch)."""
        self._stop_watching()
        incarnation = self.restarts.current
        if self.restarts.state == ScorerState.SERVING and incarnation is not None:
            meshes = incarnation.handle
            await asyncio.gather(
                meshes.scorer.shutdown.call_one(),
                *([meshes.judge.shutdown.call()] if meshes.judge is not None else []),
                return_exceptions=True,
            )

    async def __supervise__(self, failure: MeshFailure) -> bool:
        """A scorer-side mesh failed: restart the incarnation (unless the watchdog already did). A
        report about an earlier incarnation names a mesh already replaced, so it is only acknowledged."""
        incarnation = self.restarts.current
        if incarnation is not None and any(
            re.search(rf"{name}(?![0-9])", str(failure)) for name in incarnation.handle.procs
        ):
            self.restarts.lost(incarnation, f"monarch supervision: {failure}")
        return True  # handled: a scorer failure must never reach the controller's fault hook

    async def _start_incarnation(self, number: int) -> ScorerMeshes:
        config, host = self.config, this_host() if self.host is None else self.host
        procs: dict[str, ProcMesh] = {}

        def spawn(role: str, actor_class, *args, num_procs: int = 1):
            name = f"{role}-r{number}"
            procs[name] = spawn_procs(host, name, num_procs)
            return procs[name].spawn(name, actor_class, *args)

        async def every_reply(call) -> list[dict]:
            """A mesh call's reply from each of its processes (the reward model's replicas, or one)."""
            values = await call
            return [values.get(i) for i in range(len(values))]

        try:
            starts, reward_model, judge = [], None, None
            if config.reward_model.path is not None:
                reward_model = spawn(
                    "reward_model", RewardModelActor, config.reward_model, num_procs=config.reward_model.replicas
                )
                starts.append(every_reply(reward_model.setup.call()))
            if config.judge.path is not None:
                # A generator like the policy's, serving the judge's weights, which never change (no store).
                judge = spawn(
                    "judge",
                    GeneratorActor,
                    config.judge.generator,
                    str(config.judge.path),
                    config.judge.max_model_len,
                    None,
                    f"judge-r{number}",
                    num_procs=config.judge.replicas,
                )
                starts.append(every_reply(judge.start.call()))
            scorer = spawn(
                "scorer", ScorerActor, config, self.reward, self.max_new_tokens, reward_model, self.teacher, judge
            )
            replies = await asyncio.gather(every_reply(scorer.process.call()), *starts)
        except BaseException:
            for mesh in procs.values():
                self._stop_in_background(mesh)
            raise
        here = socket.gethostname()
        started = [reply for process_replies in replies for reply in process_replies]
        pids = [pid for s in started if s["hostname"] == here for pid in (s["pid"], *s.get("engine_pids", ()))]
        return ScorerMeshes(scorer, judge, procs, pids)

    def _retire(self, meshes: ScorerMeshes) -> None:
        for mesh in meshes.procs.values():
            self._stop_in_background(mesh)


async def _lost_if_dead(call):
    """`call`'s result; ScorerLost if the scorer's process died during it, or the scorer said a model
    it calls died (ScorerLost raised in the scorer, wrapped by Monarch)."""
    try:
        return await call
    except SupervisionError as e:
        raise ScorerLost(f"the scorer's process died: {e}") from None
    except Exception as e:
        if isinstance(raised_by_actor(e), (ScorerLost, ScorerFailed)):  # ScorerFailed: the teacher kept dying
            raise raised_by_actor(e) from None
        raise
