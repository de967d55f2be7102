"""What `forge-rl bench scale` reads from a run (forge_rl/bench/scale.py), on hand-made inputs."""

from __future__ import annotations

import collections
import json

import pytest

from forge_rl.bench.scale_bounds import steady_trained_tokens_per_step
from forge_rl.bench.scale_faults import choose_victims, fault_figures, judge_accounting, lost_prompts
from forge_rl.bench.scale_runs import _CountingActor, max_concurrent_sequences
from forge_rl.observability.timeline import Interval


def test_concurrent_sequences_peak_where_calls_of_all_generators_overlap(tmp_path):
    intervals = [
        Interval("generator0", 0.0, 2.0, 8),
        Interval("generator1", 1.0, 3.0, 8),
        Interval("generator0", 1.5, 2.5, 8),  # same generator, second rollout loop
        Interval("trainer", 0.0, 3.0, 0),
        Interval("generator1", 3.0, 4.0, 8),  # starts as the other ends: never 4 at once
    ]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(i.__dict__) for i in intervals))
    assert max_concurrent_sequences(tmp_path) == 24


class FakeEndpoint:
    def call_one(self, *args):
        return ("one", args)

    def call(self, *args):
        return ("all", args)


class FakeActor:
    generate = FakeEndpoint()
    put = FakeEndpoint()


def test_counting_handles_count_each_call_by_endpoint_and_pass_it_through():
    counts = collections.Counter()
    actor = _CountingActor(FakeActor(), counts, "generators")
    assert actor.generate.call_one(1, 2) == ("one", (1, 2))
    actor.generate.call_one(3)
    assert actor.put.call() == ("all", ())
    assert counts == {"generators.generate": 2, "generators.put": 1}
    with pytest.raises(AttributeError):
        actor.missing


def test_victims_are_a_tenth_of_the_generators_drawn_from_the_seed():
    assert choose_victims(20, 0.1, seed=0) == choose_victims(20, 0.1, seed=0)
    assert len(choose_victims(20, 0.1, seed=0)) == 2 and len(choose_victims(32, 0.1, seed=0)) == 3
    assert len(set(choose_victims(128, 0.1, seed=1))) == 13
    assert any(choose_victims(20, 0.1, seed) != choose_victims(20, 0.1, 0) for seed in range(1, 10))
    assert choose_victims(4, 0.1, seed=0) == choose_victims(4, 0.25, seed=0)  # at least one
    assert all(0 <= i < 20 for i in choose_victims(20, 0.5, seed=3))


def _record(**accounting) -> dict:
    """A faults run's record: 4 steps of 2 prompts; 12 handed out, 8 trained, 1 dropped,
    1 filtered, 2 unfinished (1 in the buffer, 1 cut in flight at the end)."""
    counts = dict(
        prompts_handed_out=12,
        trained=8,
        dropped=1,
        skipped_nonfinite=0,
        filtered_zero_advantage=1,
        unfinished_at_stop=2,
        trained_more_than_once=0,
        requeued_after_generator_failure=3,
    )
    counts.update(accounting)
    return {
        "num_generators": 20,
        "prompts_per_step": 2,
        "steps": 4,
        "steps_wanted": 4,
        "accounting": counts,
        "held_at_stop": {"buffered": 1, "requeued_not_regenerated": 0, "cut_in_flight": 1},
        "generator_recoveries": [
            {"generator": 7, "detected_at": 100.4, "serving_at": 101.4},
            {"generator": 3, "detected_at": 100.2, "serving_at": 101.0},
        ],
    }


def test_the_accounting_holds_when_every_prompt_is_trained_once_or_counted_where_it_went():
    record = _record()
    assert lost_prompts(record["accounting"], record["held_at_stop"]) == 0
    assert judge_accounting(record, steps=4)


def test_a_prompt_that_is_nowhere_at_the_end_is_lost():
    """The accounting's remainder says 3 unfinished, but only 2 are held anywhere."""
    record = _record(prompts_handed_out=13, unfinished_at_stop=3)
    assert lost_prompts(record["accounting"], record["held_at_stop"]) == 1
    assert not judge_accounting(record, steps=4)


def test_a_prompt_trained_twice_or_a_short_run_fails_the_accounting():
    assert not judge_accounting(_record(trained_more_than_once=1), steps=4)
    assert not judge_accounting(_record(), steps=5)  # a step's batch is missing


def test_fault_figures_measure_each_victim_from_its_own_kill():
    figures = fault_figures(_record(), victims=[3, 7], killed_at={3: 100.0, 7: 100.1})
    assert figures["faults_killed"] == figures["faults_detected"] == figures["faults_replaced"] == 2
    assert figures["faults_detection_s"] == pytest.approx([0.2, 0.3])
    assert figures["faults_replacement_s"] == pytest.approx([0.8, 1.0])
    assert figures["faults_other_recoveries"] == 0
    assert figures["faults_prompts_requeued"] == 3 and figures["faults_lost"] == 0
    assert figures["faults_accounting_ok"] and figures["faults_all_replaced"]


