"""A frozen model's supervisor: owns the reference model's (or a teacher's) ranks, so a dead one is
restarted, not fatal.

The frozen models that score tokens (`forge_rl.actors.frozen_model`: the KL penalty's reference
model, a distillation teacher) run on a proc mesh of their own, one torch.distributed world. This
actor spawns that mesh, so Monarch reports its failure here (`__supervise__`) instead of to the
controller's fault hook (which stops the run), and, like the scorer's supervisor
(`forge_rl.actors.scorer_supervisor`), polls the OS pids of its ranks on this host to act on a
death within POLL_INTERVAL_S. Any death retires the whole mesh (a collective over the ranks cannot
go on without one; spawning onto a damaged mesh hangs) and starts the model again on fresh
processes, from its directory. The restart core is the scorer's (`forge_rl.scoring.restarts.RestartingScorer`): a
`token_logprobs` call in flight on the dead mesh, or made while it restarts,
waits for the replacement and is sent again with the same episodes (the caller still holds them),
so none is lost and each comes back once; past `max_restarts` (reference.max_restarts,
scorer.teacher.max_restarts) the call raises ScorerFailed naming the cause and the flag.

A frozen model's answer depends only on its weights, so a replacement of a reference model or a
fixed teacher (loaded from the same directory) answers exactly as the dead one would have. A
pinned (self-distillation) teacher serves a version it loaded from the weight store, which keeps
only the newest versions: this supervisor holds a store lease on the version the teacher serves
and on the one it has staged (`TeacherVersions`, `forge_rl.scoring.teacher`), so a replacement loads them
again and serves what the dead one served. For pin ema the served weights are an average of
versions that no longer exist anywhere: the replacement serves the newest version averaged in, and
the average starts again from there (a progress line says so), unless it writes its average to a
file after each refresh (scorer.teacher.keep_ema_average, the default), which the replacement
loads. After a resume, what the teacher
serves came from the checkpoint's file (`load_checkpoint`), and a replacement loads it from there,
an ema average exactly, until the next refresh.

The controller (reference) and the scorer (teacher) call `token_logprobs(episodes)` here and get
rank 0's answer; the self-distillation refresh calls `stage` and `swap` here.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from typing import TYPE_CHECKING

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import HostMesh, MeshFailure, ProcMesh, concurrent_endpoint, endpoint, this_host

from forge_rl.actors.generator_pool import stop_quietly
from forge_rl.actors.restarting_owner import RestartingOwner
from forge_rl.core.deadlines import within
from forge_rl.errors import ScorerLost
from forge_rl.observability.metrics import progress
from forge_rl.plumbing.port_calls import PortServed
from forge_rl.plumbing.proc_main import set_torch_distributed_env, spawn_procs
from forge_rl.plumbing.replies import rank_zero
from forge_rl.scoring.restarts import RestartingScorer
from forge_rl.scoring.teacher import TeacherConfig, TeacherVersions, teacher_store_reader
from forge_rl.training.reference import ReferenceConfig
from forge_rl.types import Episode

if TYPE_CHECKING:  # imported where spawned: it needs torch, which the processes holding a handle to
    # this supervisor (the rollouts', the controller's) do not
    from forge_rl.actors.frozen_model import FrozenModelActor

_BACKGROUND_TIMEOUT_S = 10.0
"""Bounds the clean-up of a dead incarnation (its mesh's stop, its store reader's leases)."""


@dataclasses.dataclass
class FrozenModelMesh:
    """One incarnation's ranks."""

    model: FrozenModelActor
    procs: ProcMesh
    name: str
    """`<role>-r<incarnation>`: the mesh's name, so Monarch's failure reports name it."""
    pids: list[int]
    """Its ranks' processes on this actor's host."""


