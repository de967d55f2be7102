"""The generator pool: owns every generator's proc mesh, so a dead generator is replaced, not fatal.

Monarch reports a failure to the owner of the failed mesh. Owning the generator meshes here (not in
the controller) means a crash reaches `__supervise__`, which handles it, instead of the client's
default fault hook, which exits the controller. Monarch's report comes slowly, even on one host, so
the pool also watches the OS processes (actor and vLLM engine processes) of the generators on its
own host and acts on a death within `POLL_INTERVAL_S`; a generator on another host (launch.py's
placement) is left to Monarch's report, except for a host lost whole: Monarch reports no death
when the worker dies with its processes, so the pool also checks that each remote generator's
worker still accepts connections, and takes a generator whose worker has not for
`HOST_LOST_AFTER_S` as lost; its replacement is not tried on a host whose worker does not answer
(FAILED at once, the run goes on with the others):

    SERVING ──(a process died, a call failed, or a call hung)──▶ RECOVERING ──(fresh mesh started)──▶ SERVING
       calls in flight on the dead generator, and calls made while it recovers, raise
       GeneratorLost (`forge_rl.errors`) at once; the controller re-queues their prompts and
       waits in `wait_until_serving`. The dead incarnation's mesh is stopped without waiting on
       it, and its weight-store leases are dropped (its reader id is its mesh name), so the
       versions it held can be collected. A replacement starts on a fresh proc mesh (spawning onto
       the damaged one hangs), loads the newest published weights (again, until no newer version
       was published while it loaded) and serves again; the other generators keep serving
       throughout. A replacement that fails to start, or whose start (generator.start_timeout_s) or load hangs, is retried; after
       _MAX_START_ATTEMPTS the slot is FAILED and `wait_until_serving` raises GeneratorFailed: the
       run goes on with the other generators, or stops with the cause if it was the last.

A replacement is triggered by a dead process (Monarch's SupervisionError, or the watchdog), a dead
vLLM engine, or a hung generator: a generate call past `generate_timeout_s` or a weight update past
`update_timeout_s` (GRPOConfig derives both; they are far above what a call legitimately takes).
Any other exception raised by a generator's endpoint (a prompt longer than the context, say)
reaches the caller unchanged.

Each generator runs where `placements[i]` says (`forge_rl.run.launch`): a host, and a block of that
host's GPUs that its vLLM processes alone see (`forge_rl.plumbing.placement.generator_devices`); a
replacement starts on the same host and devices.

The controller talks to generator i through `generate(i, ...)` and `update_weights(i, ...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import os
import re
import socket
import time
from collections.abc import Iterator

import psutil
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import Actor, HostMesh, MeshFailure, ProcMesh, concurrent_endpoint, endpoint, this_host

from forge_rl.actors.generator import GeneratorActor
from forge_rl.core.deadlines import within
from forge_rl.engines.adapters import AdapterServing
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_process import engine_process_env
from forge_rl.envs.runner import ContextExhausted, SampledTurn
from forge_rl.errors import GeneratorFailed, GeneratorLost, raised_by_actor
from forge_rl.observability.metrics import progress
from forge_rl.plumbing.native_heap import trim_native_heap_if_due
from forge_rl.plumbing.port_calls import PortCalls, PortServed
from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.plumbing.workers import parse_worker_address
from forge_rl.store.actors import StoreIndexActor
from forge_rl.types import Completion, Episode, SampleResult, SampleSpec

# How often the pool checks that its generators' processes are alive.
POLL_INTERVAL_S = 0.5
HOST_CHECK_INTERVAL_S = 2.0
"""How often the pool checks that the worker of each generator's host (another host) accepts a connection."""
HOST_LOST_AFTER_S = 10.0
"""A generator whose host's worker has accepted no connection for this long is lost with its host."""
_CONNECT_TIMEOUT_S = 3.0
# Stopping a damaged mesh can hang on the dead process; the replacement does not wait longer.
_STOP_TIMEOUT_S = 5.0
# Attempts to start a replacement before its slot is given up (an engine that cannot start at all).
_MAX_START_ATTEMPTS = 3