def test_a_victim_never_replaced_is_reported():
    record = _record()
    del record["generator_recoveries"][0]["serving_at"]
    figures = fault_figures(record, victims=[3, 7], killed_at={3: 100.0, 7: 100.1})
    assert figures["faults_detected"] == 2 and figures["faults_replaced"] == 1
    assert not figures["faults_all_replaced"]


def test_the_control_plane_admits_a_prompt_for_every_rollout_loop_at_128_generators(tmp_path):
    """(A + 1) x P prompts admitted at most (the gate's bound) = every rollout loop busy: 4,096
    sequences at G = 128 with the defaults, and the buffer never the tighter bound."""
    from pathlib import Path

    from forge_rl.bench.scale import ScaleArgs
    from forge_rl.bench.scale_runs import control_plane_config
    from forge_rl.config import GRPOConfig
    from forge_rl.yaml_config import load_yaml_config

    args = ScaleArgs()
    base = load_yaml_config(GRPOConfig, Path("configs/sim_scale.yaml"))
    config = control_plane_config(base, args, 128, tmp_path, steps=2)
    loops = config.num_generators * config.prompts_in_flight_per_generator
    assert config.max_episodes_queued == (config.buffer.max_policy_age + 1) * config.prompts_per_step == loops
    assert loops * config.group_size == 4096


def _sim_config(**sim):
    import dataclasses
    from pathlib import Path

    from forge_rl.config import GRPOConfig
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, Path("configs/sim_scale.yaml"))
    return dataclasses.replace(
        base, generator=dataclasses.replace(base.generator, sim=dataclasses.replace(base.generator.sim, **sim))
    )


def test_the_expected_longest_completion_is_the_median_without_spread_and_grows_with_it():
    from forge_rl.bench.scale_bounds import expected_longest_completion

    assert expected_longest_completion(_sim_config(length_sigma=0.0)) == pytest.approx(256, abs=1)
    spread = [expected_longest_completion(_sim_config(length_sigma=sigma)) for sigma in (0.5, 1.0, 2.0)]
    assert 256 < spread[0] < spread[1] < spread[2] <= 4096  # cut at generator.max_new_tokens


def test_the_uniform_batch_floor_trades_generation_against_the_longest_completion():
    """A short train step and a long tail: the best batch is neither the smallest (generation
    would take longest) nor the largest (the longest completion would decode slowest), and the
    floor is no shorter than the train step."""
    from forge_rl.bench.scale_bounds import expected_longest_completion, uniform_batch_floor

    config = _sim_config(time_scale=1.0)
    longest = expected_longest_completion(config)
    floor, batch = uniform_batch_floor(config, tokens_per_step=110_000, train_s=0.01, max_policy_age=8, longest=longest)
    assert 1 < batch < config.generator.max_num_seqs
    assert floor >= 0.01
    slow_train, _ = uniform_batch_floor(
        config, tokens_per_step=110_000, train_s=100.0, max_policy_age=8, longest=longest
    )
    assert slow_train == 100.0


def test_trained_tokens_per_step_leave_out_the_first_step_and_the_masked_tokens():
    # num_tokens is what reached the loss (masked tokens excluded); the first step is the first fill.
    metrics = [{"num_tokens": 10}, {"num_tokens": 300}, {"num_tokens": 100}]
    assert steady_trained_tokens_per_step(metrics, warmup_steps=1) == 200
    assert steady_trained_tokens_per_step(metrics, warmup_steps=2) == 100  # an asynchronous run's first A + 1
    assert steady_trained_tokens_per_step([{"num_tokens": 7}], warmup_steps=1) == 7


def test_the_waiting_floor_is_the_longest_completion_of_an_age_window_decoded_alone():
    """At the bench's workload (A = 8, completions cut at 4,096 tokens), nearly every window of
    A + 1 steps holds a completion at the cut: decoded alone, about 27 simulated seconds spread
    over 9 steps. A larger A spreads it thinner."""
    from forge_rl.bench.scale_bounds import waiting_straggler_floor

    config = _sim_config(time_scale=1.0)
    floor, longest = waiting_straggler_floor(config, max_policy_age=8)
    assert longest == pytest.approx(config.generator.max_new_tokens, rel=0.01)
    assert floor == pytest.approx(27.3 / 9, rel=0.05)
    wider, _ = waiting_straggler_floor(config, max_policy_age=16)
    assert wider < floor


