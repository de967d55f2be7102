"""A generator host lost whole, over a real network stack (tests/support/netns_hosts.py): every
process of host 3, its `forge-rl worker` with the generator and the vLLM engine it spawned, is
SIGKILLed at once, as when a machine goes. Nothing can be started there again.

    host 0: the controller
    host 1: `forge-rl worker`: the services (the generator pool among them) and the trainer
    host 2: `forge-rl worker`: vLLM generator 0
    host 3: `forge-rl worker`: vLLM generator 1, then lost

Driven, not timed: the reward is held from the start (tests/support/held_reward.py); once a
scoring call is held (a generator has generated), host 3 goes, and the hold is released once the
run has taken generator 1 out. Monarch reports no death when a worker dies with its processes: the
pool finds its port closed (`HOST_LOST_AFTER_S`) and does not try a replacement on a host whose
worker does not answer. Checks: the loss was detected as the host's and nothing was spawned there
again; the run finished every step on generator 0 with nothing lost or trained twice; the other
workers serve on.
"""

from __future__ import annotations

import time

import psutil
import pytest

from tests.support.helpers import assert_every_prompt_accounted_for
from tests.support.netns_hosts import TwoGeneratorHosts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lost_host_run(tmp_path_factory):
    with TwoGeneratorHosts(tmp_path_factory.mktemp("lost")) as run:
        # Several steps past the loss: the rest of the run is generator 0's alone.
        config = run.config("lost", steps=6)
        controller = run.launch(config)
        run.wait_for_held_scoring(controller)
        lost = run.worker(3)
        family = [psutil.Process(lost.pid), *psutil.Process(lost.pid).children(recursive=True)]
        for process in family:
            process.kill()
        lost_at = time.time()
        psutil.wait_procs(family, timeout=30)
        # The rollouts run with the services, on host 1: their progress lines go to that worker's log.
        run.wait_for_log(1, "the run goes on with generators [0]", controller, "the run to take generator 1 out")
        run.release()
        summary, log = run.finish(controller)
        return {
            "summary": summary,
            "log": log,
            "config": config,
            "metrics": run.metrics(config),
            "lost_at": lost_at,
            "lost": [p.pid for p in family],
            "others_alive": all(run.worker(i).poll() is None for i in (1, 2)),
            "services_log": run.worker_log(1).read_text(),
        }


def test_the_lost_hosts_generator_was_detected_and_left_the_run_without_a_replacement_tried_there(lost_host_run):
    summary, services_log = lost_host_run["summary"], lost_host_run["services_log"]
    assert len(lost_host_run["lost"]) >= 3, lost_host_run["lost"]  # the worker, the generator's process, its engine
    [event] = summary["generator_recoveries"]
    assert event["generator"] == 1 and event["detected_at"] >= lost_host_run["lost_at"] - 1.0, event
    assert "has accepted no connection" in event["reason"] and "serving_at" not in event, event
    assert "generator 1: its host's worker" in services_log and "it is not replaced there" in services_log
    assert "replacement attempt" not in services_log
    assert lost_host_run["metrics"][-1]["generator/count"] == 1


def test_the_run_finished_every_step_on_the_remaining_generator_with_nothing_lost(lost_host_run):
    summary, config = lost_host_run["summary"], lost_host_run["config"]
    assert summary["steps"] == config.steps
    assert_every_prompt_accounted_for(summary["accounting"], trained=config.steps * config.prompts_per_step)
    assert lost_host_run["others_alive"], "a worker other than the lost host's exited"
