"""`forge-rl bench scale`'s faults part, small: 4 SIMULATED generators, one SIGKILLed once step 2
is done (forge_rl/bench/scale.py, `faults`). The run must detect and replace it, train every step,
and account for every prompt handed out. Driven by steps, not timed: the train loop waits after
step 4 until the replacement serves. Prompts requeued are reported, not asserted: the victim is
killed while the controller sees a generate call in progress, but that call's reply may already be
on its way."""

from pathlib import Path

import pytest

from forge_rl.bench.scale import ScaleArgs
from forge_rl.bench.scale_faults import faults
from forge_rl.config import GRPOConfig
from forge_rl.yaml_config import load_yaml_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_a_killed_simulated_generator_is_replaced_with_every_prompt_accounted_for(tmp_path):
    args = ScaleArgs(
        fault_generators=4,
        fault_kill_fraction=0.25,
        fault_steps=8,
        fault_kill_after_step=2,
        fault_replaced_by_step=4,
        out_dir=tmp_path,
    )
    figures = faults(load_yaml_config(GRPOConfig, REPO / "configs/sim_scale.yaml"), args)
    assert figures["faults_killed"] == figures["faults_detected"] == figures["faults_replaced"] == 1
    assert figures["faults_other_recoveries"] == 0
    assert figures["faults_run"]["killed_pids"], "no process was killed"
    assert figures["faults_steps_completed"] == 8
    assert figures["faults_trained_twice"] == 0 and figures["faults_lost"] == 0
    assert figures["faults_accounting_ok"], figures["faults_run"]["accounting"]
    [detection_s] = figures["faults_detection_s"]
    assert 0 <= detection_s <= 5.0  # the pool polls its generators' processes every 0.5 s
