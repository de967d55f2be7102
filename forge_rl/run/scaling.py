"""Changing a running run's generator pool from outside it: `forge-rl scale RUN --generators N`.

    forge-rl scale runs/demo --generators 3      # add generators until the pool has 3
    forge-rl scale runs/demo --generators 1 --grace-s 20   # remove the newest until 1 is left

The command checks the run (its directory, its controller alive), writes its request to
RUN_DIR/control/scale-request.json (whole or not at all) and waits for the answer in
RUN_DIR/control/scale-answer.json, which names the request. The run's controller looks for a new
request after every step (`Scaling.after_step`) and carries it out beside training, which goes
on: a generator added starts on this host, loads the newest published version and gets its
rollout loops (`forge_rl.pipeline.rollouts.Rollouts.add_generator`); one removed (the newest first)
takes no more admissions, the groups it decodes get `--grace-s` to finish, then it is stopped and
what is still in flight on it is continued on the others (with generator.segment_tokens, from the
tokens it had returned) or handed out again (`remove_generator`). The pool never goes below one
generator. A request the run cannot carry out (a GPU or multi-host placement the pool cannot
extend) is answered with its error; the run goes on as it was. A checkpoint records the pool's size, and a resume
starts as many generators unless --num-generators chooses
(`forge_rl.run.run_dir.open_run_dir_for_resume`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import tyro

from forge_rl.observability.metrics import progress

CONTROL_DIR = "control"
REQUEST_FILE = "scale-request.json"
ANSWER_FILE = "scale-answer.json"
PROCESSES_FILE = "processes.json"
_REMOVAL_MARGIN_S = 3.0
"""Of a preemption notice's grace, what is left to stopping the generator after its groups' grace."""


@dataclass(frozen=True)
class ScaleArgs:
    run: tyro.conf.Positional[Path]
    """The running run's directory (RUN_DIR/RUN_NAME)."""
    generators: int
    """How many generators the pool should have (>= 1)."""
    grace_s: float = 30.0
    """Seconds a removed generator's groups in flight get to finish before it is stopped (what
    is still in flight then continues or is generated again on the others)."""
    wait_s: float = 900.0
    """How long to wait for the run's answer (an added generator starts its engine first)."""


def request_scale(run_path: Path, generators: int, grace_s: float) -> str:
    """Ask the running run at `run_path` for a pool of `generators`; returns the request's id.
    ValueError naming the problem and the fix: no such run, a run that is not running, fewer than
    one generator, a negative grace."""
    run_path = Path(run_path)
    if not (run_path / "config.yaml").is_file():
        raise ValueError(
            f"{run_path} is not a run directory (it has no config.yaml). Name the run's directory: RUN_DIR/RUN_NAME."
        )
    if isinstance(generators, bool) or not isinstance(generators, int) or generators < 1:
        raise ValueError(
            f"--generators ({generators}) must be an integer >= 1: a run needs a generator. Use 1 to keep one."
        )
    if not grace_s >= 0:
        raise ValueError(f"--grace-s ({grace_s}) must be >= 0 (seconds a removed generator's groups get to finish).")
    controller = _controller_pid(run_path)
    if controller is None or not psutil.pid_exists(controller):
        raise ValueError(
            f"run {run_path} is not running (its controller, pid {controller}, is gone). Resume it first: "
            f"forge-rl grpo --resume {run_path}, then scale it."
        )
    request_id = uuid.uuid4().hex
    control = run_path / CONTROL_DIR
    control.mkdir(exist_ok=True)
    partial = control / f".{REQUEST_FILE}.{request_id}"
    partial.write_text(json.dumps({"id": request_id, "generators": generators, "grace_s": grace_s}))
    partial.rename(control / REQUEST_FILE)  # whole, or not there
    return request_id


def wait_for_answer(run_path: Path, request_id: str, timeout_s: float) -> dict[str, Any]:
    """The run's answer to `request_id`; TimeoutError past `timeout_s` (naming what to check)."""
    answer_path = Path(run_path) / CONTROL_DIR / ANSWER_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answer_path.is_file():
            answer = json.loads(answer_path.read_text())
            if answer.get("id") == request_id:
                return answer
        controller = _controller_pid(Path(run_path))
        if controller is None or not psutil.pid_exists(controller):
            raise RuntimeError(f"run {run_path} stopped before it answered the scale request")
        time.sleep(0.2)
    raise TimeoutError(
        f"run {run_path} did not answer the scale request within {timeout_s:g} s. It reads requests after each "
        "step: a run whose steps take longer answers later (raise --wait-s); its progress lines say what it does."
    )


def _controller_pid(run_path: Path) -> int | None:
    path = run_path / PROCESSES_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("controller")


