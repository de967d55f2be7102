"""Checks that need the file system or the machine, run before the run directory is committed.

`GRPOConfig.__post_init__` checks what the config alone decides (fields, cross-field rules, the
model directory's config.json). What depends on this machine or on file contents is checked here,
by `forge_rl.run.run_dir.create_run_dir`, before any process starts: where the run directory goes,
whether the tokenizer loads and renders the task's prompts within the model's context, and whether
the machine has the cores, memory and GPUs the config asks for. Every failure is a ConfigError
that names the problem and the flag or file that fixes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import cast

from forge_rl.config import GRPOConfig
from forge_rl.errors import ConfigError
from forge_rl.observability.metrics import progress
from forge_rl.pipeline.prompts import encode_row_prompt, open_file_source
from forge_rl.plumbing.placement import (
    MAX_COMPUTE_THREADS_PER_CORE,
    check_gpus,
    check_host_indices,
    check_pinned_cores,
    demand_of,
    local_gpu_count,
)
from forge_rl.plumbing.workers import check_reachable, worker_addresses
from forge_rl.scoring.teacher import check_same_tokenizer
from forge_rl.tasks import encode_task_prompt, make_task_prompt
from forge_rl.tasks.rewards import resolve_reward_fn, reward_columns

NUM_PROMPTS_CHECKED = 256
"""Task prompts rendered by the check (the synthetic tasks draw from a few hundred shapes)."""


def check_machine(config: GRPOConfig) -> None:
    """Run-directory location, cores, memory and GPUs: what the machine must offer the config.
    For a multi-host run: the worker hosts instead (listed, placed, reachable); their GPUs, cores
    and RDMA are checked by launch.start_hosts, which asks each host before spawning anything."""
    check_run_dir_location(config.run_dir)
    if not config.launch.is_local:
        addresses, source = worker_addresses(config.launch)
        check_host_indices(config.launch.placement, len(addresses), source)
        check_reachable(addresses, config.launch.connect_timeout_s)
        return
    check_pinned_cores(config.launch.placement, os.sched_getaffinity(0), "this machine")
    num_gpus = local_gpu_count()
    check_gpus(config.launch, demand_of(config), 0, num_gpus, "this machine")
    if num_gpus:
        return
    if config.simulated:  # timed waits: no compute threads, no KV cache (`forge_rl.engines.simulated`)
        return
    _check_cpu_threads(config)
    _check_kv_cache_memory(config)
    _check_cpu_kv_block_size(config)


def check_run_dir_location(run_dir: Path) -> None:
    """`run_dir` is a directory we can create run directories in, or can be created."""
    existing = Path(run_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"run_dir ({run_dir}) cannot be created: {existing} is a file, not a directory. "
            "Set --run-dir to a directory path."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run_dir ({run_dir}) is not writable: no write permission on {existing}. "
            "Set --run-dir to a writable directory."
        )


def compute_threads(config: GRPOConfig) -> dict[str, int]:
    """The compute threads a local run starts, by the settings that make them: the trainer's
    ranks, the generators, and the frozen models and scorers that run (each process's torch or
    vLLM threads)."""
    trainer, generator = config.trainer, config.generator
    # Numbers: GRPOConfig resolves "auto" (_resolve_auto_threads).
    trainer_threads, generator_threads = cast(int, trainer.num_threads), cast(int, generator.cpu_threads)
    threads = {
        f"trainer.num_procs ({trainer.num_procs}) x trainer.num_threads ({trainer.num_threads})": trainer.num_procs
        * trainer_threads,
        f"num_generators ({config.num_generators}) x generator.cpu_threads ({generator.cpu_threads})": config.num_generators
        * generator_threads,
    }
    for policy in config.policies:  # each with a trainer like the run's and generators of its own
        threads[f"policies.{policy.name}'s trainer ({trainer.num_procs} x {trainer.num_threads})"] = (
            trainer.num_procs * trainer_threads
        )
        threads[
            f"policies.{policy.name}.num_generators ({policy.num_generators}) x generator.cpu_threads ({generator.cpu_threads})"
        ] = policy.num_generators * generator_threads
    threads.update(config.model_threads())
    return threads


def _check_cpu_threads(config: GRPOConfig) -> None:
    threads = compute_threads(config)
    num_threads, num_cores = sum(threads.values()), len(os.sched_getaffinity(0))
    if num_threads > MAX_COMPUTE_THREADS_PER_CORE * num_cores:
        raise ConfigError(
            f"{' + '.join(threads)} = {num_threads} compute threads on {num_cores} CPU core(s), more than "
            f"{MAX_COMPUTE_THREADS_PER_CORE} per core: the run would crawl until timeouts fire. Lower "
            "--trainer.num-procs or --num-generators (or their thread counts), or the other terms' "
            "settings, or use a larger machine."
        )


CPU_KV_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention backend takes KV blocks of a multiple of 32 tokens only."""