class SlotState(enum.Enum):
    STARTING = "starting"
    """The engine is starting; calls wait for it."""
    SERVING = "serving"
    """Calls are forwarded to the generator."""
    RECOVERING = "recovering"
    """A process died; a replacement is starting on a fresh proc mesh."""
    FAILED = "failed"
    """No replacement could be started; the run cannot use this slot again."""
    REMOVED = "removed"
    """Taken out of the pool while the run goes on (`remove_generator`); never used again."""


@dataclasses.dataclass(frozen=True)
class GeneratorPlacement:
    """Where one generator runs (`forge_rl.run.launch.Hosts.generator_placements`): a replacement
    starts at the same place."""

    host: HostMesh | None
    """None: the pool's own host (launch.hosts local)."""
    cuda_devices: tuple[int, ...]
    """Its block of that host's GPUs (`forge_rl.plumbing.placement.generator_devices`); unused on CPU."""
    cpus: tuple[int, ...] | None = None
    """The cores its processes run on (launch.placement.generator_cpus); None: any."""
    worker: str | None = None
    """Its host's Monarch worker (tcp://HOST:PORT) when that is another host; None on the pool's own."""


@dataclasses.dataclass
class GeneratorSlot:
    index: int
    state: SlotState = SlotState.STARTING
    procs: ProcMesh | None = None
    actor: GeneratorActor | None = None
    pids: list[int] = dataclasses.field(default_factory=list)
    """The actor's process and its vLLM engine processes, when they run on the pool's host."""
    serving: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    in_flight: set[asyncio.Task] = dataclasses.field(default_factory=set)
    incarnation: int = 0
    policy_version: int = 0
    """Version this incarnation loaded (what `wait_until_serving` reports)."""
    failure: str | None = None
    """Why the slot is FAILED."""
    recovery: asyncio.Task | None = None
    """The replacement under way; held here because the event loop keeps only weak references to tasks."""
    generating: int = 0
    """`generate` and `generate_turn` calls for this slot not yet answered."""
    notice_watch: asyncio.Task | None = None
    """Waits for this incarnation's host's preemption notice (`GeneratorPool._watch_notice`)."""

    @contextlib.contextmanager
    def generating_call(self) -> Iterator[None]:
        self.generating += 1
        try:
            yield
        finally:
            self.generating -= 1

    @property
    def mesh_name(self) -> str:
        """Names this incarnation's meshes, so Monarch's failure reports can be told apart."""
        return f"generator{self.index}-r{self.incarnation}"

    @property
    def store_reader_id(self) -> str:
        """This incarnation's id as a weight-store reader (its WeightStore's client_id): the pool
        knows it, so it can drop the leases of an incarnation that died holding some."""
        return self.mesh_name


