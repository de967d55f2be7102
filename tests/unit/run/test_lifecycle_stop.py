"""forge_rl.run.lifecycle.Lifecycle.owning_processes: a process failure Monarch reports while the run is
stopping its processes is the stop's own, and must not turn a clean stop (Ctrl-C, SIGTERM) into
"a process died" (exit 1 instead of 130 or 143). Found in test_shutdown: the generator pool, still
replying to the rollouts when their process stopped first, failed on the undeliverable reply.

The lifecycle here is built without its run (no store, no processes): FakeMeshes and a fake
fault hook stand in for Monarch, which is what these tests are about."""

import asyncio
import contextlib

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.errors import ProcessDied, ProcessNotStarted
from forge_rl.run import lifecycle as lifecycle_module


class FakeStore:
    def destroy(self) -> None:
        pass


class FakeReaper:
    def dismiss(self) -> None:
        pass


class FakeMeshes:
    """Proc meshes whose stop reports a failure through the fault hook, as Monarch's does when an
    actor fails on a message to one that stopped first."""

    def __init__(self, hook_holder: dict, failure: str):
        self.hook_holder, self.failure = hook_holder, failure

    async def stop(self) -> None:
        self.hook_holder["hook"](self.failure)


def a_lifecycle(tmp_path, monkeypatch, hook_holder: dict) -> lifecycle_module.Lifecycle:
    @contextlib.contextmanager
    def fake_on_process_failure(callback):
        hook_holder["hook"] = callback
        yield

    monkeypatch.setattr(lifecycle_module.launch, "on_process_failure", fake_on_process_failure)
    monkeypatch.setattr(lifecycle_module, "remove_unstarted_run_dir", lambda path: None)
    lifecycle = object.__new__(lifecycle_module.Lifecycle)
    lifecycle.config = GRPOConfig()
    lifecycle.run_path = tmp_path / "run"
    lifecycle.process_failures = []
    lifecycle._engine_owners = ()
    lifecycle._loops = None
    lifecycle._stopped_at = None
    lifecycle.store = FakeStore()
    lifecycle.policy_stores = {}
    lifecycle._store_reaper = FakeReaper()
    lifecycle.stop_at_exit(FakeMeshes(hook_holder, "actor rollouts stopped: undeliverable message"))
    return lifecycle


def test_a_failure_reported_while_the_processes_stop_does_not_make_a_stop_a_death(tmp_path, monkeypatch):
    hooks: dict = {}
    lifecycle = a_lifecycle(tmp_path, monkeypatch, hooks)

    async def stopped_by_sigterm():
        async with lifecycle.owning_processes():
            raise asyncio.CancelledError  # what SIGTERM (forge_rl.cli) or Ctrl-C raises in the run

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(stopped_by_sigterm())
    assert lifecycle.process_failures == []


def test_a_failure_reported_while_the_run_trains_still_stops_it_as_a_death(tmp_path, monkeypatch):
    hooks: dict = {}
    lifecycle = a_lifecycle(tmp_path, monkeypatch, hooks)

    async def a_process_dies():
        async with lifecycle.owning_processes():
            hooks["hook"]("trainer-0: process exited with signal 9")
            raise asyncio.CancelledError  # the loops, cancelled by the hook

    with pytest.raises(ProcessDied, match="trainer-0: process exited with signal 9"):
        asyncio.run(a_process_dies())
    assert lifecycle.process_failures == ["trainer-0: process exited with signal 9"]


def test_a_death_reported_after_the_error_it_caused_still_stops_the_run_as_a_death(tmp_path, monkeypatch):
    # A dead trainer can reach the loop as a failed call before Monarch's fault hook reports it,
    # and the report then comes while the processes stop: it must still name the death.
    hooks: dict = {}
    lifecycle = a_lifecycle(tmp_path, monkeypatch, hooks)
    lifecycle.stop_at_exit(FakeMeshes(hooks, "trainer-0: process exited with signal 9"))

    async def a_call_fails():
        async with lifecycle.owning_processes():
            raise RuntimeError("train_next_step: the actor's process is gone")

    with pytest.raises(ProcessDied, match="trainer-0: process exited with signal 9"):
        asyncio.run(a_call_fails())


def test_a_process_monarch_could_not_start_stops_the_run_naming_the_setting_that_allows_longer(tmp_path, monkeypatch):
    # As the generator pool's start raised it when a generator's process showed no progress in
    # starting (two busy loops beside the suite): Monarch's ValueError inside the call's ActorError.
    from monarch._src.actor.actor_mesh import ActorError

    from forge_rl.run.launch import MONARCH_DEFAULTS

    monkeypatch.delenv("HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE", raising=False)
    hooks: dict = {}
    lifecycle = a_lifecycle(tmp_path, monkeypatch, hooks)
    spawn_failure = ValueError("error spawning proc mesh: statuses: Timeout(180.002270958s)=0..1")

    async def a_process_never_starts():
        async with lifecycle.owning_processes():
            raise ActorError(spawn_failure, "Actor call generators.start failed.")

    with pytest.raises(ProcessNotStarted) as stopped:
        asyncio.run(a_process_never_starts())
    message = str(stopped.value)
    setting = f"HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE={MONARCH_DEFAULTS['HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE']}"
    assert "did not start" in message and "for 180 s" in message and setting in message
    assert "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE=600s" in message