def _check_cpu_kv_block_size(config: GRPOConfig) -> None:
    block_size = config.generator.kv_block_size
    if config.generator.engine == "vllm" and block_size is not None and block_size % CPU_KV_BLOCK_MULTIPLE:
        raise ConfigError(
            f"generator.kv_block_size ({block_size}) is not a multiple of {CPU_KV_BLOCK_MULTIPLE}, which vLLM's CPU "
            "attention backend needs: the engine would fail to start. Set --generator.kv-block-size 32 (or another "
            "multiple of 32), or unset it for vLLM's default."
        )


def _check_kv_cache_memory(config: GRPOConfig) -> None:
    available_gib = _available_memory_gib()
    needed_gib = config.generator.kv_cache_space_gib * config.num_generators
    if available_gib is not None and needed_gib > available_gib:
        raise ConfigError(
            f"generator.kv_cache_space_gib ({config.generator.kv_cache_space_gib}) x num_generators "
            f"({config.num_generators}) = {needed_gib:.1f} GiB of KV cache exceeds this machine's "
            f"available memory ({available_gib:.1f} GiB). Lower --generator.kv-cache-space-gib or "
            "--num-generators."
        )


def _available_memory_gib() -> float | None:
    """MemAvailable from /proc/meminfo (Linux); None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def check_model_inputs(config: GRPOConfig, model_dir: Path) -> None:
    """The tokenizer of `model_dir` loads and renders every checked task prompt, and each prompt
    plus `generator.max_new_tokens` fits in the model's context; a distillation teacher has the
    same tokenizer (`forge_rl.scoring.teacher`)."""
    tokenizer = _load_tokenizer(model_dir)
    if config.scorer.teacher.path is not None:
        check_same_tokenizer(config.scorer.teacher.path, model_dir)
    if config.scorer.judge.path is not None:
        _check_judge_tokenizer(config.scorer.judge)
    if config.environment.name is not None and config.environment.renderer == "chat_template":
        _check_environment_renderer(config.environment, model_dir)
    max_model_len = config.model.hf_config()["max_position_embeddings"]
    max_new_tokens = config.generator.max_new_tokens
    if config.eval.enabled:
        check_eval_sets(config, tokenizer, max_model_len)
    if config.data is not None:
        check_data(config, tokenizer, max_model_len)
        return
    for index in range(NUM_PROMPTS_CHECKED):
        prompt = make_task_prompt(config.task, index)
        try:
            token_ids = encode_task_prompt(config.task, tokenizer, prompt.text)
        except ValueError as e:  # prompt_format "chat" on a directory without a chat template
            raise ConfigError(
                f"task.prompt_format ({config.task.prompt_format!r}): {e} Or set --task.prompt-format plain."
            ) from None
        decoded = tokenizer.decode(token_ids)
        # A chat rendering wraps the text in the template's role headers.
        survives = (
            prompt.text.strip() in decoded
            if config.task.prompt_format == "chat"
            else decoded.strip() == prompt.text.strip()
        )
        if not survives:
            raise ConfigError(
                f"task {config.task.name!r} prompt {index} ({prompt.text!r}) does not survive "
                f"{model_dir / 'tokenizer.json'}: it decodes back as {tokenizer.decode(token_ids)!r} "
                "(characters missing from the vocabulary). Use a tokenizer that covers the task's "
                "characters, or omit --model.path to use the tiny model's."
            )
        if len(token_ids) + max_new_tokens > max_model_len:
            raise ConfigError(
                f"task {config.task.name!r} prompt {index} ({prompt.text!r}) is {len(token_ids)} tokens; with "
                f"generator.max_new_tokens ({max_new_tokens}) it needs {len(token_ids) + max_new_tokens} "
                f"positions, more than the model's context (max_position_embeddings = {max_model_len}). "
                "Lower --generator.max-new-tokens, or use a model with a longer context "
                "(--model.tiny.max-position-embeddings for the tiny model)."
            )


def check_data(config: GRPOConfig, tokenizer, max_model_len: int) -> None:
    """The data file opens (its columns and values checked, `forge_rl.data.checks`), its rows carry
    the answers the reward compares against, a chat prompt finds a chat template, and with
    data.too_long refuse no row's prompt is too long (every row counted here, not when it comes up)."""
    if config.data is None:
        raise ValueError("check_data checks a run's data file, and config.data is unset")
    source = open_file_source(
        config.data,
        lambda prompt: encode_row_prompt(config.task, tokenizer, prompt),
        max_model_len,
        config.generator.max_new_tokens,
    )
    check_reward_columns(config, source)
    try:
        if config.data.too_long == "refuse":
            source.check_lengths()
        else:
            source.next_row(0)  # the first row that fits; a file where none fits is refused here
    except ConfigError:
        raise
    except ValueError as e:  # chat messages (or a system prompt) on a model without a chat template
        raise ConfigError(
            f"data.path ({config.data.path!r}) gives chat prompts (data.messages_column or data.system_prompt): {e} "
            "Or use a text column (--data.prompt-column) without --data.system-prompt."
        ) from None


