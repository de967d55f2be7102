"""A generator host's preemption notice over a real network stack: the hosts of
tests/integration/test_netns_hosts.py (network namespaces, each with its own address and hostname).

    host 0: the controller
    host 1: `forge-rl worker`: the services (the generator pool among them) and the trainer
    host 2: `forge-rl worker`: vLLM generator 0
    host 3: `forge-rl worker --preemption-grace-s GRACE_S`: vLLM generator 1, then SIGTERMed

Driven, not timed: the reward is held from the start (tests/support/held_reward.py); once a
scoring call is held, host 3's worker gets SIGTERM, as a scheduler gives a preemptible machine.
Once the pool has the notice, the hold is released. Checks: the run took generator 1 out before
its host went and finished every step on generator 0 with nothing lost; host 3's worker ended of
its SIGTERM after its grace; the other workers serve on.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.helpers import assert_every_prompt_accounted_for
from tests.support.netns_hosts import TwoGeneratorHosts

pytestmark = pytest.mark.integration

GRACE_S = 20.0
"""Host 3's worker's grace: its generator's removal (the groups' grace, then the stop) fits in it."""


@pytest.fixture(scope="module")
def preempted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt")
    with TwoGeneratorHosts(tmp, worker_args={i: ["--preemption-grace-s", str(GRACE_S)] for i in (1, 2, 3)}) as run:
        config = run.config("preempt", steps=6)
        controller = run.launch(config)
        preempted = run.worker(3)
        run.wait_for_held_scoring(controller)
        signaled = time.monotonic()
        preempted.send_signal(signal.SIGTERM)
        # The pool runs with the services, on host 1: its progress lines go to that worker's log.
        run.wait_for_log(1, "generator 1's host", controller, "the pool to get host 3's preemption notice")
        run.release()
        preempted_exit = preempted.wait(timeout=GRACE_S + 60)
        preempted_after_s = time.monotonic() - signaled
        summary, log = run.finish(controller)
        others_alive = all(run.worker(i).poll() is None for i in (1, 2))
        return {
            "summary": summary,
            "log": log,
            "config": config,
            "names": run.names,
            "metrics": run.metrics(config),
            "preempted_exit": preempted_exit,
            "preempted_after_s": preempted_after_s,
            "others_alive": others_alive,
            "preempted_log": run.worker_log(3).read_text(),
        }


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