class FrozenModelSupervisor(PortServed, RestartingOwner):
    def __init__(
        self,
        role: str,
        config: ReferenceConfig,
        model_dir: str,
        pad_id: int,
        store_index=None,
        store_root: str | None = None,
        host: HostMesh | None = None,
        procs_per_host: int | None = None,
        ema_file: str | None = None,
    ):
        """`role`: "reference" or "teacher" (mesh names, metrics). `config`, `model_dir`, `pad_id`,
        `store_index`, `store_root`: what each incarnation's FrozenModelActor is built with (the
        store only for a pinned teacher). `host`: the host(s) its ranks run on, `procs_per_host`
        ranks on each (`forge_rl.run.launch.Hosts.owned_ranks`); None: this actor's own host, all
        config.num_procs ranks there. `ema_file`: where an ema teacher writes its average after
        each swap (scorer.teacher.keep_ema_average), so a replacement serves it; None: nowhere."""
        super().__init__()
        self.role, self.config, self.model_dir, self.pad_id = role, config, model_dir, pad_id
        self.store_index, self.store_root, self.ema_file = store_index, store_root, ema_file
        self.host, self.procs_per_host = host, procs_per_host or config.num_procs
        self.versions = TeacherVersions() if store_index is not None else None
        """A pinned teacher's served and staged versions, which a replacement loads again."""
        self.restarts = RestartingScorer(
            self._start_incarnation,
            self._retire,
            config.max_restarts,
            role="reference model" if role == "reference" else role,
            budget_flag=f"{config.section}.max_restarts",
            restarts_metric=f"{role}/restarts",
        )
        self.what_exited = f"a {role} process exited"

    @concurrent_endpoint
    async def token_logprobs(self, episodes: list[Episode]) -> list[list[list[float]]]:
        """The frozen model's `token_logprobs` (rank 0's answer); if its ranks die meanwhile, the
        same episodes are sent to the replacement. Raises ScorerFailed once they died more than
        max_restarts times."""
        return await self.restarts.call(lambda mesh: _rank0(mesh.model.token_logprobs.call(episodes)), len(episodes))

    @concurrent_endpoint
    async def stage(self, policy_version: int, blend: float | None = None) -> dict:
        """A pinned teacher's `stage` (`forge_rl.actors.frozen_model`), with the version leased in
        the store until the teacher no longer needs it; sent again to a replacement."""
        assert self.versions is not None  # a pinned teacher's (it has a store): the only one staged and swapped
        await self._lease(policy_version)
        try:
            figures = await self.restarts.call(lambda mesh: _rank0(mesh.model.stage.call(policy_version, blend)), 0)
        except BaseException:
            await self._release(self.versions.stage_failed())
            raise
        await self._release(self.versions.staged_now(policy_version))
        return figures

    @concurrent_endpoint
    async def swap(self) -> dict:
        """A pinned teacher's `swap`; sent again to a replacement (which staged the same version)."""
        assert self.versions is not None  # a pinned teacher's (it has a store): the only one staged and swapped
        figures = await self.restarts.call(lambda mesh: _rank0(mesh.model.swap.call()), 0)
        await self._release(self.versions.swapped())
        if self.ema_file is not None:
            await self.restarts.call(lambda mesh: _rank0(mesh.model.save_weights.call(self.ema_file)), 0)
            await self._release(self.versions.served_saved(self.ema_file))
        return figures

    @concurrent_endpoint
    async def save_checkpoint(self, path: str) -> dict:
        """A pinned teacher's checkpoint: its served and staged weights written to `path`."""
        return await self.restarts.call(lambda mesh: _rank0(mesh.model.save_weights.call(path)), 0)

    @concurrent_endpoint
    async def load_checkpoint(self, path: str) -> dict:
        """A resume: serve and stage the weights a checkpoint wrote to `path`; a replacement loads
        them from there too (the resumed run's store does not hold their versions)."""
        assert self.versions is not None  # a pinned teacher's (it has a store): the only one staged and swapped
        loaded = await self.restarts.call(lambda mesh: _rank0(mesh.model.load_weights.call(path)), 0)
        self.versions.restored(path, loaded["served"], loaded["staged"])
        return loaded

    @concurrent_endpoint
    async def stats(self) -> dict:
        """`<role>/restarts`."""
        return self.restarts.stats()

    @concurrent_endpoint
    async def calls_in_flight(self) -> int:
        """Calls waiting on the serving incarnation (a crash test kills it under one)."""
        return len(self.restarts.current.in_flight) if self.restarts.current is not None else 0

    @endpoint
    async def shutdown(self) -> None:
        """The run is stopping: deaths from now on are not restarted; the ranks are stopped."""
        self._stop_watching()
        if self.restarts.current is not None:
            await stop_quietly(self.restarts.current.handle.procs)

    async def __supervise__(self, failure: MeshFailure) -> bool:
        """A rank's mesh failed: restart it (unless the watchdog already did). A report about an
        earlier incarnation names a mesh already replaced, so it is only acknowledged."""
        incarnation = self.restarts.current
        if incarnation is not None and re.search(rf"{incarnation.handle.name}(?![0-9])", str(failure)):
            self.restarts.lost(incarnation, f"monarch supervision: {failure}")
        return True  # handled: a frozen model's failure must never reach the controller's fault hook

    async def _start_incarnation(self, number: int) -> FrozenModelMesh:
        name = f"{self.role}-r{number}"
        host = this_host() if self.host is None else self.host
        procs = spawn_procs(host, name, self.procs_per_host)
        try:
            from forge_rl.actors.frozen_model import FrozenModelActor

            await set_torch_distributed_env(procs)
            model = procs.spawn(
                name,
                FrozenModelActor,
                self.config,
                self.model_dir,
                self.pad_id,
                self.store_index,
                self.store_root,
                name,
            )
            setups = list((await model.setup.call()).values())
            if number > 1 and self.versions is not None:
                await self._load_served_versions(model)
        except BaseException:
            self._stop_in_background(procs)
            raise
        here = socket.gethostname()
        return FrozenModelMesh(model, procs, name, [s["pid"] for s in setups if s["hostname"] == here])

    async def _load_served_versions(self, model: FrozenModelActor) -> None:
        """A replacement teacher serves the dead one's version, and stages its staged one (both
        leased in the store); an ema teacher's average restarts from the newest version in it."""
        assert self.versions is not None  # a pinned teacher's (it has a store): the only one staged and swapped
        assert isinstance(self.config, TeacherConfig)  # only a pinned teacher has versions to load
        calls, note = self.versions.reload_plan(self.config.pin)
        if note is not None:
            progress(note)
        for action, *arguments in calls:
            if action == "stage":
                await model.stage.call(*arguments, None)
            elif action == "swap":
                await model.swap.call()
            else:
                await model.load_weights.call(*arguments)

    async def _lease(self, policy_version: int) -> None:
        """Lease `policy_version` for the teacher's replacements before it is staged."""
        from forge_rl.store.index import version_key

        assert self.versions is not None  # a pinned teacher's (it has a store): the only one staged and swapped
        await self.store_index.wait_for_version.call_one(policy_version)
        key = version_key(policy_version)
        await self.store_index.acquire.call_one(self._reader, key)
        self.versions.leased(key)

    async def _release(self, keys: list[str]) -> None:
        for key in keys:
            await self.store_index.release.call_one(self._reader, key)

    @property
    def _reader(self) -> str:
        return f"{self.role}-supervisor"

    def _retire(self, mesh: FrozenModelMesh) -> None:
        self._stop_in_background(mesh.procs)
        if self.store_index is not None:  # a stage cut short leaves its lease held by the dead readers
            for rank in range(self.config.num_procs):
                self._in_background(self.store_index.drop_reader.call_one(teacher_store_reader(mesh.name, rank)))

    def _in_background(self, work) -> None:
        super()._in_background(_quietly(work))  # bounded: a stopping store may never answer


async def _quietly(work) -> None:
    try:
        await within(_BACKGROUND_TIMEOUT_S, work)
    except Exception:  # a dead mesh's stop, or a store that is stopping: nothing to repair
        pass


async def _rank0(call):
    """Rank 0's answer to a call on every rank; ScorerLost if a rank's process died during it."""
    try:
        return rank_zero(await call)
    except SupervisionError as e:
        raise ScorerLost(f"a process of the frozen model died: {e}") from None