def check_eval_sets(config: GRPOConfig, tokenizer, max_model_len: int) -> None:
    """Each eval set opens, has the answers and columns the task's reward functions read, and has a
    row that fits the context with the evaluation's max_new_tokens; one that shares prompts with
    the training data is warned about with the count (its figures then measure training prompts)."""
    max_new_tokens = config.eval.max_new_tokens or config.generator.max_new_tokens
    train = None
    for i, eval_set in enumerate(config.eval.sets):
        field = f"eval.sets[{i}].data"
        source = open_file_source(
            eval_set.data,
            lambda prompt: encode_row_prompt(config.task, tokenizer, prompt),
            max_model_len,
            max_new_tokens,
            field=field,
        )
        check_reward_columns(config, source)
        source.next_row(0)  # a set where no row fits is refused here
        if config.data is None:
            continue
        if train is None:
            train = open_file_source(
                config.data,
                lambda prompt: encode_row_prompt(config.task, tokenizer, prompt),
                max_model_len,
                config.generator.max_new_tokens,
            )
        prompts = [row.prompt for row in source.first_rows(eval_set.max_prompts)]  # the ones evaluated
        shared = train.count_prompts_among(prompts)
        if shared:
            progress(
                f"WARNING eval set {eval_set.name!r} shares {shared} of its {len(prompts)} evaluated prompts with the "
                f"training data ({train.where}): its figures then measure prompts the run trains on. Use disjoint "
                f"files (or splits) for {field}.path and data.path"
            )


def check_reward_columns(config: GRPOConfig, source) -> None:
    """Each reward function of the task gets what it reads from the data file `source`: the row's
    answer (every reward is called with (completion, answer)) and each column it names as a
    parameter without a default (`forge_rl.tasks.rewards.RewardColumns`). An environment's
    episodes take its rewards instead: nothing to check."""
    if config.environment.name is not None:
        return
    field = "task.reward" if config.task.rewards is None else "task.rewards"
    for spec in config.task.reward_weights:
        reward_columns(resolve_reward_fn(spec, field), spec, field).check(
            spec, field, source.column_names, source.where
        )
    source.require_answer(f"{field} ({', '.join(config.task.reward_weights)})")


def _check_judge_tokenizer(judge) -> None:
    """The judge's tokenizer loads and, for prompt_format chat, has a chat template."""
    tokenizer = _load_tokenizer(judge.path)
    if judge.prompt_format == "chat" and not tokenizer.has_chat_template:
        raise ConfigError(
            f"scorer.judge.prompt_format is chat, but the judge ({judge.path}) has no chat template. Set "
            "--scorer.judge.prompt-format plain, or use an instruct model with a chat template as the judge."
        )


def _check_environment_renderer(environment, model_dir: Path) -> None:
    """The model has the chat template environment.renderer chat_template renders with, and vLLM has
    the tool parser environment.tool_call_parser names: the renderer the run will build, built here."""
    from forge_rl.envs.renderers import make_renderer

    try:
        make_renderer(environment.renderer, model_dir, environment.tool_call_parser)
    except ConfigError:
        raise
    except ValueError as e:  # no chat template
        raise ConfigError(f"environment.renderer ({environment.renderer!r}): {e}") from None


def _load_tokenizer(model_dir: Path):
    from forge_rl.tasks.tokenizer import PromptTokenizer

    for name in ("tokenizer_config.json", "generation_config.json"):
        path = model_dir / name
        try:
            if path.is_file():
                json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"{path} is not valid JSON ({e}). Fix the file or re-export the model directory (save_pretrained)."
            ) from None
    try:
        return PromptTokenizer(model_dir)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:  # special tokens missing from the vocabulary, or no EOS named
        raise ConfigError(str(e)) from None
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise ConfigError(
            f"{model_dir / 'tokenizer.json'} cannot be loaded ({type(e).__name__}: {e}). Re-export the "
            "tokenizer (tokenizer.save_pretrained) or copy a working tokenizer.json into the model directory."
        ) from None
