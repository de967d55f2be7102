"""`forge-rl eval`: the evaluation of training, without training, on a model directory or on a run's
checkpoints.

    forge-rl eval --model-path models/SmolLM2-135M-Instruct --benchmark humaneval \\
        --eval.num-samples 10 --eval.temperature 0.8 --eval.k-values 1 10 --eval.max-new-tokens 256
    forge-rl eval --run runs/grpo-20261201-120000 --every-checkpoint      # the run's eval sets: a curve
    forge-rl eval --model-path DIR --data.path held_out.jsonl --data.answer-column answer \\
        --task.reward exact_match

What is evaluated: the eval sets of `eval.sets` (the `eval:` section of the YAML given with
--config, else of a run's own config.yaml), one more set given by the --data.* flags, and the
built-in benchmark of --benchmark. Sets are sampled and scored as beside training
(`Evaluation.evaluate_served`: the task's prompt format and reward functions, pass@k by the
unbiased estimator); HumanEval's problems (`forge_rl.evaluation.humaneval`) are sampled as a base
model continues code, their plain prompts without a chat template, each sample made a completion
by `completion_of` and checked by its unit tests in the sandbox (`humaneval.evaluate`).

What is evaluated with: generators of the evaluation's own (the generator pool, vLLM engines),
started from the model directory itself (policy version 0 of it; no weight store). A run's
checkpoint is first written as an HF directory (`export_run`) to a temporary directory, which the
engines start from; --every-checkpoint does so for each checkpoint in step order.

What it writes, under --out: eval.jsonl (one record per evaluated model: step, policy_version and
each set's eval/<set>/... figures, the record training writes), eval/<set>/version-<v>.jsonl (each
prompt's samples and rewards; HumanEval's: each problem's `ProblemResult.record()`, its samples and
the completions checked). Progress goes to stderr; the last stdout line is the summary JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_rl.core.checkpoint import COMPLETE_FILE, complete_checkpoints
from forge_rl.data.config import DataConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.errors import ConfigError
from forge_rl.evaluation.config import EvalConfig, EvalSetConfig
from forge_rl.evaluation.humaneval import NUM_PROBLEMS
from forge_rl.observability.metrics import progress
from forge_rl.plumbing.threads import with_chosen_threads
from forge_rl.tasks import TaskConfig

if TYPE_CHECKING:
    from forge_rl.config import GRPOConfig
    from forge_rl.run.evaluation import EvalPrompt, Evaluation

BENCHMARKS = ("humaneval",)
"""The built-in benchmarks of --benchmark."""
PROGRESS_EVERY_S = 10.0
"""Least seconds between two progress lines of the sampling."""
_GENERATE_BASE_S = 300.0
_DECODE_STEP_ALLOWANCE_S = 1.0
"""A generate call's timeout, unless generator.generate_timeout_s is set: the base plus this per
decode step of every round of sequences a call may wait for (the rule of
`GRPOConfig.generate_timeout_s`, for the evaluation's calls)."""


@dataclass(frozen=True)
class EvalArgs:
    """Evaluate a model directory, or a run's checkpoints, on eval sets and benchmarks, without training."""

    model_path: Path | None = None
    """An HF model directory (`forge-rl convert` writes SmolLM2-135M-Instruct to
    models/SmolLM2-135M-Instruct); or --run."""
    run: Path | None = None
    """A run directory: its newest complete checkpoint is evaluated (each one with
    --every-checkpoint). Without --config, the run's config.yaml gives the task, sampling and eval sets."""
    every_checkpoint: bool = False
    """With --run: evaluate every complete checkpoint in step order (a curve), not only the newest."""
    config: Path | None = None
    """A YAML config as `forge-rl grpo` reads it: its task (prompt format, rewards), generator
    (sampling) and eval (sets, samples, k) sections are the defaults here; the rest is not read."""
    benchmark: str | None = None
    """A built-in benchmark evaluated beside the eval sets: "humaneval" (OpenAI's 164 problems,
    checked by their unit tests in the sandbox)."""
    num_problems: int | None = None
    """HumanEval: only its first this many problems (HumanEval/0 on); unset: all 164."""
    data: DataConfig | None = None
    """One more eval set, from a data file (the --data.* flags of `forge-rl grpo`)."""
    set_name: str | None = None
    """The name of the --data.path set (its metrics, its results file); unset: the file's name
    without its extension."""
    max_prompts: int = 200
    """Most prompts of the --data.path set: its first rows in the order of data.seed."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """How rows become prompts (prompt_format) and what scores them (reward, rewards)."""
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """The engines: top_p, top_k, KV cache, threads (temperature and length are the eval's)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Samples per prompt (num_samples), the k of pass@k, temperature, max_new_tokens, num_generators."""
    out: Path | None = None
    """Where the results go (a new or empty directory); unset: runs/eval-<model or run name>-<time>."""

    def __post_init__(self) -> None:
        _, generator = with_chosen_threads(None, self.generator, trainer_procs=0, generators=self.eval.num_generators)
        object.__setattr__(self, "generator", generator)
        if (self.model_path is None) == (self.run is None):
            raise ConfigError(
                "forge-rl eval evaluates one model: pass --model-path DIR (an HF model directory) or --run RUN_DIR "
                f"(a run's checkpoints), not {'both' if self.model_path is not None else 'neither'}."
            )
        if self.every_checkpoint and self.run is None:
            raise ConfigError("--every-checkpoint evaluates a run's checkpoints: pass --run RUN_DIR with it.")
        if self.benchmark is not None and self.benchmark not in BENCHMARKS:
            raise ConfigError(
                f"--benchmark {self.benchmark!r} is not a built-in benchmark; the built-in ones are "
                f"{', '.join(BENCHMARKS)}. Set --benchmark humaneval, or give eval sets (--data.path, or eval.sets in --config)."
            )
        if self.num_problems is not None and not 1 <= self.num_problems <= NUM_PROBLEMS:
            raise ConfigError(
                f"--num-problems ({self.num_problems}) must be between 1 and HumanEval's {NUM_PROBLEMS}, or unset (all)."
            )
        if self.num_problems is not None and self.benchmark is None:
            raise ConfigError("--num-problems limits HumanEval's problems: pass --benchmark humaneval with it.")
        if self.max_prompts < 1:
            raise ConfigError(f"--max-prompts ({self.max_prompts}) must be >= 1.")
        if self.benchmark is None and self.data is None and not self.eval.sets:
            raise ConfigError(
                "nothing to evaluate: no --benchmark, no --data.path and no eval.sets. Pass --benchmark humaneval, "
                "--data.path FILE (with --data.answer-column and --task.reward), or --config with an eval: section."
            )
        if self.benchmark is not None and self.benchmark in self.set_names:
            raise ConfigError(
                f"an eval set is named {self.benchmark!r}, as --benchmark {self.benchmark} is: their results would share "
                "a name. Rename the set (--set-name, or its name in eval.sets)."
            )

    @property
    def data_set(self) -> EvalSetConfig | None:
        """The --data.path set, named by --set-name or the file."""
        if self.data is None:
            return None
        name = self.set_name or "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(self.data.path).stem)
        return EvalSetConfig(name=name or "data", data=self.data, max_prompts=self.max_prompts)

    @property
    def sets(self) -> tuple[EvalSetConfig, ...]:
        """eval.sets and the --data.path set."""
        data_set = self.data_set
        return self.eval.sets + ((data_set,) if data_set is not None else ())

    @property
    def set_names(self) -> list[str]:
        return [eval_set.name for eval_set in self.sets]


def default_args(config: Path | None, run: Path | None) -> EvalArgs:
    """The defaults the flags go on top of: the task, generator and eval sections of `config` (a
    GRPOConfig YAML), else of `run`'s config.yaml, else the built-in defaults. Other sections of
    the file are not used, so they are not checked (a model.path of another machine is fine)."""
    base = _base_config(config, run)
    sections = {} if base is None else {"task": base.task, "generator": base.generator, "eval": base.eval}
    # Built without EvalArgs' checks (the defaults name no model yet): tyro builds the checked
    # EvalArgs from these values and the flags.
    args = object.__new__(EvalArgs)
    for item in dataclasses.fields(EvalArgs):
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        object.__setattr__(args, item.name, sections.get(item.name, default))
    return args


def _base_config(config: Path | None, run: Path | None) -> GRPOConfig | None:
    from forge_rl.config import GRPOConfig
    from forge_rl.run.run_dir import saved_config_path
    from forge_rl.yaml_config import load_yaml_config

    if config is None and run is not None:
        if not Path(run).is_dir():
            raise ConfigError(
                f"--run {run} does not exist. Pass a run directory (RUN_DIR, as `forge-rl grpo` printed it)."
            )
        config = saved_config_path(run)
        if not config.is_file():
            raise ConfigError(
                f"--run {run}: {config} does not exist; not a run directory. Pass the directory a run printed."
            )
    if config is None:
        return None
    try:
        return load_yaml_config(GRPOConfig, config)
    except ConfigError:
        # Only the task, generator and eval sections are read, and tyro checks those; the others
        # (a model or hosts of another machine) need not hold here.
        return load_yaml_config(GRPOConfig, config, checked=False)


@dataclass(frozen=True)
class Target:
    """One model to evaluate: a directory, or a run's checkpoint written to one first."""

    step: int
    """The run's step the checkpoint holds; 0 for a model directory."""
    policy_version: int
    """The checkpoint's policy version; 0 for a model directory (the weights it holds)."""
    model_dir: Path | None = None
    checkpoint: Path | None = None

    @contextlib.contextmanager
    def model(self, run: Path | None) -> Iterator[Path]:
        """The model directory to serve: `model_dir`, or the checkpoint exported to a temporary
        directory (removed afterwards)."""
        if self.model_dir is not None:
            yield self.model_dir
            return
        if run is None:
            raise ValueError(f"checkpoint step {self.step} is exported from its run directory, and none was given")
        from forge_rl.run.export import export_run

        progress(
            f"writing checkpoint step {self.step} (policy version {self.policy_version}) of {run} as an HF model directory"
        )
        directory = Path(tempfile.mkdtemp(prefix=f"forge-rl-eval-step-{self.step}-"))
        try:
            yield export_run(run, directory / "model", checkpoint=self.checkpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def targets_of(args: EvalArgs) -> list[Target]:
    """What `args` evaluates, in order; ConfigError naming the path and the fix when it is not there."""
    from forge_rl.config import REQUIRED_MODEL_FILES

    if args.model_path is not None:
        path = Path(args.model_path)
        if not path.is_dir():
            raise ConfigError(
                f"--model-path {path} does not exist. Pass an HF model directory (`forge-rl convert` writes "
                "models/SmolLM2-135M-Instruct; `forge-rl export RUN_DIR OUT` writes a run's), or --run RUN_DIR."
            )
        missing = [name for name in REQUIRED_MODEL_FILES if not (path / name).is_file()]
        if missing:
            raise ConfigError(
                f"--model-path {path} lacks {', '.join(missing)}: not an HF model directory. Point it at one "
                "(config.json, safetensors weights, tokenizer.json)."
            )
        return [Target(step=0, policy_version=0, model_dir=path)]
    assert args.run is not None  # EvalArgs takes --model-path or --run
    checkpoints = complete_checkpoints(Path(args.run))
    if not checkpoints:
        raise ConfigError(
            f"--run {args.run} has no complete checkpoint (RUN_DIR/checkpoints/step-*/COMPLETE) to evaluate. Train with "
            "--checkpoint.enabled true (the demo config does), or pass --model-path DIR to evaluate a model directory."
        )
    targets = []
    for step, path in checkpoints if args.every_checkpoint else checkpoints[-1:]:
        complete = json.loads((path / COMPLETE_FILE).read_text())
        targets.append(Target(step=step, policy_version=int(complete.get("policy_version", step)), checkpoint=path))
    return targets


def out_dir_of(args: EvalArgs) -> Path:
    """--out (new or empty), else runs/eval-<name>-<time>; created."""
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(
                f"--out {out} exists and is not an empty directory: results of two evaluations would mix. "
                "Pass a new directory to --out, or omit it (runs/eval-<name>-<time>)."
            )
    else:
        evaluated = args.model_path if args.model_path is not None else args.run
        assert evaluated is not None  # EvalArgs takes --model-path or --run
        name = Path(evaluated).resolve().name
        out = Path("runs") / f"eval-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def eval_config_of(args: EvalArgs, model_dir: Path) -> GRPOConfig:
    """The GRPOConfig whose evaluation `forge-rl eval` runs on `model_dir`: the model, the task,
    the generator and eval sections of `args` (every eval set in eval.sets), checked as a run's."""
    from forge_rl.config import GRPOConfig, ModelConfig

    generator = args.generator
    if generator.generate_timeout_s is None:
        from forge_rl.run.evaluation import CALLS_PER_GENERATOR, PROMPTS_PER_CALL

        # The evaluation's own calls: PROMPTS_PER_CALL prompts of num_samples each, CALLS_PER_GENERATOR
        # in flight, of eval.max_new_tokens each; vLLM decodes max_num_seqs sequences at once.
        sequences = PROMPTS_PER_CALL * CALLS_PER_GENERATOR * args.eval.num_samples
        rounds = -(-sequences // generator.max_num_seqs)
        max_new_tokens = args.eval.max_new_tokens or generator.max_new_tokens
        generator = dataclasses.replace(
            generator, generate_timeout_s=_GENERATE_BASE_S + rounds * max_new_tokens * _DECODE_STEP_ALLOWANCE_S
        )
    try:
        return GRPOConfig(
            model=ModelConfig(path=Path(model_dir)),
            task=args.task,
            generator=generator,
            # On generators of its own: there is no run whose generators it could share.
            eval=dataclasses.replace(args.eval, sets=args.sets, placement="own"),
        )
    except ConfigError:
        raise
    except ValueError as e:  # a component's own check
        raise ConfigError(str(e)) from None


async def evaluate_models(args: EvalArgs) -> dict:
    """Evaluate every target of `args` (module docstring); the summary: the newest target's
    figures, with every target's in "curve" under --every-checkpoint."""
    started = time.monotonic()
    targets = targets_of(args)
    out = out_dir_of(args)
    progress(f"evaluating {len(targets)} model(s) of {args.model_path or args.run}; results in {out}")
    records = []
    for target in targets:
        with target.model(args.run) as model_dir:
            records.append(await _evaluate_target(args, target, model_dir, out))
    summary = {
        "model": str(args.model_path or args.run),
        **records[-1],
        "seconds": round(time.monotonic() - started, 1),
        "out": str(out),
        "eval_jsonl": str(out / "eval.jsonl"),
    }
    if args.every_checkpoint:
        summary["curve"] = records
    return summary


async def _evaluate_target(args: EvalArgs, target: Target, model_dir: Path, out: Path) -> dict:
    """One model on every set and benchmark: its summary (step, version, each set's figures)."""
    from forge_rl.run.evaluation import Evaluation
    from forge_rl.run.preflight import check_model_inputs

    config = eval_config_of(args, model_dir)
    if config.eval.sets:  # each set opens, has the columns its rewards read, and a row that fits
        check_model_inputs(config, model_dir)
    humaneval = _humaneval_prompts(args, config, model_dir) if args.benchmark == "humaneval" else None
    started = time.monotonic()
    step, version = target.step, target.policy_version
    summary: dict[str, Any] = {"step": step, "policy_version": version}
    async with _generators(config, model_dir) as generators:
        meter = _SamplingProgress(config.eval.num_samples)
        evaluation = Evaluation(config, generators, None, out, model_dir, on_sampled=meter.sampled)
        try:
            evaluation.load_sets()
            meter.num_prompts = sum(map(len, evaluation.sets.values())) + len(humaneval or ())
            if evaluation.sets:  # eval.jsonl gets the sets' record, as beside training
                # The engines started from the model directory (a checkpoint's export), which they
                # serve as their version 0, whatever policy version it holds.
                record = await evaluation.evaluate_served(step, version, stamped=0)
                for name in evaluation.sets:
                    summary[name] = _set_figures(record, name, out / "eval" / name / f"version-{version}.jsonl")
            if humaneval is not None:  # and HumanEval's its own
                humaneval_started = time.monotonic()
                summary["humaneval"] = figures = await _evaluate_humaneval(evaluation, humaneval, version, out)
                record = {
                    "step": step,
                    "policy_version": version,
                    **{f"eval/humaneval/{k}": v for k, v in figures.items() if k != "results"},
                    "eval/seconds": time.monotonic() - humaneval_started,
                }
                with open(out / "eval.jsonl", "a") as file:
                    file.write(json.dumps(record) + "\n")
        finally:
            await evaluation.finish()
    summary["seconds"] = round(time.monotonic() - started, 1)
    return summary


def _set_figures(record: dict, name: str, results: Path) -> dict:
    prefix = f"eval/{name}/"
    return {**{k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}, "results": str(results)}


@contextlib.asynccontextmanager
async def _generators(config: GRPOConfig, model_dir: Path):
    """The evaluation's own generator pool (eval.num_generators vLLM engines started from
    `model_dir`) on the hosts of config.launch; stopped, with every process, on the way out."""
    from forge_rl.actors.generator_pool import GeneratorPlacement, GeneratorPool
    from forge_rl.run import launch
    from forge_rl.run.evaluation import Evaluation

    hosts = await launch.start_hosts(config, str(model_dir))
    try:
        services = hosts.spawn_services()
        tp = config.generator.tensor_parallel_size
        host = hosts.owned_host(config.launch.placement.services_host)
        placements = [
            GeneratorPlacement(host, tuple(range(i * tp, (i + 1) * tp))) for i in range(config.eval.num_generators)
        ]
        pool = services.spawn(
            "eval_generators",
            GeneratorPool,
            Evaluation.generator_config(config),
            str(model_dir),
            config.max_model_len,
            config.eval.num_generators,
            None,
            placements,
            config.generate_timeout_s,
            config.update_timeout_s,
        )
        progress(f"starting {config.eval.num_generators} vLLM engine(s) on {model_dir} (tens of seconds on a CPU)")
        try:
            await pool.start.call_one()
            yield pool
        finally:
            with contextlib.suppress(Exception):
                await pool.shutdown.call_one()
    finally:
        await hosts.stop()


class _SamplingProgress:
    """Progress lines of the sampling: prompts and samples done, seconds, an estimate of what is left."""

    def __init__(self, num_samples: int):
        self.num_prompts = 0
        self.num_samples = num_samples
        self.done = 0
        self.started = time.monotonic()
        self.last = self.started

    def sampled(self, num_prompts: int) -> None:
        self.done += num_prompts
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and self.done < self.num_prompts:
            return
        self.last = now
        elapsed = now - self.started
        left = elapsed / self.done * max(self.num_prompts - self.done, 0)
        progress(
            f"sampled {self.done}/{self.num_prompts} prompts ({self.done * self.num_samples} samples), "
            f"{elapsed:.0f} s, about {left:.0f} s left"
        )


def _humaneval_prompts(args: EvalArgs, config: GRPOConfig, model_dir: Path) -> list[EvalPrompt]:
    """HumanEval's problems as prompts: each prompt's text tokens alone (no chat template, no
    special tokens), as a base model continues a file; ConfigError when one does not fit the
    context with the evaluation's max_new_tokens."""
    from forge_rl.evaluation.humaneval import load_problems
    from forge_rl.run.evaluation import EvalPrompt
    from forge_rl.tasks.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(model_dir)
    max_new_tokens = config.eval.max_new_tokens or config.generator.max_new_tokens
    problems = list(load_problems().values())[: args.num_problems]
    prompts = []
    for number, problem in enumerate(problems):
        token_ids = tokenizer.encode_text(problem.prompt)
        if len(token_ids) + max_new_tokens > config.max_model_len:
            raise ConfigError(
                f"HumanEval problem {problem.task_id}'s prompt is {len(token_ids)} tokens; with eval.max_new_tokens "
                f"({max_new_tokens}) it needs {len(token_ids) + max_new_tokens} positions, more than the model's "
                f"context ({config.max_model_len}). Lower --eval.max-new-tokens."
            )
        prompts.append(EvalPrompt(number, problem.prompt, problem.task_id, token_ids, None))
    return prompts


async def _evaluate_humaneval(evaluation: Evaluation, prompts: list[EvalPrompt], version: int, out: Path) -> dict:
    """Sample every problem, check each sample's completion in the sandbox, write each problem's
    record; the figures (pass@k, counts, mean tokens, the results file)."""
    from forge_rl.evaluation import humaneval
    from forge_rl.evaluation.results import version_of

    episodes = await evaluation.sample(prompts)
    version_of(episodes, 0)  # the engines serve the model directory as their version 0
    problems = humaneval.load_problems()
    completions = {
        episode.answer: [humaneval.completion_of(problems[episode.answer], c.text) for c in episode.completions]
        for episode in episodes
    }
    path = out / "eval" / "humaneval" / f"version-{version}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(results: tuple[humaneval.ProblemResult, ...] | None) -> None:
        """Each problem's samples (before the check: the sampling is the costly part, kept should
        the check fail), with its `ProblemResult.record()` once checked."""
        with open(path, "w") as file:
            for episode, problem in zip(episodes, results or [None] * len(episodes), strict=True):
                file.write(
                    json.dumps(
                        {
                            **(problem.record() if problem is not None else {"task_id": episode.answer}),
                            "prompt": episode.prompt_text,
                            "samples": [
                                {
                                    "text": c.text,
                                    "completion": checked,
                                    "num_tokens": c.num_tokens,
                                    "status": c.status.value,
                                }
                                for c, checked in zip(episode.completions, completions[episode.answer])
                            ],
                        }
                    )
                    + "\n"
                )

    write(None)
    progress(f"humaneval: checking {sum(map(len, completions.values()))} samples in the sandbox (samples in {path})")
    result = await humaneval.evaluate(completions, evaluation.eval.k_values, problems=problems, progress=progress)
    write(result.problems)
    tokens = [c.num_tokens for episode in episodes for c in episode.completions]
    totals = result.totals()
    figures = {
        **{f"pass@{k}": result.pass_at_k[k] for k in evaluation.eval.k_values},
        "num_problems": totals["num_problems"],
        "num_samples": totals["num_samples"],
        "num_passed": totals["num_passed"],
        "mean_tokens": sum(tokens) / len(tokens),
        "check_s": totals["elapsed_s"],
        "results": str(path),
    }
    shown = ", ".join(f"pass@{k} {figures[f'pass@{k}']:.3f}" for k in evaluation.eval.k_values)
    progress(f"humaneval of policy version {version}: {shown} over {figures['num_problems']} problems")
    return figures
