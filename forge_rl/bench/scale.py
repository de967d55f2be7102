"""`forge-rl bench scale`: the control plane at scale, on SIMULATED engines and trainer.

Every run is the GRPO recipe with real Monarch actors on this machine (the rollouts' process with the
buffer and the prompts, the scorer, the generator pool and one process per generator, the trainer
mesh), but with `generator.engine sim`
and `trainer.engine sim` (`forge_rl.engines.simulated`): no model runs, tokens are placeholders,
decode and train steps are timed waits. What is measured is forge_rl's own work. Each simulated
generator stands in for an engine on a GPU host of its own, so in parts 1 and 3 its process yields
the cores to the run's others (Linux's SCHED_IDLE, `generator.sim.idle_priority`;
`sim_generators_idle_priority` in the figures): 128 of them at normal priority would take most of a
small host's cores from the control plane. Part 2's eight run as the rest: there their answers set the pace.

1. Control-plane overhead at each generator count G (`--generator-counts`), with a zero-cost
   trainer step and prompts per step P = prompts_per_generator_step x G, so every generator has work:
       controller_calls_per_step   endpoint calls the controller process makes per train step,
                                   counted at the train loop's actor handles (loop.RunActors) in
                                   the steady state (first step excluded)
       rollouts_calls_per_step     the same for the rollouts' process (`forge_rl.pipeline.rollouts`,
                                   counted there): per prompt and per generator; the pool's relay
                                   to each generator and the store's messages are in neither
       steps_per_s                 train steps per second in the steady state
       event_loop_lag_p99_ms       how late a 10 ms timer fires, p99 over the steady state, on the
                                   worse of the controller's and the rollouts' event loops (each
                                   also reported), beside the same probe in a process that does
                                   nothing else (idle_process_event_loop_lag_p99_ms: what waiting
                                   for a core costs any process on the machine at that load)
       max_concurrent_rollouts     most sequences decoding at once over all generators (timeline)
       generator_rss_mib           resident memory of one generator process (its actor and the
                                   simulated engine in it), the mean over generators
2. Async vs sync on a long-tail workload with the default GPU calibration (Qwen3-8B decode on one
   H100 per generator, a Qwen3-8B step on 8 H100s; `async_prompts_per_step` x 8 completions a
   step, log-normal lengths cut at 4,096 tokens): forge-rl bench async-vs-sync's analysis of both
   runs (speedup, pipeline efficiency), and the analytic bound of docs/benchmarks/README.md:
       sync step  = straggler + train          (the slowest completion of the step's batch, then the step)
       async step >= max(train, generate, straggler / (A + 1))
   where generate is the step's tokens over the engines' throughput at full batch and A the
   staleness bound; `sim_efficiency_vs_bound` = the bound's speedup achieved, and
   `sim_token_efficiency_vs_bound` the same in tokens that reached the loss per second (the bound
   trains a synchronous step's tokens per step). That bound takes
   generate at the largest batch and the straggler at the synchronous run's speed; no batch gives
   both. `sim_efficiency_vs_uniform_batch_bound` holds both to one batch size B, the best:
       async step >= min over B of max(train, generate(B), longest x decode_step(B) / (A + 1))
   (`uniform_batch_floor`; longest: the expected longest completion of a step's batch).
   `sim_efficiency_vs_waiting_bound` adds what no run that waits for its stragglers can beat,
   however it schedules (`waiting_straggler_floor`): the longest of A + 1 steps' completions
   (Lwin), decoded alone, must fit in the A + 1 steps it may span:
       async step >= max(train, generate, straggler / (A + 1), Lwin x decode_step(1) / (A + 1))
   A third run, asynchronous with partial rollouts (`buffer.wait_for_stragglers` false: the trainer
   waits for no straggler; one past its last step is trained later with its over-age tokens
   masked), against the same bound: `sim_partial_async_speedup`, `sim_partial_efficiency_vs_bound`,
   `sim_partial_token_efficiency_vs_bound` (in trained tokens: its steps train fewer, the masked
   ones excluded) and `sim_partial_dropped_token_fraction` (generated tokens that reached no loss). This part runs
   at `async_time_scale` (1.0: the GPU timings as calibrated).
3. Faults at scale: the control-plane run with `fault_generators` generators; once step
   `fault_kill_after_step` is done, every process of a tenth of them (chosen from `fault_seed`) is
   SIGKILLed. The generator pool must detect each death and replace the generator; the train loop
   waits after step `fault_replaced_by_step` until the replacements serve, so the run cannot end
   before the recovery, and trains on to `fault_steps` with them. Reported: generators killed,
   detected, replaced, detection and replacement latencies, steps completed, prompts requeued,
   trained twice and lost, and `faults_accounting_ok` (`judge_accounting`).

Figures go to OUT_DIR/scale.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forge_rl.bench.async_vs_sync import analyze
from forge_rl.bench.scale_bounds import (
    expected_longest_completion,
    generation_s,
    steady_trained_tokens_per_step,
    uniform_batch_floor,
    waiting_straggler_floor,
    whole_group_masking_ceiling,
)
from forge_rl.bench.scale_faults import faults, judge_accounting
from forge_rl.bench.scale_runs import control_plane_config, max_concurrent_sequences, run_probed
from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import GENERATED_TOKENS_TOTAL
from forge_rl.observability.metrics import progress
from forge_rl.observability.plot import read_metrics

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ScaleArgs:
    config: Path = Path("configs/sim_scale.yaml")
    """Simulation config both parts start from (generator.engine and trainer.engine sim)."""
    generator_counts: tuple[int, ...] = (1, 8, 32, 128)
    """Generator counts of the control-plane part."""
    steps: int = 20
    """Train steps per control-plane run (the first is excluded from the steady-state figures)."""
    prompts_per_generator_step: int = 1
    """Prompts per train step per generator in the control-plane part (P = this x G)."""
    prompts_in_flight_per_generator: int = 4
    """Rollout loops per generator (each a prompt of group_size sequences) in the control-plane part."""
    control_max_policy_age: int = 3
    """buffer.max_policy_age of the control-plane part. The gate keeps at most (A + 1) x P prompts
    admitted and not yet trained, the most that can all be trained within the bound at P a step
    (`forge_rl.core.admission`). A + 1 = prompts_in_flight_per_generator (with P = G prompts a step)
    lets every rollout loop hold a prompt: 4,096 sequences at G = 128. The config's A = 2 left a
    quarter of the loops idle (3,072)."""
    control_median_tokens: float = 32.0
    """Median completion length in the control-plane part: short, so a run measures the control
    plane rather than simulated decoding."""
    time_scale: float = 0.1
    """Wall seconds per simulated second in the control-plane and faults parts (0.1: ten times
    faster than the GPUs would; the control plane's own costs then weigh ten times more)."""
    async_time_scale: float = 1.0
    """Wall seconds per simulated second in the async-vs-sync part. 1.0: the GPU-calibrated timings
    as they are (its five runs take tens of minutes). Faster, the shared cores that run the
    control plane, eight simulated engines and the trainer's process become what limits the
    asynchronous runs, not the schedule (docs/benchmarks/README.md, "scale")."""
    async_generators: int = 8
    """Generators of the async-vs-sync part."""
    async_prompts_per_step: int = 128
    """Prompts per train step of the async-vs-sync part (x group_size 8: 1,024 completions, a
    Qwen3-8B step of about 7.5 s on 8 H100s). A staleness bound counts train steps, and the
    workload's longest completions (cut at 4,096 tokens) take 36-39 s decoded at the batch the
    engines need: at 32 prompts a step (2.26 s) they span 17 steps, so no run that waits for them
    keeps pace below A = 16 (docs/benchmarks/README.md, "scale"); at 128 they fit in the
    A + 1 = 9 steps of the headline A = 8."""
    async_steps: int = 20
    """Train steps per asynchronous run of the async-vs-sync part, the first left out of the
    steady-state figures. An asynchronous run at staleness bound A trains A more, and leaves its
    first A + 1 out: the gate's first fill is admitted at version 0, and those groups' deadlines
    (and their longest completions' stalls) all fall within the first A + 1 steps, a start-up
    transient (docs/benchmarks/README.md, "scale")."""
    async_sync_steps: int = 8
    """Train steps of the async-vs-sync part's synchronous run, the first left out: every step has
    the same shape (its slowest completion, then the train step; about 36 s at 128 prompts)."""
    async_max_policy_age: int = 8
    """Staleness bound A of the asynchronous runs whose figures are the headline ones."""
    async_more_max_policy_ages: tuple[int, ...] = (4,)
    """More staleness bounds, each with its own asynchronous runs (minutes each at time
    scale 1) against the same synchronous run: `sim_by_max_policy_age` in the figures. At A = 4 the
    workload's longest completions (cut at 4,096 tokens), decoded at the engines' batch, about fill
    the A + 1 = 5 train steps they may span: where the tail starts to set the pace. (At 32 prompts a
    step they keep a waiting run well below the bound at A = 8, docs/benchmarks/README.md.)"""
    skip_async_vs_sync: bool = False
    skip_partial_rollouts: bool = False
    """Skip the async-vs-sync part's third run: asynchronous with partial rollouts
    (buffer.wait_for_stragglers false, over-age tokens masked)."""
    fault_generators: int = 128
    """Generators of the faults part: the control plane's largest scale, where a tenth (13) are
    replaced at once while the others serve; minutes on a small shared CPU host (20 take far less,
    docs/benchmarks/README.md)."""
    fault_kill_fraction: float = 0.1
    """Share of the faults part's generators whose processes are SIGKILLed (at least one)."""
    fault_prompts_in_flight_per_generator: int = 2
    """Rollout loops per generator in the faults part: 2, not 4. The gate admits fewer prompts than
    4 x P loops and the loops that win admissions are mostly the same ones, so some generators
    would seldom have a call in progress to lose (docs/benchmarks/README.md, "scale")."""
    fault_seed: int = 0
    """Chooses which generators are killed (`choose_victims`)."""
    fault_steps: int = 20
    """Train steps of the faults run."""
    fault_kill_after_step: int = 5
    """The victims are killed once this step is done."""
    fault_replaced_by_step: int = 10
    """After this step the train loop waits until every victim's replacement serves."""
    fault_recovery_timeout_s: float = 120.0
    """Longest wait for the replacements at fault_replaced_by_step; past it the faults part fails."""
    skip_faults: bool = False
    out_dir: Path = Path("runs/bench-scale")


def control_plane(base: GRPOConfig, args: ScaleArgs, num_generators: int) -> dict:
    config = control_plane_config(base, args, num_generators, args.out_dir / f"g{num_generators}", args.steps)
    started = time.monotonic()
    figures, run_path = run_probed(config)
    return {
        "num_generators": num_generators,
        "prompts_per_step": config.prompts_per_step,
        **figures,
        "max_concurrent_rollouts": max_concurrent_sequences(run_path),
        "run_s": time.monotonic() - started,
    }


def async_vs_sync(base: GRPOConfig, args: ScaleArgs) -> dict:
    """Both modes on the GPU-calibrated long-tail workload; the analytic bound from the sync run.
    The asynchronous runs at `async_max_policy_age` give the headline figures; those at each of
    `async_more_max_policy_ages` go under `sim_by_max_policy_age`, against the same sync run."""
    progress(f"bench scale: sync run, {args.async_generators} simulated generators")
    sync_steady, sync_run = run_probed(
        _async_part_config(base, args, "sync", 0, wait_for_stragglers=True, steps=args.async_sync_steps)
    )
    sync = analyze(sync_run, args.async_generators, target_reward=math.inf)
    sync["steady_wall_per_step_s"] = 1.0 / sync_steady["steps_per_s"]
    sync["steady_trained_tokens_per_step"] = steady_trained_tokens_per_step(read_metrics(sync_run), warmup_steps=1)
    per_age = {}
    for max_policy_age in (args.async_max_policy_age, *args.async_more_max_policy_ages):
        suffix = "" if max_policy_age == args.async_max_policy_age else f"_A{max_policy_age}"
        # async_partial: the asynchronous run with partial rollouts (buffer.wait_for_stragglers
        # false): the trainer never waits for a straggler; one that misses its last step under the
        # age bound is trained later with its over-age tokens masked.
        variants = (("async", True),) + ((("async_partial", False),) if not args.skip_partial_rollouts else ())
        runs, steady = {}, {}
        for mode, wait_for_stragglers in variants:
            progress(f"bench scale: {mode} run, A = {max_policy_age}, {args.async_generators} simulated generators")
            # The same steady-state steps in every asynchronous run: after its first A + 1.
            config = _async_part_config(
                base, args, mode + suffix, max_policy_age, wait_for_stragglers, steps=args.async_steps + max_policy_age
            )
            steady[mode], runs[mode] = run_probed(config, warmup_steps=max_policy_age + 1)
        per_age[max_policy_age] = _async_figures(config, max_policy_age, sync, runs, steady, args.async_generators)
    figures = dict(per_age[args.async_max_policy_age])
    figures["sim_by_max_policy_age"] = {
        str(age): {key: value for key, value in age_figures.items() if key not in ("sync", "async", "async_partial")}
        for age, age_figures in per_age.items()
    }
    return figures


def _async_part_config(
    base: GRPOConfig, args: ScaleArgs, mode: str, max_policy_age: int, wait_for_stragglers: bool, steps: int
) -> GRPOConfig:
    prompts_per_step = args.async_prompts_per_step
    return dataclasses.replace(
        base,
        run_dir=args.out_dir / "async_vs_sync" / mode,
        run_name=None,
        steps=steps,
        num_generators=args.async_generators,
        train_batch_size=prompts_per_step * base.group_size,
        # Every loop can hold a prompt of the (A + 1) x P the gate admits at most.
        prompts_in_flight_per_generator=max(
            base.prompts_in_flight_per_generator, -(-(max_policy_age + 1) * prompts_per_step // args.async_generators)
        ),
        # At the same priority as the rest: eight stand-ins take little of the cores, and their
        # answers are the simulated GPUs' pace, which an idle-priority process behind a busy
        # core delays (partial rollouts then fall further below the bound, docs/benchmarks/README.md).
        generator=dataclasses.replace(
            base.generator,
            sim=dataclasses.replace(base.generator.sim, time_scale=args.async_time_scale, idle_priority=False),
        ),
        trainer=dataclasses.replace(
            base.trainer, sim=dataclasses.replace(base.trainer.sim, time_scale=args.async_time_scale)
        ),
        buffer=dataclasses.replace(
            base.buffer,
            max_policy_age=max_policy_age,
            capacity_episodes=max(base.buffer.capacity_episodes, (max_policy_age + 2) * prompts_per_step),
            wait_for_stragglers=wait_for_stragglers,
            drop_policy=base.buffer.drop_policy if wait_for_stragglers else "mask_tokens",
        ),
    )


def _async_figures(
    config: GRPOConfig,
    max_policy_age: int,
    sync: dict,
    runs: dict[str, Path],
    steady: dict[str, dict],
    num_generators: int,
) -> dict:
    """The asynchronous runs at one staleness bound (`runs`: "async", and "async_partial" unless
    skipped; `config`: theirs) against the synchronous run's analysis `sync` and its bounds."""
    # The timeline analysis of bench async-vs-sync (busy times, pipeline efficiency); no reward to
    # time: a simulation learns nothing.
    per_mode = {mode: analyze(path, num_generators, target_reward=math.inf) for mode, path in runs.items()}
    metrics = {mode: read_metrics(path) for mode, path in runs.items()}
    asynchronous = per_mode["async"]
    # Steady state: the first step (the first fill) excluded, as in the control-plane figures.
    wall_per_step = {"sync": sync["steady_wall_per_step_s"]}
    wall_per_step.update({mode: 1.0 / figures["steps_per_s"] for mode, figures in steady.items()})
    speedup = wall_per_step["sync"] / wall_per_step["async"]
    # The analytic bound, from the sync run's own busy times (docs/benchmarks/README.md): a synchronous
    # step is the straggler's generation then the train step; an asynchronous one can be no
    # shorter than the train step, than the generation work, or than the straggler spread over the
    # A + 1 versions it may span.
    sync_train = sync["trainer_busy_s"] / sync["steps"]
    sync_generate = wall_per_step["sync"] - sync_train
    generate = generation_s(config, sync["generated_tokens_per_s"] * sync["wall_per_step_s"])
    async_floor = max(sync_train, generate, sync_generate / (max_policy_age + 1))
    bound = wall_per_step["sync"] / async_floor
    # The bound above takes the generation term at the largest batch and the straggler term at the
    # synchronous run's speed, which no single batch size gives at once; this one holds both to the
    # same batch (the best one): what any policy that keeps its engines' batches equal can reach.
    tokens_per_step = sync["generated_tokens_per_s"] * sync["wall_per_step_s"]
    longest = expected_longest_completion(config)
    uniform_floor, uniform_batch = uniform_batch_floor(config, tokens_per_step, sync_train, max_policy_age, longest)
    uniform_bound = wall_per_step["sync"] / uniform_floor
    # What no run that waits for its stragglers can beat, however it schedules: the bound's terms
    # with the straggler's taken at the longest completion of A + 1 steps, decoded alone.
    window_floor, window_longest = waiting_straggler_floor(config, max_policy_age)
    waiting_bound = wall_per_step["sync"] / max(async_floor, window_floor)
    # The same bound in tokens that reached the loss per second (a step of the bound trains the
    # synchronous step's tokens): a run that masks or drops tokens trains fewer per step, and its
    # steps per second alone would count the masked ones as trained.
    trained_per_step = {
        mode: steady_trained_tokens_per_step(run_metrics, warmup_steps=max_policy_age + 1)
        for mode, run_metrics in metrics.items()
    }
    bound_tokens_per_s = sync["steady_trained_tokens_per_step"] / async_floor

    def token_efficiency(mode: str) -> float:
        return trained_per_step[mode] / wall_per_step[mode] / bound_tokens_per_s

    partial = {}
    if "async_partial" in runs:
        # Against the same bound: its straggler term bounds a run that waits for stragglers, so
        # one that does not can only come closer to the others.
        masking = whole_group_masking_ceiling(config, tokens_per_step, sync_train, max_policy_age)
        partial_speedup = wall_per_step["sync"] / wall_per_step["async_partial"]
        last = metrics["async_partial"][-1]
        partial = {
            "sim_partial_async_speedup": partial_speedup,
            "sim_partial_efficiency_vs_bound": partial_speedup / bound,
            "sim_partial_token_efficiency_vs_bound": token_efficiency("async_partial"),
            # What a run that trains whole groups can reach in trained tokens with uniform batches.
            "sim_partial_token_efficiency_ceiling": masking["ceiling"],
            "sim_partial_ceiling_batch_sequences": masking["batch"],
            "sim_partial_ceiling_masked_fraction": masking["masked_fraction"],
            "sim_partial_ceiling_masked_by_own_length_fraction": masking["masked_by_own_length_fraction"],
            "sim_partial_async_wall_per_step_s": wall_per_step["async_partial"],
            # Generated tokens that reached no loss: over-age tokens masked, completions dropped.
            "sim_partial_dropped_token_fraction": last["buffer/dropped_tokens"] / last[GENERATED_TOKENS_TOTAL],
            "sim_partial_trainer_idle_fraction": per_mode["async_partial"]["trainer_idle_fraction"],
            "async_partial": per_mode["async_partial"],
        }
    return {
        "sim_max_policy_age": max_policy_age,
        "sim_async_warmup_steps": max_policy_age + 1,
        "sim_async_speedup": speedup,
        "sim_async_speedup_bound": bound,
        "sim_efficiency_vs_bound": speedup / bound,
        "sim_token_efficiency_vs_bound": token_efficiency("async"),
        "sim_bound_trained_tokens_per_s": bound_tokens_per_s,
        "sim_async_speedup_waiting_bound": waiting_bound,
        "sim_efficiency_vs_waiting_bound": speedup / waiting_bound,
        "sim_waiting_straggler_floor_s": window_floor,
        "sim_expected_longest_completion_in_age_window_tokens": window_longest,
        "sim_async_speedup_uniform_batch_bound": uniform_bound,
        "sim_efficiency_vs_uniform_batch_bound": speedup / uniform_bound,
        "sim_uniform_batch_floor_s": uniform_floor,
        "sim_uniform_batch_sequences": uniform_batch,
        "sim_expected_longest_completion_tokens": longest,
        "sim_pipeline_efficiency": asynchronous["pipeline_efficiency"],
        "sim_async_trainer_idle_fraction": asynchronous["trainer_idle_fraction"],
        "sim_sync_wall_per_step_s": wall_per_step["sync"],
        "sim_async_wall_per_step_s": wall_per_step["async"],
        "sim_train_step_s": sync_train,
        "sim_async_floor_s": async_floor,
        "sim_generation_s": generate,
        "sync": sync,
        "async": asynchronous,
        **partial,
    }


def main(args: ScaleArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    if not base.simulated:
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"{args.config} runs the real engine (generator.engine {base.generator.engine}); bench scale runs "
            "simulations only. Pass --config configs/sim_scale.yaml."
        )
    if not args.skip_faults and not 0 < args.fault_kill_after_step < args.fault_replaced_by_step < args.fault_steps:
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"fault_kill_after_step ({args.fault_kill_after_step}) < fault_replaced_by_step "
            f"({args.fault_replaced_by_step}) < fault_steps ({args.fault_steps}) must hold, so the victims are killed "
            "mid-run and the run trains on with their replacements. Fix --fault-kill-after-step, "
            "--fault-replaced-by-step or --fault-steps, or pass --skip-faults."
        )
    ages = (args.async_max_policy_age, *args.async_more_max_policy_ages)
    if not args.skip_async_vs_sync and (min(ages) < 1 or len(set(ages)) < len(ages)):
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"The async-vs-sync part's staleness bounds (async_max_policy_age {args.async_max_policy_age}, "
            f"async_more_max_policy_ages {list(args.async_more_max_policy_ages)}) must be distinct and >= 1 (A = 0 "
            "is the synchronous run, made anyway). Fix --async-max-policy-age or --async-more-max-policy-ages "
            "(pass it with no value for none)."
        )
    if not args.skip_async_vs_sync and (
        min(args.async_steps, args.async_sync_steps) < 2 or args.async_prompts_per_step < 1
    ):
        from forge_rl.errors import ConfigError

        raise ConfigError(
            f"async_steps ({args.async_steps}) and async_sync_steps ({args.async_sync_steps}) must be >= 2 (each "
            f"run's first step is left out of its figures) and async_prompts_per_step ({args.async_prompts_per_step}) "
            ">= 1. Fix --async-steps, --async-sync-steps or --async-prompts-per-step."
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    per_count = []
    for num_generators in args.generator_counts:
        progress(f"bench scale: control plane with {num_generators} simulated generators")
        try:
            per_count.append(control_plane(base, args, num_generators))
        except Exception as e:  # recorded: how many generators fit is one of the figures
            progress(f"bench scale: {num_generators} generators failed: {type(e).__name__}: {e}")
            per_count.append({"num_generators": num_generators, "error": f"{type(e).__name__}: {e}"})
        (args.out_dir / "scale.json").write_text(json.dumps({"control_plane": per_count}, indent=2))
    ok = [r for r in per_count if "error" not in r]
    summary = {
        "simulated": True,
        "date": time.strftime("%Y-%m-%d"),
        "generator_counts": [r["num_generators"] for r in per_count],
        "controller_calls_per_step": [r.get("controller_calls_per_step") for r in per_count],
        "rollouts_calls_per_step": [r.get("rollouts_calls_per_step") for r in per_count],
        "steps_per_s": [r.get("steps_per_s") for r in per_count],
        "event_loop_lag_p99_ms": [r.get("event_loop_lag_p99_ms") for r in per_count],
        "controller_event_loop_lag_p99_ms": [r.get("controller_event_loop_lag_p99_ms") for r in per_count],
        "rollouts_event_loop_lag_p99_ms": [r.get("rollouts_event_loop_lag_p99_ms") for r in per_count],
        "idle_process_event_loop_lag_p99_ms": [r.get("idle_process_event_loop_lag_p99_ms") for r in per_count],
        "max_concurrent_rollouts": [r.get("max_concurrent_rollouts") for r in per_count],
        "generator_rss_mib": [r.get("generator_rss_mib") for r in per_count],
        "max_generators_sustained": max((r["num_generators"] for r in ok), default=0),
        "max_concurrent_rollouts_sustained": max((r["max_concurrent_rollouts"] for r in ok), default=0),
        "accounting_ok": all(judge_accounting(r, args.steps) for r in ok),
        "time_scale": args.time_scale,
        "async_time_scale": args.async_time_scale,
        # The generators' processes yield the cores to the control plane (SimEngineConfig.idle_priority)
        # in the control-plane and faults parts; the async-vs-sync part runs them as the rest.
        "sim_generators_idle_priority": base.generator.sim.idle_priority,
        "control_plane": per_count,
    }
    if not args.skip_async_vs_sync:
        summary.update(async_vs_sync(base, args))
    if not args.skip_faults:
        progress(f"bench scale: faults, {args.fault_generators} simulated generators, a tenth killed")
        try:
            summary.update(faults(base, args))
        except Exception as e:  # recorded, like a generator count that failed: the JSON line says why
            progress(f"bench scale: the faults run failed: {type(e).__name__}: {e}")
            summary.update(faults_error=f"{type(e).__name__}: {e}", faults_accounting_ok=False)
    (args.out_dir / "scale.json").write_text(json.dumps(summary, indent=2))
    return summary