def test_whole_groups_mask_their_short_members_tokens_while_they_wait_for_the_last():
    """At the bench's workload (the synchronous run's tokens and train step of 2026-11-29): at A = 8
    a group waiting for its last completion masks about three times what each completion's own
    length would, and the ceiling in trained tokens lies near 0.9; at A = 16 nothing need be
    masked; without spread in the lengths, nothing either."""
    from forge_rl.bench.scale_bounds import whole_group_masking_ceiling

    config = _sim_config(time_scale=1.0)
    workload = dict(tokens_per_step=110_000, train_s=2.26, groups=4_000)
    at_8 = whole_group_masking_ceiling(config, max_policy_age=8, **workload)
    assert 0 < at_8["masked_by_own_length_fraction"] < at_8["masked_fraction"] < 0.2
    assert at_8["ceiling"] == pytest.approx(1 - at_8["masked_fraction"], rel=0.01)  # a step at the train step's pace
    assert 1 < at_8["batch"] < config.generator.max_num_seqs
    assert whole_group_masking_ceiling(config, max_policy_age=16, **workload)["masked_fraction"] == 0
    assert (
        whole_group_masking_ceiling(_sim_config(time_scale=1.0, length_sigma=0.0), max_policy_age=8, **workload)[
            "ceiling"
        ]
        == 1
    )


@pytest.mark.parametrize("more", [(8,), (0,)])
def test_the_async_parts_staleness_bounds_must_be_distinct_and_positive(more, tmp_path):
    from forge_rl.bench.scale import ScaleArgs, main
    from forge_rl.errors import ConfigError

    args = ScaleArgs(async_max_policy_age=8, async_more_max_policy_ages=more, out_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"must be distinct and >= 1 .*--async-more-max-policy-ages"):
        main(args)
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_the_steady_state_starts_after_the_warmup_steps():
    """An asynchronous run at staleness bound A leaves its first A + 1 steps out: the first fill's
    deadlines fall there."""
    import types

    from forge_rl.bench.scale_runs import RunProbe

    probe = RunProbe(warmup_steps=3)
    # (step, wall time, controller calls so far, rollouts' calls so far): slow start-up steps, then 1 s each.
    probe.step_marks = [(1, 10.0, 5, 50), (2, 30.0, 8, 80), (3, 40.0, 11, 110), (4, 41.0, 14, 140), (5, 42.0, 17, 170)]
    probe.pipeline = types.SimpleNamespace(rollouts_at_stop={"event_loop_lags_s": [], "calls": {}})
    steady = probe.steady()
    assert steady["steps_per_s"] == pytest.approx(1.0)
    assert steady["controller_calls_per_step"] == pytest.approx(3.0)
    assert RunProbe(warmup_steps=1).warmup_steps == 1


def test_at_the_async_parts_batch_the_longest_completions_fit_in_the_headline_age_window(tmp_path):
    """The async-vs-sync part's workload (`async_prompts_per_step`): at 128 prompts a step the
    longest completions, decoded at the batch the engines need to keep up, fit in the A + 1 train
    steps of the headline A, so neither floor binds and a run that waits for them may reach the
    bound; at 32 prompts a step (2.26 s) they did not (both floors above the train step)."""
    import dataclasses

    from forge_rl.bench.scale import ScaleArgs, _async_part_config
    from forge_rl.bench.scale_bounds import expected_longest_completion, uniform_batch_floor, waiting_straggler_floor

    base = _sim_config(time_scale=1.0)
    args = ScaleArgs(out_dir=tmp_path)
    mean_completion, prompt_tokens = 422.0, 15  # the log-normal's mean, cut at 4,096; the task's prompts

    def floors(prompts_per_step: int) -> tuple[float, float, float]:
        config = _async_part_config(
            base,
            dataclasses.replace(args, async_prompts_per_step=prompts_per_step),
            "async",
            args.async_max_policy_age,
            True,
            steps=args.async_steps,
        )
        assert config.prompts_per_step == prompts_per_step
        assert (
            config.prompts_in_flight_per_generator * args.async_generators
            >= (args.async_max_policy_age + 1) * prompts_per_step
        )
        completions = prompts_per_step * config.group_size
        train_s = config.trainer.sim.step_s(int(completions * (mean_completion + prompt_tokens)))
        uniform, _ = uniform_batch_floor(
            config,
            completions * mean_completion,
            train_s,
            args.async_max_policy_age,
            expected_longest_completion(config),
        )
        waiting, _ = waiting_straggler_floor(config, args.async_max_policy_age)
        return train_s, uniform, waiting

    train_s, uniform, waiting = floors(args.async_prompts_per_step)
    assert uniform == train_s and waiting < train_s
    small_train_s, small_uniform, small_waiting = floors(32)
    assert small_uniform > 1.3 * small_train_s and small_waiting > 1.3 * small_train_s


def test_the_async_parts_step_counts_are_checked_before_anything_runs(tmp_path):
    from forge_rl.bench.scale import ScaleArgs, main
    from forge_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"async_sync_steps \(1\) must be >= 2.*--async-sync-steps"):
        main(ScaleArgs(async_sync_steps=1, out_dir=tmp_path))
    assert not any(tmp_path.iterdir())
