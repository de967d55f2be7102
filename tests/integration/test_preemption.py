"""A generator host's preemption notice over a real network stack: the hosts of
tests/integration/test_netns_hosts.py (network namespaces, each with its own address and hostname).

    host 0: the controller
    host 1: `forge-rl worker`: the services (the generator pool among them) and the trainer
    host 2: `forge-rl worker`: vLLM generator 0
    host 3: `forge-rl worker --preemption-grace-s GRACE_S`: vLLM generator 1, then SIGTERMed

Driven, not timed: the reward is held from the start (tests/integration/held_reward.py); once a
scoring call is held, host 3's worker gets SIGTERM, as a scheduler gives a preemptible machine.
Once the pool has the notice, the hold is released. Checks: the run took generator 1 out before
its host went and finished every step on generator 0 with nothing lost; host 3's worker ended of
its SIGTERM after its grace; the other workers serve on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from forge_rl.config import GRPOConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.engines.vllm_engine import GeneratorConfig
from forge_rl.plumbing.placement import LaunchConfig, PlacementConfig
from forge_rl.run.run_dir import config_to_dict
from forge_rl.tasks import TaskConfig
from tests.helpers import assert_every_prompt_accounted_for, wait_until
from tests.integration.held_reward import HOLD_DIR_ENV
from tests.integration.netns_hosts import NetnsHosts
from tests.integration.test_netns_hosts import RUN_HANG_S, WORKER_HOSTS, WORKER_PORT, _listening
from tests.integration.workers import REPO, stop_worker

pytestmark = pytest.mark.integration

GRACE_S = 20.0
"""Host 3's worker's grace: its generator's removal (the groups' grace, then the stop) fits in it."""


@pytest.fixture(scope="module")
def preempted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt")
    hold_dir = tmp / "hold"
    hold_dir.mkdir()
    (hold_dir / "hold").touch()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        HOLD_DIR_ENV: str(hold_dir),
    }
    with NetnsHosts(4) as hosts:
        workers = [
            subprocess.Popen(
                hosts.command(i, [
                    sys.executable, "-m", "forge_rl.cli", "worker", "--port", str(WORKER_PORT), "--host", hosts.address(i),
                    "--preemption-grace-s", str(GRACE_S),
                ]),
                cwd=REPO, env=env, stdout=open(tmp / f"worker{i}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
            )
            for i in WORKER_HOSTS
        ]
        try:
            for i, worker in zip(WORKER_HOSTS, workers):
                wait_until(lambda i=i, worker=worker: _listening(hosts.address(i), worker), f"host {i}'s worker to listen")
            config = GRPOConfig(
                run_dir=tmp / "runs", run_name="preempt", steps=6, train_batch_size=16, group_size=4,
                num_generators=2, prompts_in_flight_per_generator=2,
                generator=GeneratorConfig(max_new_tokens=2), buffer=BufferConfig(max_policy_age=1),
                task=TaskConfig(reward="tests.integration.held_reward:held_leading_number"),
                launch=LaunchConfig(
                    hosts="list",
                    workers=tuple(f"tcp://{hosts.address(i)}:{WORKER_PORT}" for i in WORKER_HOSTS),
                    placement=PlacementConfig(services_host=0, trainer_hosts=(0,), generator_hosts=(1, 2)),
                ),
            )
            config_path = tmp / "preempt.yaml"
            config_path.write_text(yaml.safe_dump(config_to_dict(config)))
            controller = subprocess.Popen(
                hosts.command(0, [sys.executable, "-m", "forge_rl.cli", "grpo", "--config", str(config_path), "--log.progress-every-s", "0"]),
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(tmp / "controller.log", "w"), text=True,
            )
            preempted = workers[2]
            try:
                wait_until(lambda: list(hold_dir.glob("held-*")) or controller.poll() is not None, "a scoring call to be held")
                assert controller.poll() is None, (tmp / "controller.log").read_text()[-3000:]
                signaled = time.monotonic()
                preempted.send_signal(signal.SIGTERM)
                wait_until(
                    # The pool runs with the services, on host 1: its progress lines go to that worker's log.
                    lambda: "generator 1's host" in (tmp / "worker1.log").read_text() or controller.poll() is not None,
                    "the pool to get host 3's preemption notice",
                )
                (hold_dir / "hold").unlink()
                preempted_exit = preempted.wait(timeout=GRACE_S + 60)
                preempted_after_s = time.monotonic() - signaled
                stdout, _ = controller.communicate(timeout=RUN_HANG_S)
            finally:
                (hold_dir / "hold").unlink(missing_ok=True)
                if controller.poll() is None:
                    controller.kill()
            log = (tmp / "controller.log").read_text()
            assert controller.returncode == 0, log[-3000:]
            others_alive = all(w.poll() is None for w in workers[:2])
            summary = json.loads(stdout.strip().splitlines()[-1])
            metrics = [json.loads(line) for line in (config.run_dir / config.run_name / "metrics.jsonl").read_text().splitlines()]
            return {
                "summary": summary, "log": log, "config": config, "names": hosts.names, "metrics": metrics,
                "preempted_exit": preempted_exit, "preempted_after_s": preempted_after_s, "others_alive": others_alive,
                "preempted_log": (tmp / "worker3.log").read_text(),
            }
        finally:
            for worker in workers:
                stop_worker(worker)


def test_the_preempted_hosts_generator_was_taken_out_before_its_host_went(preempted_run):
    summary, names = preempted_run["summary"], preempted_run["names"]
    [preemption] = summary["generator_preemptions"]
    assert preemption["index"] == 1 and preemption["host"] == names[3], preemption
    assert "error" not in preemption
    assert f"generator 1 taken out of the run before its host {names[3]} goes" in preempted_run["log"]
    assert preempted_run["metrics"][-1]["generator/count"] == 1
    assert summary["generator_recoveries"] == []  # removed, not lost and replaced


def test_the_run_finished_every_step_with_nothing_lost(preempted_run):
    summary, config = preempted_run["summary"], preempted_run["config"]
    assert summary["steps"] == config.steps
    assert_every_prompt_accounted_for(summary["accounting"], trained=config.steps * config.prompts_per_step)


def test_the_preempted_worker_ended_of_its_sigterm_after_its_grace_and_the_others_serve_on(preempted_run):
    assert preempted_run["preempted_exit"] == -signal.SIGTERM, preempted_run["preempted_log"][-2000:]
    assert preempted_run["preempted_after_s"] >= GRACE_S
    assert "preemption notice written to" in preempted_run["preempted_log"]
    assert preempted_run["others_alive"], "a worker other than the preempted one exited"