class GeneratorPool(PortServed, Actor):
    def __init__(
        self,
        config: GeneratorConfig,
        model_dir: str,
        max_model_len: int,
        num_generators: int,
        store_index: StoreIndexActor,
        placements: list[GeneratorPlacement],
        generate_timeout_s: float,
        update_timeout_s: float,
        generator_class: type[GeneratorActor] = GeneratorActor,
        adapters: AdapterServing | None = None,
        store_root: str | None = None,
    ):
        self.config = config
        self.store_root = store_root
        """The weight store each generator loads versions from (None: a simulated pool, which loads none)."""
        self.adapters = adapters
        """LoRA: each generator serves policy versions as adapters on the base (GRPOConfig.adapter_serving)."""
        self.placements = placements
        """Host and GPU block of each generator (`forge_rl.run.launch.Hosts.generator_placements`)."""
        self.generate_timeout_s = generate_timeout_s
        """A generate call past it is a hung generator (GRPOConfig.generate_timeout_s)."""
        self.update_timeout_s = update_timeout_s
        """A weight update past it is a hung generator (GRPOConfig.update_timeout_s)."""
        self.generator_class = generator_class
        """The actor each slot runs: GeneratorActor, or a test's subclass whose engine it can hold."""
        self.store_index = store_index
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.slots = [GeneratorSlot(i) for i in range(num_generators)]
        self.latest_version: int | None = None
        """The newest published version: what a replacement loads."""
        self.recoveries: list[dict] = []
        self._watchdog: asyncio.Task | None = None
        self._host_watch: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        """Stops of dead meshes and drops of their leases, not waited for; held here because the
        event loop keeps only weak references to tasks."""
        self._calls = PortCalls()
        """The generators' generate, generate_turn and update_weights calls (`forge_rl.plumbing.port_calls`):
        a dead generator's calls are cancelled by its recovery (the watchdog, `__supervise__`)."""
        self._stopping = False
        """Set by shutdown: failures from then on are the shutdown itself, not faults to repair."""
        self.notices: asyncio.Queue[dict] = asyncio.Queue()
        """Preemption notices of generators' hosts, for `next_preemption_notice`."""

    @endpoint
    async def start(self) -> list[dict]:
        """Spawn and start every generator; returns each one's start figures."""
        starts = await asyncio.gather(*(self._start_slot(slot) for slot in self.slots))
        self._watchdog = asyncio.create_task(self._watch_processes())
        if any(placement.worker is not None for placement in self.placements):
            self._host_watch = asyncio.create_task(self._watch_hosts())
        return starts

    @concurrent_endpoint
    async def add_generator(self) -> dict:
        """One more generator while the run goes on, at the place of generator 0 (this host: on
        CPU it shares the cores; its GPUs or another host's need a placement the pool cannot
        choose, and are refused). It starts, loads the newest published version, and serves;
        returns its index, the version it serves and its start figures."""
        first = self.placements[0]
        # A GPU host, told without importing torch here: its devices would be shared with generator 0's.
        if first.host is not None or os.path.exists("/dev/nvidiactl"):
            raise ValueError(
                "adding a generator to a run on GPUs or on other hosts needs a place for it (its GPU block, its "
                "host), which the pool cannot choose yet: start the run with --num-generators set to the most "
                "generators it may use, and remove those it does not need."
            )
        slot = GeneratorSlot(len(self.slots))
        self.slots.append(slot)
        self.placements.append(first)
        try:
            started = await self._start_slot(slot)
        except Exception:
            slot.state, slot.failure = SlotState.REMOVED, "its start failed"
            self._retire(slot)
            raise
        progress(f"generator {slot.index} added and serving at policy version {slot.policy_version}")
        return {"index": slot.index, "policy_version": slot.policy_version, **started}

    @concurrent_endpoint
    async def remove_generator(self, index: int) -> None:
        """Take generator `index` out for good: its calls in flight raise GeneratorLost at once
        (their callers continue or re-issue that work elsewhere), its processes are stopped and its
        weight-store leases dropped."""
        slot = self.slots[index]
        if slot.state == SlotState.REMOVED:
            return
        if slot.recovery is not None and not slot.recovery.done():
            slot.recovery.cancel()
        slot.state = SlotState.REMOVED
        slot.serving.set()  # wakes wait_until_serving, which raises
        for task in list(slot.in_flight):
            task.cancel()
        self._retire(slot)
        slot.pids = []
        progress(f"generator {index} removed")

    @concurrent_endpoint
    async def generate(self, index: int, episodes: list[Episode], group_size: int) -> list[Episode]:
        """Episodes with completions from generator `index`; raises GeneratorLost if it died meanwhile."""
        with self.slots[index].generating_call():
            episodes = await self._forward(
                self.slots[index],
                lambda actor: self._calls.call(actor, "generate", episodes, group_size),
                self.generate_timeout_s,
                "generate call ran past generator.generate_timeout_s",
            )
        for episode in episodes:
            episode.generator_index = index
        return episodes

    @concurrent_endpoint
    async def generate_segment(
        self,
        index: int,
        prompt_token_ids: list[int],
        forced_length: int | None,
        heads: list[list[int]] | None,
        group_size: int,
        segment_tokens: int,
    ) -> list[tuple[Completion, bool]]:
        """One segment of a group from generator `index` (`forge_rl.actors.generator.GeneratorActor.generate_segment`);
        raises GeneratorLost if it died meanwhile (the pieces sampled before
        are the caller's)."""
        with self.slots[index].generating_call():
            return await self._forward(
                self.slots[index],
                lambda actor: self._calls.call(
                    actor, "generate_segment", prompt_token_ids, forced_length, heads, group_size, segment_tokens
                ),
                self.generate_timeout_s,
                "generate_segment call ran past generator.generate_timeout_s",
            )

    @concurrent_endpoint
    async def generate_branches(
        self, index: int, prompt_token_ids: list[int], forced_length: int | None, heads: list[list[int]], n: int
    ) -> list[tuple[list[Completion], int]]:
        """Branches of a group's completions from generator `index`
        (`forge_rl.actors.generator.GeneratorActor.generate_branches`); raises GeneratorLost if it died meanwhile."""
        with self.slots[index].generating_call():
            return await self._forward(
                self.slots[index],
                lambda actor: self._calls.call(actor, "generate_branches", prompt_token_ids, forced_length, heads, n),
                self.generate_timeout_s,
                "generate_branches call ran past generator.generate_timeout_s",
            )

    @concurrent_endpoint
    async def generate_pinned(
        self,
        index: int,
        policy_version: int,
        episodes: list[Episode],
        group_size: int,
        temperature: float,
        max_new_tokens: int,
        max_in_flight: int,
    ) -> list[Episode] | None:
        """Generator `index`'s `generate_pinned` (`forge_rl.actors.generator`): sampled with exactly
        `policy_version`, or None if it serves a newer one; raises GeneratorLost if it died meanwhile."""
        with self.slots[index].generating_call():
            return await self._forward(
                self.slots[index],
                lambda actor: self._calls.call(
                    actor,
                    "generate_pinned",
                    policy_version,
                    episodes,
                    group_size,
                    temperature,
                    max_new_tokens,
                    max_in_flight,
                ),
                self.generate_timeout_s + self.update_timeout_s,  # it may wait for its version first
                "pinned generate call ran past generator.generate_timeout_s + generator.update_timeout_s",
            )

    @concurrent_endpoint
    async def sample(
        self, index: int, prompt_token_ids: list[int], spec: SampleSpec, policy_version: int | None
    ) -> SampleResult:
        """Generator `index`'s `sample` (the service's): raises GeneratorLost if it died meanwhile."""
        with self.slots[index].generating_call():
            return await self._forward(
                self.slots[index],
                lambda actor: self._calls.call(actor, "sample", prompt_token_ids, spec, policy_version),
                self.generate_timeout_s + self.update_timeout_s,  # it may load the adapter first
                "sample call ran past generator.generate_timeout_s + generator.update_timeout_s",
            )

    @concurrent_endpoint
    async def generate_turn(self, index: int, prefix_token_ids: list[int], max_new_tokens: int) -> SampledTurn:
        """One turn of an environment episode from generator `index`; raises GeneratorLost if it
        died meanwhile, and ContextExhausted (unwrapped, so the caller's runner sees its own type)
        when the prefix fills the context."""
        try:
            with self.slots[index].generating_call():
                return await self._forward(
                    self.slots[index],
                    lambda actor: self._calls.call(actor, "generate_turn", prefix_token_ids, max_new_tokens),
                    self.generate_timeout_s,
                    "generate_turn call ran past generator.generate_timeout_s",
                )
        except Exception as e:
            if isinstance(raised_by_actor(e), ContextExhausted):
                raise raised_by_actor(e) from None
            raise

    @concurrent_endpoint
    async def update_weights(self, index: int, policy_version: int, exact: bool = False) -> dict:
        """Swap generator `index` to `policy_version` (`exact`: that version, never a newer one);
        raises GeneratorLost if it died or the update hung (its replacement loads the newest
        version itself)."""
        if self.latest_version is None or policy_version > self.latest_version:
            self.latest_version = policy_version
        trim_native_heap_if_due()  # once a minute at most
        slot = self.slots[index]
        result = await self._forward(
            slot,
            lambda actor: self._calls.call(actor, "update_weights", policy_version, exact),
            self.update_timeout_s,
            "weight update ran past generator.update_timeout_s",
        )
        slot.policy_version = max(slot.policy_version, result["policy_version"])
        return result

    # Concurrent, like every endpoint here that may wait: Monarch runs a plain endpoint to its end
    # before it handles the next message, so one rollout waiting here for generator 0's
    # replacement held every other generator's `generate` call until generator 0 served again.
    @concurrent_endpoint
    async def wait_until_serving(self, index: int) -> int:
        """Returns once generator `index` serves again, with the policy version it loaded."""
        slot = self.slots[index]
        await slot.serving.wait()
        if slot.state == SlotState.FAILED:
            assert slot.failure is not None  # set with every FAILED state
            raise GeneratorFailed(index, slot.failure)
        if slot.state == SlotState.REMOVED:
            raise GeneratorLost(index, "it was removed from the pool")
        return slot.policy_version

    @concurrent_endpoint
    async def next_preemption_notice(self) -> dict:
        """Returns the next preemption notice of a serving generator's host (its worker's SIGTERM:
        `forge_rl.plumbing.preemption`): the generator's index, its host, the grace left."""
        return await self.notices.get()

    async def _watch_notice(self, slot: GeneratorSlot) -> None:
        """Queue the preemption notice of the host `slot`'s incarnation runs on, once it comes."""
        incarnation = slot.incarnation
        assert slot.actor is not None  # watched from _start_slot, once it spawned the actor
        try:
            notice = await slot.actor.preemption_notice.call_one()
        except Exception:  # it died, or was stopped: its recovery or removal is under way
            return
        if notice is None or slot.incarnation != incarnation or slot.state != SlotState.SERVING:
            return
        progress(
            f"generator {slot.index}'s host {notice['host']} is being preempted ({notice['grace_left_s']:.0f} s of "
            "grace left)"
        )
        self.notices.put_nowait({"index": slot.index, **notice})

    @concurrent_endpoint
    async def processes(self) -> list[list[int]]:
        """OS pids of each generator (actor process first, then its engine processes)."""
        return [list(slot.pids) for slot in self.slots]

    @concurrent_endpoint
    async def generate_calls_in_flight(self) -> list[int]:
        """Per generator, its `generate` and `generate_turn` calls not yet answered (what a test or
        benchmark waits for before it kills or swaps something under a decode)."""
        return [slot.generating for slot in self.slots]

    @concurrent_endpoint
    async def tokens_in_flight(self, index: int) -> int:
        """Generator `index`'s tokens sampled by requests in flight; raises GeneratorLost if it is not serving."""
        return await self._forward(
            self.slots[index],
            lambda actor: actor.tokens_in_flight.call_one(),
            self.update_timeout_s,
            "tokens_in_flight call ran past generator.update_timeout_s",
        )

    @concurrent_endpoint
    async def recovery_events(self) -> list[dict]:
        return list(self.recoveries)

    @concurrent_endpoint
    async def forward_times(self) -> list[dict]:
        """Per generator, its engine's model time since that engine started (a replacement's since
        it replaced the dead one); {} for a generator not serving now, or a simulated one."""

        async def forward_time(slot: GeneratorSlot) -> dict:
            if slot.state != SlotState.SERVING or slot.actor is None:  # a serving slot has its actor
                return {}
            try:
                return await within(_STOP_TIMEOUT_S, slot.actor.forward_time.call_one())
            except Exception:  # it died just now: its figure is lost with it
                return {}

        return list(await asyncio.gather(*(forward_time(slot) for slot in self.slots)))

    @endpoint
    async def shutdown(self) -> None:
        self._stopping = True
        for watch in (self._watchdog, self._host_watch):
            if watch is not None:
                watch.cancel()
        for slot in self.slots:
            if slot.notice_watch is not None:
                slot.notice_watch.cancel()
        await asyncio.gather(
            *(
                slot.actor.shutdown.call_one()
                for slot in self.slots
                if slot.state == SlotState.SERVING and slot.actor is not None
            ),
            return_exceptions=True,
        )

    async def __supervise__(self, failure: MeshFailure) -> bool:
        """A generator mesh failed: recover it (unless the watchdog already did) and keep going.

        A report about an earlier incarnation (the watchdog was faster) names a mesh that is
        already replaced, so it matches no serving slot and is only acknowledged.
        """
        for slot in self.slots:
            if slot.state == SlotState.SERVING and re.search(rf"{slot.mesh_name}(?![0-9])", str(failure)):
                self._begin_recovery(slot, reason=f"monarch supervision: {failure}")
        return True  # handled: a generator failure must never reach the controller's fault hook

    async def _forward(self, slot: GeneratorSlot, call, timeout_s: float, hung: str):
        """`call(slot.actor)`. A call that outlives `timeout_s` is a hung generator, treated like a
        dead one: the slot begins its recovery, and the caller gets GeneratorLost saying `hung`."""
        if slot.state != SlotState.SERVING:
            raise GeneratorLost(slot.index, f"it is {slot.state.value}")
        task = asyncio.ensure_future(call(slot.actor))
        slot.in_flight.add(task)

        def hung_lost() -> GeneratorLost:
            reason = f"hung: a {hung} ({timeout_s:g} s)"
            if slot.state == SlotState.SERVING:
                self._begin_recovery(slot, reason=reason)
            return GeneratorLost(slot.index, reason)

        try:
            return await within(timeout_s, task, hung_lost)
        except asyncio.CancelledError:
            if task.cancelled() and slot.state == SlotState.RECOVERING:
                raise GeneratorLost(slot.index, "it died during the call") from None  # cancelled by the recovery
            if task.cancelled() and slot.state == SlotState.REMOVED:
                raise GeneratorLost(slot.index, "it was removed from the pool during the call") from None
            raise
        except SupervisionError as e:  # the generator's process died
            if slot.state == SlotState.SERVING:
                self._begin_recovery(slot, reason=f"call failed: {e}")
            raise GeneratorLost(slot.index, f"its process died: {e}") from None
        except Exception as e:
            # Only the engine core died (the actor lives on): vLLM raises EngineDeadError, which
            # can reach us before the watchdog sees the process gone. Recoverable like a death;
            # any other endpoint error (a prompt too long, say) is the caller's.
            if not is_engine_dead(e):
                raise
            if slot.state == SlotState.SERVING:
                self._begin_recovery(slot, reason=f"its vLLM engine died: {e}")
            raise GeneratorLost(slot.index, f"its vLLM engine died: {e}") from None
        finally:
            slot.in_flight.discard(task)

    async def _start_slot(self, slot: GeneratorSlot) -> dict:
        slot.incarnation += 1
        placement = self.placements[slot.index]
        host = this_host() if placement.host is None else placement.host
        slot.procs = spawn_procs(host, slot.mesh_name, env=engine_process_env())
        # A simulated generator loads no weights: without the store's handle its process never
        # imports the store (nor torch), a fraction of the memory (`forge_rl.actors.generator`).
        store_index = None if self.config.engine == "sim" else self.store_index
        slot.actor = slot.procs.spawn(
            slot.mesh_name,
            self.generator_class,
            self.config,
            self.model_dir,
            self.max_model_len,
            store_index,
            slot.store_reader_id,
            placement.cuda_devices,
            self.adapters,
            placement.cpus,
            None if self.config.engine == "sim" else self.store_root,
        )
        started = await within(
            self.config.start_timeout_s,
            slot.actor.start.call_one(),
            # A hung start: this attempt failed (a replacement retries on a fresh mesh).
            lambda: TimeoutError(
                f"generator {slot.index}'s engine did not start within generator.start_timeout_s "
                f"({self.config.start_timeout_s:g} s). If the model needs longer to load, raise "
                "--generator.start-timeout-s; otherwise the engine's log above says where it stopped."
            ),
        )
        slot.policy_version = 0
        # Updates published while this engine started or loaded were not forwarded to it (the
        # slot was not serving): catch up until it holds the newest.
        while self.latest_version is not None and self.latest_version > slot.policy_version:
            policy_version = self.latest_version
            loaded = await within(
                self.update_timeout_s,
                slot.actor.update_weights.call_one(policy_version),
                # A hung load: this start attempt failed, the next one is on a fresh mesh.
                functools.partial(
                    TimeoutError,
                    f"loading policy version {policy_version} ran past generator.update_timeout_s ({self.update_timeout_s:g} s)",
                ),
            )
            slot.policy_version = loaded["policy_version"]
        # Only processes on this host can be polled; Monarch's supervision covers the others.
        slot.pids = [started["pid"], *started["engine_pids"]] if started["hostname"] == socket.gethostname() else []
        slot.state = SlotState.SERVING
        slot.serving.set()
        slot.notice_watch = asyncio.create_task(self._watch_notice(slot))
        return started

    async def _watch_processes(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            for slot in self.slots:
                if slot.state == SlotState.SERVING and not all(is_alive(pid) for pid in slot.pids):
                    self._begin_recovery(slot, reason="a generator process exited")

    async def _watch_hosts(self) -> None:
        """Begin the recovery of each serving generator whose host's worker has accepted no
        connection for HOST_LOST_AFTER_S (one check per worker, however many generators it holds)."""
        silent_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(HOST_CHECK_INTERVAL_S)
            serving = [
                s for s in self.slots if s.state == SlotState.SERVING and self.placements[s.index].worker is not None
            ]
            workers = sorted({w for w in (self.placements[s.index].worker for s in serving) if w is not None})
            answers = await asyncio.gather(*(asyncio.to_thread(worker_answers, w, _CONNECT_TIMEOUT_S) for w in workers))
            now = time.monotonic()
            for worker, answered in zip(workers, answers):
                if answered:
                    silent_since.pop(worker, None)
                    continue
                since = silent_since.setdefault(worker, now)
                if now - since < HOST_LOST_AFTER_S:
                    continue
                for slot in serving:
                    if self.placements[slot.index].worker == worker and slot.state == SlotState.SERVING:
                        self._begin_recovery(
                            slot,
                            reason=f"its host's worker {worker} has accepted no connection for {now - since:.0f} s",
                        )

    def _begin_recovery(self, slot: GeneratorSlot, reason: str) -> None:
        if self._stopping:
            return
        slot.state = SlotState.RECOVERING
        slot.serving.clear()
        event = {"generator": slot.index, "reason": reason, "detected_at": time.time()}
        self.recoveries.append(event)
        progress(f"generator {slot.index} failed ({reason}); starting a replacement")
        for task in list(slot.in_flight):
            task.cancel()
        slot.recovery = asyncio.create_task(self._replace(slot, event))

    async def _replace(self, slot: GeneratorSlot, event: dict) -> None:
        event["respawn_started_at"] = time.time()
        worker = self.placements[slot.index].worker
        for attempt in range(1, _MAX_START_ATTEMPTS + 1):
            self._retire(slot)
            if worker is not None and not await asyncio.to_thread(worker_answers, worker, _CONNECT_TIMEOUT_S):
                # Spawning there would wait out generator.start_timeout_s for nothing, each attempt.
                progress(
                    f"generator {slot.index}: its host's worker {worker} does not answer; it is not replaced there"
                )
                slot.state, slot.failure = (
                    SlotState.FAILED,
                    f"its host's worker {worker} does not answer: the host is lost",
                )
                slot.serving.set()  # wakes wait_until_serving, which raises
                return
            try:
                started = await self._start_slot(slot)
                break
            except Exception as e:  # an engine that fails to start: try a fresh mesh again
                progress(f"generator {slot.index}: replacement attempt {attempt} failed: {type(e).__name__}: {e}")
                if attempt == _MAX_START_ATTEMPTS:
                    slot.state, slot.failure = SlotState.FAILED, f"{_MAX_START_ATTEMPTS} attempts failed, last: {e}"
                    slot.serving.set()  # wakes wait_until_serving, which raises
                    return
        event.update(
            serving_at=time.time(), engine_start_s=started["engine_start_s"], policy_version=slot.policy_version
        )
        progress(f"generator {slot.index} replaced and serving at policy version {slot.policy_version}")

    def _retire(self, slot: GeneratorSlot) -> None:
        """Let go of the incarnation `slot` holds (dead, hung, or a replacement that failed to
        start) without waiting on it: stop its mesh, and drop its weight-store leases, so the
        versions it held can be collected (the store also refuses it new ones, should it still run)."""
        if slot.notice_watch is not None:
            slot.notice_watch.cancel()
        for retiring in (stop_quietly(slot.procs), self._drop_leases(slot.store_reader_id)):
            task = asyncio.create_task(retiring)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _drop_leases(self, reader_id: str) -> None:
        try:
            await within(_STOP_TIMEOUT_S, self.store_index.drop_reader.call_one(reader_id))
        except Exception as e:  # the store's index is gone or stuck: the run fails on it elsewhere
            progress(f"could not drop the weight-store leases of {reader_id}: {type(e).__name__}: {e}")


def worker_answers(address: str, timeout_s: float) -> bool:
    """Whether the Monarch worker at `address` (tcp://HOST:PORT) accepts a TCP connection within `timeout_s`."""
    host, port = parse_worker_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


async def stop_quietly(procs: ProcMesh) -> None:
    try:
        await within(_STOP_TIMEOUT_S, procs.stop())
    except Exception:  # the mesh is broken; a fresh one already replaces it
        pass


def is_engine_dead(error: BaseException) -> bool:
    """Whether `error` (as the generator actor raised it) is vLLM's EngineDeadError. Matched by
    name: the pool does not import vLLM (vllm/v1/engine/exceptions.py)."""
    return type(raised_by_actor(error)).__name__ == "EngineDeadError"


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