class Scaling:
    """The controller's side: after each step, start carrying out a new request (one at a time),
    beside training; and take out each generator whose host got a preemption notice, as it comes."""

    def __init__(self, run_path: Path):
        self.run_path = Path(run_path)
        self.answered: str | None = None
        self._task: asyncio.Task | None = None
        self._notices: asyncio.Task | None = None
        self.preempted: list[dict] = []
        """What each preemption notice's removal did (`Rollouts.remove_generator`'s answer, or why not)."""

    def start(self, actors) -> None:
        """Answer the generators' preemption notices while the loops run."""
        self._notices = asyncio.create_task(self._answer_preemption_notices(actors))

    async def _answer_preemption_notices(self, actors) -> None:
        """A generator whose host is being preempted (`forge_rl.plumbing.preemption`) is removed
        as `forge-rl scale` removes one, its groups given the notice's grace left (less a margin for
        the removal itself); the pool's last generator is not: the run cannot go on without one."""
        while True:
            notice = await actors.generators.next_preemption_notice.call_one()
            index = notice["index"]
            grace_s = max(0.0, notice["grace_left_s"] - _REMOVAL_MARGIN_S)
            try:
                generators = await actors.rollouts.generators.call_one()
                if generators == [index]:
                    raise ValueError(
                        f"it is the run's last generator: the run stops when {notice['host']} goes, resumable from "
                        "its newest checkpoint. Give a run on preemptible hosts generators on two hosts or more"
                    )
                removed = await actors.rollouts.remove_generator.call_one(index, grace_s)
                self.preempted.append({"host": notice["host"], **removed})
                await self._record_processes(actors)
                progress(f"generator {index} taken out of the run before its host {notice['host']} goes: {removed}")
            except Exception as e:  # the run goes on as it is until the host goes
                self.preempted.append({"host": notice["host"], "index": index, "error": f"{type(e).__name__}: {e}"})
                progress(f"generator {index} stays in the run despite its host's preemption notice: {e}")

    async def after_step(self, pipeline) -> None:
        if self._task is not None and not self._task.done():
            return
        path = self.run_path / CONTROL_DIR / REQUEST_FILE
        if not path.is_file():
            return
        request = json.loads(path.read_text())
        if request.get("id") == self.answered:
            return
        self.answered = request["id"]
        self._task = asyncio.create_task(self._carry_out(request, pipeline.actors))

    async def _carry_out(self, request: dict, actors) -> None:
        answer: dict[str, Any] = {"id": request["id"], "requested": request["generators"], "added": [], "removed": []}
        started = time.monotonic()
        try:
            generators = await actors.rollouts.generators.call_one()
            progress(f"scaling the generator pool from {len(generators)} to {request['generators']}")
            while len(generators) < request["generators"]:
                added = await actors.rollouts.add_generator.call_one()
                answer["added"].append({k: added[k] for k in ("index", "policy_version", "engine_start_s")})
                generators = await actors.rollouts.generators.call_one()
            leaving = sorted(generators, reverse=True)[: max(len(generators) - request["generators"], 0)]
            # At once: each gets the whole grace, not a share of it.
            answer["removed"] = list(
                await asyncio.gather(
                    *(actors.rollouts.remove_generator.call_one(index, request["grace_s"]) for index in leaving)
                )
            )
            answer["generators"] = await actors.rollouts.generators.call_one()
            await self._record_processes(actors)
        except Exception as e:  # the run goes on as it is; the requester gets the reason
            answer["error"] = f"{type(e).__name__}: {e}"
            progress(f"scaling the generator pool failed: {answer['error']}")
        answer["seconds"] = time.monotonic() - started
        partial = self.run_path / CONTROL_DIR / f".{ANSWER_FILE}.{request['id']}"
        partial.write_text(json.dumps(answer))
        partial.rename(self.run_path / CONTROL_DIR / ANSWER_FILE)
        if "error" not in answer:
            progress(f"generator pool now {answer['generators']} ({answer['seconds']:.1f} s)")

    async def _record_processes(self, actors) -> None:
        """processes.json names the pool's generators as they are now (crash tests and users look there)."""
        path = self.run_path / PROCESSES_FILE
        processes = json.loads(path.read_text())
        processes["generators"] = await actors.generators.processes.call_one()
        partial = path.with_name(f".{PROCESSES_FILE}.{os.getpid()}")
        partial.write_text(json.dumps(processes))
        partial.rename(path)

    def cancel(self) -> None:
        """The run is ending: a request still being carried out stops where it is (unanswered)."""
        for task in (self._task, self._notices):
            if task is not None:
                task.cancel()
