"""The GRPO recipe's config: composes each component's config and checks rules that span them.

Each component owns its config beside the code that reads it (`BufferConfig` in buffer.py,
`GeneratorConfig` in engines/vllm_engine.py, `TrainerConfig` in trainer.py, ...). This module only
composes them and validates cross-field rules in `GRPOConfig.__post_init__`, so every check runs
when the config is built: from YAML (`load_yaml_config`), from flags (tyro), or in Python, and
always before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from forge_rl.core.branches import BranchConfig
from forge_rl.core.buffer import BufferConfig
from forge_rl.core.checkpoint import CheckpointConfig
from forge_rl.core.policies import Policies, PolicyConfig
from forge_rl.data.config import DataConfig
from forge_rl.engines.adapters import AdapterServing
from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.rollout import EnvironmentConfig
from forge_rl.errors import ConfigError
from forge_rl.evaluation.config import EvalConfig
from forge_rl.models.hf_checkpoint import weight_files
from forge_rl.models.lora_config import check_rank, check_targets, llama_layer_shapes
from forge_rl.models.parallel import read_hf_config, validate_parallelism
from forge_rl.models.tiny import TinyModelConfig
from forge_rl.observability.health import MismatchAlarmConfig
from forge_rl.plumbing.placement import LaunchConfig, check_placement, demand_of
from forge_rl.plumbing.threads import AUTO, with_chosen_threads
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.store.publisher import PublishConfig
from forge_rl.tasks import TaskConfig
from forge_rl.tasks import tokenizer as char_tokenizer
from forge_rl.tasks.rewards import import_function, resolve_reward_fn, reward_columns
from forge_rl.training.reference import ReferenceConfig
from forge_rl.training.trainer_config import TrainerConfig

REQUIRED_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
"""Besides the safetensors weights: model.safetensors, or shards listed in model.safetensors.index.json."""

# What the derived generator timeouts are made of (GRPOConfig.generate_timeout_s, update_timeout_s).
# A timeout turns a hung generator into a replaced one; one that fires on a healthy generator
# throws its work away and restarts its engine, so these are far above a healthy generator's times.
_GENERATE_TIMEOUT_BASE_S = 300.0
"""The part of a generate call that does not scale with its length: its prefill, waiting out a
weight swap's pause (a whole reload with swap_loader "reload"), a loaded host's scheduling."""
_DECODE_STEP_ALLOWANCE_S = 1.0
"""Seconds allowed per decode step a call may wait for: far above a decode step of 256 sequences, of the
demo's tiny model or a 100M-parameter one on a CPU (`forge-rl bench weight-sync`) or of a model on a GPU.
A second per step is reached only by an engine that has all but stopped."""
_UPDATE_TIMEOUT_S = 600.0
"""A weight update end to end (`forge_rl.store.loader`): a small fraction of this for a small model, cross-host
included (`forge-rl bench weight-sync`, docs/benchmarks/README.md); the slowest legitimate case in
view, a 100+ GB model fetched over Monarch's TCP fallback, takes minutes.
Updates of one generator run one at a time, so an update may first wait out the one before it."""


@dataclass(frozen=True)
class ModelConfig:
    path: Path | None = None
    """HF model directory (config.json, safetensors weights, tokenizer.json) of a llama3, qwen3 or
    qwen3-MoE model. Unset: a tiny model is created from scratch in the run directory from `model.tiny`."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the from-scratch model, used when `model.path` is unset."""

    def hf_config(self) -> dict:
        """The model's config.json as a dict (the tiny model's, derived, when path is unset)."""
        if self.path is None:
            tiny = self.tiny
            return {
                "num_attention_heads": tiny.num_heads,
                "num_key_value_heads": tiny.num_kv_heads,
                "max_position_embeddings": tiny.max_position_embeddings,
                **({"num_experts": tiny.num_experts} if tiny.num_experts else {}),  # checked by trainer.parallel.ep
                "hidden_size": tiny.hidden_size,
                "intermediate_size": tiny.intermediate_size,
                "vocab_size": char_tokenizer.VOCAB_SIZE,  # the run's tiny model: the default alphabet
            }
        missing = [name for name in REQUIRED_MODEL_FILES if not (self.path / name).is_file()]
        if missing:
            raise ConfigError(
                f"model.path ({self.path}) lacks {', '.join(missing)}. Point --model.path at an HF "
                f"model directory ({', '.join(REQUIRED_MODEL_FILES)} and safetensors weights), or omit "
                "it to create a tiny model from scratch."
            )
        try:
            weight_files(self.path)
            return read_hf_config(self.path)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"model.path ({self.path}) has a config.json that is not valid JSON ({e}). Fix the file, or "
                "re-export the model directory with save_pretrained."
            ) from None
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model.path ({self.path}): {e}") from None


@dataclass(frozen=True)
class LogConfig:
    """Where metrics go besides RUN_DIR/metrics.jsonl, which always gets every step (docs/observability.md)."""

    progress_every_s: float = 5.0
    """Seconds between progress lines on stderr (every step is always in metrics.jsonl)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."""
    wandb: bool = False
    """Also log to Weights & Biases, into RUN_DIR/wandb. Offline by default (see wandb_mode)."""
    wandb_project: str = "forge_rl"
    """W&B project name; the W&B run is named after the run directory."""
    mismatch_alarm: MismatchAlarmConfig = field(default_factory=MismatchAlarmConfig)
    """Warn when a generator's sampler mismatch jumps (`forge_rl.observability.health`): on by default."""
    event_loop_lag: bool = False
    """Time the rollouts' event loop (`forge_rl.pipeline.rollouts`): how late a 10 ms timer fires, every 10 ms,
    reported at the end of the run (`forge-rl bench scale` turns it on)."""
    rollouts: bool = False
    """Write every trained episode to RUN_DIR/rollouts.jsonl as its step is accounted for: step,
    episode id, generator, prompt (text and ids) and each completion's text, reward, status, token
    ids, logprobs, policy versions and tokens trained, and its agent in a multi-agent environment
    (`forge_rl.pipeline.rollouts.rollout_record`)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline needs no network or account: upload later with `wandb sync RUN_DIR/wandb/offline-run-*`.
    online streams to the W&B server (needs `wandb login`)."""

    def __post_init__(self) -> None:
        if not self.progress_every_s >= 0:
            raise ValueError(
                f"log.progress_every_s ({self.progress_every_s}) must be >= 0. Set --log.progress-every-s."
            )


@dataclass(frozen=True)
class GRPOConfig:
    """Asynchronous GRPO: generators, scorer, replay buffer and trainer as Monarch actors."""

    config: Path | None = None
    """YAML file loaded first; flags given after it override its values."""
    run_dir: Path = Path("runs")
    """Parent of the run directory (config.yaml, metrics.jsonl, model/)."""
    run_name: str | None = None
    """Run directory name under run_dir; unset: grpo-YYYYmmdd-HHMMSS."""
    resume: Path | None = None
    """Run directory to continue from its newest complete checkpoint (`forge-rl grpo --resume
    runs/NAME`). Its config.yaml is the base; flags may change steps, logging, checkpointing and
    the like, not the model, task, group size or trainer parallelism (docs/checkpointing.md)."""
    steps: int = 100
    """Trainer optimizer steps (= policy versions published)."""
    train_batch_size: int = 128
    """Completions per optimizer step; a multiple of group_size (prompts per step = batch / group)."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalized within a group."""
    num_generators: int = 1
    """Generator actors, each running one vLLM engine in its own process."""
    prompts_in_flight_per_generator: int = 16
    """Prompts (each a group of group_size samples) a generator decodes concurrently. Each is its
    own request, so vLLM batches them continuously and a long completion holds back no other."""
    train_step_timeout_s: float = 1800.0
    """Most seconds one train step (the optimizer step on every trainer rank, then the snapshot its
    publish starts from) may take. A step past it means a hung rank or collective: the run stops with
    TrainStepTimedOut, naming the command that resumes it. Half an hour is far past the steps of the
    recipes and benchmarks (docs/benchmarks/README.md holds their step times); large batches of long
    sequences take minutes, and a step longer than this needs it raised."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group with no nonzero advantage on a token that trains (its final,
    step, turn and token rewards give no contrast: no learning signal) is filtered out before the
    buffer, so every batch is made of groups with a signal; filtered prompts are counted
    (accounting.filtered_zero_advantage)."""
    dynamic_sampling_max_filtered_steps: int = 10
    """With dynamic_sampling: the run stops with NoLearningSignal, naming the cause, once this many
    steps' worth of groups in a row (times train_batch_size / group_size) were all filtered: then
    no batch can be filled, and the trainer would wait for one forever. A group with a signal
    starts the count again."""
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig | None = None
    """Prompts from a data file (forge_rl/data, docs/data.md) instead of the task's generator; unset by
    default. The task still gives the reward (task.reward or task.rewards, against data.answer_column
    and the columns each reward function names) and the prompt format of text prompts
    (task.prompt_format); its name and seed must stay at their defaults, since the file, not the
    task, decides the prompts."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes against an environment (forge_rl/envs/, docs/environments.md) instead of
    the task's single-turn prompts; unset by default."""
    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    branch: BranchConfig = field(default_factory=BranchConfig)
    """Branch rollouts: grow each sampled group into a tree of continuations from pivots inside
    its completions (docs/branches.md); off by default (branch.rule none)."""
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen reference model of the KL penalty; spawned only when trainer.loss.kl_beta > 0."""
    publish: PublishConfig = field(default_factory=PublishConfig)
    """How the trainer publishes each version to the weight store (dtype, background write,
    checksums): `forge_rl.store.publisher`, docs/weight_store.md."""
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """The hosts of the run and where each role runs (docs/multi_host.md); this machine by default."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation at exact policy versions beside training, on eval sets from files
    (`forge_rl.evaluation.config`, docs/evaluation.md); none by default."""
    policies: tuple[PolicyConfig, ...] = ()
    """More policies beside the run's own, each playing the seats of a multi-agent environment it
    names with weights, a trainer, generators and versions of its own (`forge_rl.core.policies`,
    docs/environments.md "Several policies"); none by default: the run's policy plays every seat."""

    @property
    def prompts_per_step(self) -> int:
        """Episodes (prompt groups) per optimizer step = train_batch_size / group_size."""
        return self.train_batch_size // self.group_size

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + completion) the model serves: its max_position_embeddings."""
        return self.model.hf_config()["max_position_embeddings"]

    @property
    def max_episode_tokens(self) -> int:
        """Most tokens one episode can hold (what buffer.capacity_tokens counts): a prompt of at most
        max_model_len - max_new_tokens tokens, once, plus group_size completions of max_new_tokens
        (with branch rollouts, every completion its tree can hold: `BranchConfig.max_completions_per_group`);
        with an environment, group_size trajectories (and their forks) of
        environment.limits.max_total_tokens (each holds its own prompt)."""
        if self.environment.name is not None:
            max_total_tokens = self.environment.limits.max_total_tokens
            assert max_total_tokens is not None  # __post_init__ resolves an environment's limits
            return self.branch.max_completions_per_group(self.group_size) * max_total_tokens
        max_new_tokens = self.generator.max_new_tokens
        return (
            self.max_model_len
            - max_new_tokens
            + self.branch.max_completions_per_group(self.group_size) * max_new_tokens
        )

    @property
    def max_completion_tokens(self) -> int:
        """Most tokens one completion can generate: generator.max_new_tokens, or with an environment
        a trajectory's, environment.limits `max_generated_tokens` (its turns within its token
        budget). Dr. GRPO's length normalizer."""
        if self.environment.name is not None:
            return self.environment.limits.max_generated_tokens
        return self.generator.max_new_tokens

    @property
    def max_tokens_per_request(self) -> int:
        """Most tokens one generator request samples: generator.max_new_tokens, or with an
        environment one turn's environment.limits.max_tokens_per_turn."""
        if self.environment.name is not None:
            max_tokens_per_turn = self.environment.limits.max_tokens_per_turn
            assert max_tokens_per_turn is not None  # __post_init__ resolves an environment's limits
            return max_tokens_per_turn
        return self.generator.max_new_tokens

    @property
    def max_episodes_queued(self) -> int:
        """Most episodes admitted and not yet trained (`forge_rl.core.admission`) = min(
        (buffer.max_policy_age + 1) * prompts_per_step with admission "pause", buffer.capacity_episodes,
        buffer.capacity_tokens // max_episode_tokens). Never more than the buffer can hold, so no
        admitted episode ever waits for room while the trainer waits for it."""
        bounds = [self.buffer.capacity_episodes]
        if self.buffer.admission == "pause":
            bounds.append((self.buffer.max_policy_age + 1) * self.prompts_per_step)
        if self.buffer.capacity_tokens is not None:
            bounds.append(self.buffer.capacity_tokens // self.max_episode_tokens)
        return min(bounds)

    @property
    def generate_timeout_s(self) -> float:
        """generator.generate_timeout_s, or when unset: what a generate call can legitimately take,
        with a wide margin = _GENERATE_TIMEOUT_BASE_S (300 s) + decode_rounds x
        generator.max_new_tokens x _DECODE_STEP_ALLOWANCE_S (1 s per decode step), where
        decode_rounds = ceil(prompts_in_flight_per_generator x group_size / generator.max_num_seqs):
        the sequences a generator has in flight may exceed what vLLM decodes at once, and a call
        may then wait for earlier ones to finish. The demo's: 300 + 1 x 2 x 1 = 302 s. With an
        environment a call is one turn, of environment.limits.max_tokens_per_turn
        (`max_tokens_per_request`)."""
        if self.generator.generate_timeout_s is not None:
            return self.generator.generate_timeout_s
        sequences_in_flight = self.prompts_in_flight_per_generator * self.group_size
        decode_rounds = -(-sequences_in_flight // self.generator.max_num_seqs)
        return _GENERATE_TIMEOUT_BASE_S + decode_rounds * self.max_tokens_per_request * _DECODE_STEP_ALLOWANCE_S

    @property
    def update_timeout_s(self) -> float:
        """generator.update_timeout_s, or when unset: _UPDATE_TIMEOUT_S (600 s), plus
        `generate_timeout_s` with generator.swap_mode "wait", whose swap first waits for every
        request in flight to finish."""
        if self.generator.update_timeout_s is not None:
            return self.generator.update_timeout_s
        return _UPDATE_TIMEOUT_S + (self.generate_timeout_s if self.generator.swap_mode == "wait" else 0.0)

    def __post_init__(self) -> None:
        """Every rule that spans components, in the order a user fixes them: batch shape, buffer,
        loss, model and parallelism, timeouts, placement."""
        self._resolve_auto_threads()
        self._resolve_environment_limits()
        self._resolve_branch_entropy()
        self._check_batch_shape()
        self._check_buffer()
        self._check_loss_and_scorer()
        self._check_model_and_parallelism()
        self._check_environment()
        self._check_data()
        self._check_timeouts()
        self._check_simulation()
        self._check_keep_routing()
        self._check_branch()
        self._check_eval()
        self._check_policies()
        check_placement(self.launch, demand_of(self))

    def _check_batch_shape(self) -> None:
        _check_positive(
            self,
            "steps",
            "train_batch_size",
            "group_size",
            "num_generators",
            "prompts_in_flight_per_generator",
            "dynamic_sampling_max_filtered_steps",
        )
        if self.generator.temperature <= 0:
            # The engine takes 0 (greedy) for an evaluation's own engines; RL samples.
            raise ConfigError(
                f"generator.temperature ({self.generator.temperature}) must be > 0: greedy decoding is not RL sampling "
                "(every completion of a group would be the same). Set --generator.temperature (greedy evaluation: "
                "--eval.temperature 0)."
            )
        if self.group_size < 2:
            raise ConfigError(
                f"group_size ({self.group_size}) must be >= 2: GRPO normalizes rewards within a group, "
                "so a group of one has zero advantage. Set --group-size."
            )
        if self.train_batch_size % self.group_size:
            raise ConfigError(
                f"train_batch_size ({self.train_batch_size}) is not divisible by group_size "
                f"({self.group_size}); a step trains whole groups. Set --train-batch-size to a multiple "
                f"of {self.group_size}."
            )
        parallel = self.trainer.parallel
        if self.train_batch_size % parallel.dp_degree:
            raise ConfigError(
                f"train_batch_size ({self.train_batch_size}) is not divisible by trainer.parallel.dp_replicate "
                f"({parallel.dp_replicate}) * trainer.parallel.dp_shard ({parallel.dp_shard}) = "
                f"{parallel.dp_degree}; each data-parallel rank takes an equal share. Set --train-batch-size, "
                "--trainer.parallel.dp-shard or --trainer.parallel.dp-replicate."
            )

    def _check_buffer(self) -> None:
        if self.buffer.capacity_episodes < self.prompts_per_step:
            raise ConfigError(
                f"buffer.capacity_episodes ({self.buffer.capacity_episodes}) is below one step's prompts "
                f"({self.prompts_per_step}); the trainer could never fill a batch. Raise "
                "--buffer.capacity-episodes."
            )
        capacity_tokens = self.buffer.capacity_tokens
        if capacity_tokens is not None and capacity_tokens < self.prompts_per_step * self.max_episode_tokens:
            raise ConfigError(
                f"buffer.capacity_tokens ({capacity_tokens}) is below one step's prompts ({self.prompts_per_step}) "
                f"times the most tokens an episode can hold ({self.max_episode_tokens}: a prompt of up to "
                f"max_model_len - generator.max_new_tokens, plus group_size ({self.group_size}) completions of "
                f"generator.max_new_tokens ({self.generator.max_new_tokens})); the trainer could wait forever for a "
                f"batch. Set --buffer.capacity-tokens to at least {self.prompts_per_step * self.max_episode_tokens}, "
                "or leave it unset."
            )

    def _check_loss_and_scorer(self) -> None:
        loss = self.trainer.loss
        if loss.name == "dr_grpo" and loss.length_normalizer != self.max_completion_tokens:
            longest = (
                "generator.max_new_tokens"
                if self.environment.name is None
                else "the most tokens a trajectory can generate: min(environment.limits.max_turns x "
                "max_tokens_per_turn, max_total_tokens)"
            )
            raise ConfigError(
                f"trainer.loss.length_normalizer ({loss.length_normalizer}) must equal "
                f"{self.max_completion_tokens} ({longest}) for dr_grpo: Dr. GRPO divides by the longest "
                f"possible completion. Set --trainer.loss.length-normalizer {self.max_completion_tokens}."
            )
        if self.environment.name is not None:
            self._check_environment_scorers()
        overlong_buffer = self.scorer.overlong_buffer
        if overlong_buffer is not None and overlong_buffer > self.generator.max_new_tokens:
            raise ConfigError(
                f"scorer.overlong_buffer ({overlong_buffer}) exceeds generator.max_new_tokens "
                f"({self.generator.max_new_tokens}): the penalty ramps over the last overlong_buffer tokens "
                "of the budget. Set --scorer.overlong-buffer to at most generator.max_new_tokens."
            )

    def _check_environment_scorers(self) -> None:
        """A reward model or a judge reads a completion's text, and a trajectory's text is its
        last turn only: on an environment's episodes it would score a fragment, so it is refused.
        A teacher scores every generated token of the trajectory and runs with one."""
        for section, path in (("reward_model", self.scorer.reward_model.path), ("judge", self.scorer.judge.path)):
            if path is not None:
                flag = "--scorer." + section.replace("_", "-") + ".path"
                raise ConfigError(
                    f"scorer.{section}.path ({path}) is set with environment.name ({self.environment.name!r}): a "
                    f"{section.replace('_', ' ')} reads a completion's text, and a trajectory's is its last turn "
                    f"only, so it would score a fragment of the episode. Unset {flag} and reward the episode in the "
                    "environment (its final and per-turn rewards), or distill with a teacher, which scores every "
                    "generated token of the trajectory (--scorer.teacher.path, or --scorer.teacher.pin)."
                )

    def _check_model_and_parallelism(self) -> None:
        hf_config = self.model.hf_config()
        validate_parallelism(self.trainer.parallel, self.trainer.num_procs, hf_config)
        lora = self.trainer.lora
        if lora.enabled:  # the shapes TorchTitan will build, checked before any process starts
            shapes = llama_layer_shapes(hf_config)
            try:
                check_targets(lora, list(shapes))
                check_rank(lora, {name: shape for name, shape in shapes.items() if name in lora.targets})
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.uses_reference_model:
            self._check_frozen_model(self.reference, hf_config)
        if self.uses_teacher:
            pinned = self.scorer.teacher.path is None  # a snapshot of the policy itself
            teacher_hf_config = hf_config if pinned else self._teacher_hf_config()
            self._check_frozen_model(self.scorer.teacher, teacher_hf_config)
            if pinned:
                self._check_pinned_teacher_weights()
            else:
                self._check_teacher_context(teacher_hf_config["max_position_embeddings"])
        if self.scorer.judge.path is not None:
            self._check_judge()

    def _check_judge(self) -> None:
        judge = self.scorer.judge
        try:
            judge_context = ModelConfig(path=judge.path).hf_config()["max_position_embeddings"]
        except ConfigError as e:
            raise ConfigError(
                f"scorer.judge.path: {e} Point --scorer.judge.path at the judge's HF model directory."
            ) from None
        if judge.max_model_len > judge_context:
            raise ConfigError(
                f"scorer.judge.max_model_len ({judge.max_model_len}) exceeds the judge's context "
                f"(max_position_embeddings = {judge_context} in {judge.path}/config.json). Set "
                f"--scorer.judge.max-model-len {judge_context} or less."
            )
        if judge.generator.max_new_tokens >= judge.max_model_len:
            raise ConfigError(
                f"scorer.judge.generator.max_new_tokens ({judge.generator.max_new_tokens}) leaves no room for the "
                f"judge's prompt in scorer.judge.max_model_len ({judge.max_model_len}). Lower "
                "--scorer.judge.generator.max-new-tokens."
            )

    def _check_frozen_model(self, config: ReferenceConfig, hf_config: dict) -> None:
        """A reference model or a teacher: its parallelism fits its model and splits a group evenly."""
        section, flag = config.section, "--" + config.section.replace("_", "-")
        validate_parallelism(config.parallel, config.num_procs, hf_config, section=section)
        dp = config.parallel.dp_degree
        if self.group_size % dp:
            raise ConfigError(
                f"group_size ({self.group_size}) is not divisible by {section}.parallel.dp_replicate "
                f"({config.parallel.dp_replicate}) * {section}.parallel.dp_shard ({config.parallel.dp_shard}) "
                f"= {dp}: the {section} model scores one group at a time, split evenly over its data-parallel "
                f"ranks, so the first rollout would fail. Set --group-size to a multiple of {dp}, or "
                f"{flag}.parallel.dp-shard (with {flag}.num-procs) to a divisor of it."
            )

    def _check_pinned_teacher_weights(self) -> None:
        """A pinned teacher stages policy versions from the weight store as its whole weights; with
        LoRA a version there is the adapter alone, which is no model's weights."""
        if self.trainer.lora.enabled:
            raise ConfigError(
                f"scorer.teacher.pin ({self.scorer.teacher.pin}) with trainer.lora.enabled: a pinned teacher loads "
                "policy versions from the weight store as its weights, and with LoRA the store holds only each "
                "version's adapter, not a model. Distill from a fixed teacher (--scorer.teacher.pin fixed with "
                "--scorer.teacher.path, a model directory with the student's tokenizer), or train the whole model "
                "(--trainer.lora.no-enabled)."
            )

    def _check_teacher_context(self, teacher_context: int) -> None:
        """The teacher reads every sequence the student makes, whole: a prompt with its completion
        (up to the student's context), or with an environment a whole trajectory."""
        if self.environment.name is not None:
            max_total_tokens = self.environment.limits.max_total_tokens
            assert max_total_tokens is not None  # __post_init__ resolves an environment's limits
            longest, source = max_total_tokens, "environment.limits.max_total_tokens"
            fix = f"Set --environment.limits.max-total-tokens {teacher_context} or less"
        else:
            longest, source = self.max_model_len, "max_model_len, the student's max_position_embeddings"
            fix = (
                f"Use a student whose context is {teacher_context} tokens or less (model.path, or "
                "--model.tiny.max-position-embeddings)"
            )
        if teacher_context < longest:
            raise ConfigError(
                f"scorer.teacher.path ({self.scorer.teacher.path}) has a context of {teacher_context} tokens "
                f"(max_position_embeddings in its config.json), below the student's longest sequence ({longest} "
                f"tokens: {source}): the teacher could not score the longest prompts and completions. {fix}, or "
                f"distill from a teacher whose context holds {longest} tokens."
            )

    def _teacher_hf_config(self) -> dict:
        """The teacher directory's config.json; a ConfigError naming scorer.teacher.path when the
        directory is not a model (the tokenizer is compared with the student's by
        `forge_rl.run.preflight`, once the student's directory exists)."""
        try:
            return ModelConfig(path=self.scorer.teacher.path).hf_config()
        except ConfigError as e:
            raise ConfigError(
                f"scorer.teacher.path: {e} Point --scorer.teacher.path at the teacher's HF model directory "
                "(a trained run exports as one: `forge-rl export --run RUN_DIR --out DIR`)."
            ) from None

    def _check_environment(self) -> None:
        warmup = self.environment.warmup.episodes > 0
        if warmup and (
            self.environment.name is None or self.model.path is not None or self.environment.renderer != "plain"
        ):
            raise ConfigError(
                f"environment.warmup.episodes ({self.environment.warmup.episodes}) needs an environment "
                f"(environment.name: {self.environment.name!r}), a from-scratch model (model.path unset: "
                f"{self.model.path}) and the plain renderer ({self.environment.renderer!r}): the warm-up trains "
                "the tiny model the run creates, on its plain format. Set --environment.warmup.episodes 0, or "
                "those fields."
            )
        if self.environment.name is None:
            return
        max_total_tokens = self.environment.limits.max_total_tokens
        assert max_total_tokens is not None  # __post_init__ resolves an environment's limits
        if max_total_tokens > self.max_model_len:
            raise ConfigError(
                f"environment.limits.max_total_tokens ({max_total_tokens}) exceeds the model's context "
                f"(max_model_len, its max_position_embeddings: {self.max_model_len}): an episode would "
                "outgrow what the generator can read and end truncated at the context instead of at the "
                f"budget. Set --environment.limits.max-total-tokens to at most {self.max_model_len}, or unset it to follow the model."
            )
        if self.scorer.overlong_buffer is not None:
            raise ConfigError(
                f"scorer.overlong_buffer ({self.scorer.overlong_buffer}) is set with environment.name "
                f"({self.environment.name!r}): an environment's episodes take their reward from the "
                "environment, never from the scorer, so the penalty would not apply. Unset "
                "--scorer.overlong-buffer, or fold a length penalty into the environment's reward."
            )

    def _check_data(self) -> None:
        """A data file and a task's own prompt sequence are two sources of prompts: a task name or seed
        other than the default with data.path set would be silently ignored, so it is refused. Without
        data, a reward function that reads a row's column (`forge_rl.tasks.rewards`) would find none:
        refused too."""
        if self.data is None:
            if self.environment.name is None:
                self._check_rewards_read_no_column()
            elif self.environment.reads_row == "required":
                raise ConfigError(
                    f"environment.name ({self.environment.name!r}) takes a `row` (the data row of each prompt), and "
                    "data.path is unset: there are no rows. Set --data.path to the file whose rows drive the episodes, "
                    "or give the factory's row parameter a default (row=None) to play without one."
                )
            return
        default = TaskConfig()
        for name, fix in (("name", "data.path decides the prompts"), ("seed", "set --data.seed for the file's order")):
            value = getattr(self.task, name)
            if value != getattr(default, name):
                raise ConfigError(
                    f"data.path ({self.data.path!r}) and task.{name} ({value!r}) are both set, and the prompts come "
                    f"from one source: {fix}. Unset --task.{name} (default {getattr(default, name)!r}), or unset "
                    "data to train on the task."
                )
        if self.environment.name is not None and self.environment.reads_row is None:
            raise ConfigError(
                f"data.path ({self.data.path!r}) and environment.name ({self.environment.name!r}) are both set, and "
                "that environment's factory takes (seed, index) and no row, so it would make its own prompts and "
                "ignore the file. Give the factory a `row` parameter, def make_env(seed, index, row), to play each "
                "row's episode; or unset --environment.name to train on the file's prompts, or unset data to train "
                "on the environment."
            )

    def _resolve_auto_threads(self) -> None:
        """trainer.num_threads / generator.cpu_threads "auto" become numbers chosen from this
        machine's cores (`forge_rl.plumbing.threads`), so config.yaml records what ran."""
        if self.scorer.judge.generator.cpu_threads == AUTO:
            raise ConfigError(
                "scorer.judge.generator.cpu_threads (auto): only the policy's trainer and generators choose "
                "their threads from the cores. Set --scorer.judge.generator.cpu-threads to a number."
            )
        num_policies = 1 + len(self.policies)
        generators = self.num_generators + sum(p.num_generators for p in self.policies)
        generators += self.eval.num_generators if self.eval.enabled and self.eval.placement == "own" else 0
        trainer, generator = with_chosen_threads(
            self.trainer,
            self.generator,
            trainer_procs=0 if self.trainer.engine == "sim" else self.trainer.num_procs * num_policies,
            generators=0 if self.generator.engine == "sim" else generators,
            fixed_threads=sum(self.model_threads().values()),
            trainer_cpus=self.launch.placement.trainer_cpus,
            generator_cpus=self.launch.placement.generator_cpus,
            hosts=self.launch.hosts,
        )
        object.__setattr__(self, "trainer", trainer)
        object.__setattr__(self, "generator", generator)

    def model_threads(self) -> dict[str, int]:
        """The compute threads of the models beside the policy's trainer and generators, by the
        settings that make them: the frozen models that run (reference, distillation teacher) and
        the scorer's models (preflight counts them with the rest; "auto" threads share the cores
        left by them)."""
        frozen = [(self.reference, "reference")] if self.uses_reference_model else []
        frozen += [(self.scorer.teacher, "scorer.teacher")] if self.uses_teacher else []
        threads = {
            f"{section}.num_procs ({model.num_procs}) x {section}.num_threads ({model.num_threads})": model.num_procs
            * model.num_threads
            for model, section in frozen
        }
        return {**threads, **self.scorer.model_threads()}

    def _resolve_environment_limits(self) -> None:
        """environment.limits' unset token limits follow the model and the generator: a trajectory may
        fill the model's context (max_model_len) and a turn samples at most generator.max_new_tokens,
        as a single-turn completion does (`EpisodeLimits.resolved`)."""
        limits = self.environment.limits
        if self.environment.name is None or limits.is_resolved:
            return
        resolved = limits.resolved(self.max_model_len, self.generator.max_new_tokens)
        object.__setattr__(self, "environment", dataclasses.replace(self.environment, limits=resolved))

    def _resolve_branch_entropy(self) -> None:
        """branch.rule entropy reads each token's entropy, which the generator then records."""
        if (
            self.branch.rule == "entropy"
            and self.generator.record_entropy_top_logprobs != self.branch.entropy_top_logprobs
        ):
            generator = dataclasses.replace(
                self.generator, record_entropy_top_logprobs=self.branch.entropy_top_logprobs
            )
            object.__setattr__(self, "generator", generator)

    def _check_branch(self) -> None:
        branch = self.branch
        if not branch.enabled:
            return
        if self.environment.name is not None:
            self._check_episode_forks()
        refused = [
            (
                self.generator.segment_tokens is not None,
                f"generator.segment_tokens ({self.generator.segment_tokens})",
                "a group sampled a segment at a time is branched nowhere",
            ),
            (
                self.simulated,
                "generator.engine sim",
                "a simulated engine's placeholder tokens have no distribution to pivot on",
            ),
            (
                self.trainer.keep_routing,
                "trainer.keep_routing",
                "a branch's context holds no routing record of its parent's prefix",
            ),
        ]
        for refuse, setting, why in refused:
            if refuse:
                raise ConfigError(
                    f"branch.rule ({branch.rule}) with {setting}: {why}. Set --branch.rule none, or change {setting}."
                )
        max_new_tokens = self.generator.max_new_tokens
        if branch.min_prefix_tokens + branch.min_suffix_tokens > max_new_tokens:
            raise ConfigError(
                f"branch.min_prefix_tokens ({branch.min_prefix_tokens}) + branch.min_suffix_tokens "
                f"({branch.min_suffix_tokens}) exceed generator.max_new_tokens ({max_new_tokens}): no completion has "
                "a position to branch from. Lower them, or raise --generator.max-new-tokens."
            )
        if branch.function is not None:
            import_function(branch.function, "branch.function")

    def _check_episode_forks(self) -> None:
        """Branch rollouts of environment episodes fork them at the starts of turns, replaying the
        turns before on a fresh environment (`forge_rl.envs.forks`)."""
        from forge_rl.envs.forks import refuse_unless_replayable

        branch, name = self.branch, self.environment.name
        assert name is not None  # _check_branch asks this only of a run with an environment
        if branch.rule not in ("token_prob", "function"):
            raise ConfigError(
                f"branch.rule ({branch.rule}) with environment.name ({name!r}): an environment episode forks at the "
                "start of a turn, which rule token_prob (the turn of the least likely token) or function picks; the "
                "generator records no entropies of turns. Set --branch.rule token_prob or function."
            )
        if branch.depth != 1:
            raise ConfigError(
                f"branch.depth ({branch.depth}) with environment.name ({name!r}): a fork of an environment episode "
                "is not forked again. Set --branch.depth 1."
            )
        if self.environment.reads_row != "required":  # one whose factory needs a row is checked per episode
            refuse_unless_replayable(self.environment.make_env()(self.task.seed, 0), name)

    @property
    def run_policies(self) -> Policies:
        """The run's policies resolved (`forge_rl.core.policies`): who plays each seat, each one's age bound."""
        return Policies(self.policies, self.buffer.max_policy_age)

    def policy_trainer_config(self, policy: PolicyConfig) -> TrainerConfig:
        """The trainer of one of `policies`: the run's trainer with its own learning rate."""
        return self.trainer if policy.lr is None else dataclasses.replace(self.trainer, lr=policy.lr)

    def _check_policies(self) -> None:
        """Several policies need a native multi-agent environment whose seats they name, and the
        parts of a run that know one policy only are refused with them, before anything starts."""
        if not self.policies:
            return
        policies = self.run_policies  # names and seats checked there
        names = [p.name for p in self.policies]
        name = self.environment.name
        if name is None:
            raise ConfigError(
                f"policies ({names}) with no environment.name: a policy plays seats of a multi-agent environment "
                "(forge_rl/envs/graph.py). Set --environment.name, or drop policies."
            )
        refused = [
            (
                self.branch.enabled,
                f"branch.rule ({self.branch.rule})",
                "forks replay turns on the run's own generators",
                "--branch.rule none",
            ),
            (
                self.simulated or self.trainer.engine == "sim",
                "a simulated engine or trainer",
                "it publishes no weights per policy",
                "vllm and the TorchTitan trainer",
            ),
            (self.eval.enabled, "eval.sets", "an evaluation samples the run's own policy only", "no eval.sets"),
            (
                self.launch.hosts != "local",
                f"launch.hosts ({self.launch.hosts})",
                "the other policies' roles are placed on this machine only",
                "launch.hosts local",
            ),
        ]
        for refuse, setting, why, fix in refused:
            if refuse:
                raise ConfigError(f"policies ({names}) with {setting}: {why}. Use {fix}, or drop policies.")
        if self.environment.reads_row == "required":
            return  # its factory needs a data row: its seats are checked when its first episode is made
        env = self.environment.make_env()(self.task.seed, 0)
        from forge_rl.envs.graph import declared_seats, is_multi_agent

        if not is_multi_agent(env):
            raise ConfigError(
                f"policies ({names}) with environment {name!r}, which is not a multi-agent environment "
                "(forge_rl/envs/graph.py MultiAgentEnvironment: seats, reset, step): its one agent is the run's "
                "own policy. Drop policies, or use an environment with seats."
            )
        policies.check_seats({seat.name: seat.trainable for seat in declared_seats(env).values()}, name)

    def _check_rewards_read_no_column(self) -> None:
        field = "task.reward" if self.task.rewards is None else "task.rewards"
        for spec in self.task.reward_weights:
            required = reward_columns(resolve_reward_fn(spec, field), spec, field).required
            if required:
                raise ConfigError(
                    f"{field} {spec!r} has parameter(s) {', '.join(map(repr, required))}, which it reads as column(s) "
                    f"of each row, and the prompts are task {self.task.name!r}'s, which have no columns (only an answer). "
                    "Set --data.path to a file with those columns, or give the parameter(s) a default "
                    f"(e.g. {required[0]}=None)."
                )

    def _check_timeouts(self) -> None:
        if not 0 < self.train_step_timeout_s < math.inf:
            raise ConfigError(
                f"train_step_timeout_s ({self.train_step_timeout_s}) must be > 0 and finite: it is what turns a "
                "hung trainer into a stopped run. Set --train-step-timeout-s."
            )
        if self.generator.swap_mode == "wait" and self.update_timeout_s < self.generate_timeout_s:
            raise ConfigError(
                f"generator.update_timeout_s ({self.update_timeout_s:g}) is below the generate timeout "
                f"({self.generate_timeout_s:g} s) with generator.swap_mode wait: such a swap first waits for every "
                "request in flight to finish, so a healthy update can take as long as a generate call, and its "
                f"generator would be replaced as hung. Set --generator.update-timeout-s to at least "
                f"{self.generate_timeout_s:g}, or leave it unset."
            )

    @property
    def simulated(self) -> bool:
        """Whether this run is a SIMULATION (generator.engine and trainer.engine sim): no model runs,
        tokens are placeholders, nothing is trained (`forge_rl.engines.simulated`)."""
        return self.generator.engine == "sim"

    def _check_eval(self) -> None:
        if not self.eval.enabled:
            return
        if self.simulated:
            raise ConfigError(
                "eval.sets with a simulation (generator.engine sim): a simulated engine samples placeholder tokens, "
                "so an evaluation would measure nothing. Unset eval.sets, or run the real engine."
            )
        if self.environment.name is not None:
            raise ConfigError(
                f"eval.sets with environment.name ({self.environment.name!r}): an evaluation samples single-turn "
                "completions of its sets' prompts, scored by the task's reward functions, not environment episodes. "
                "Unset eval.sets, or evaluate the run's checkpoints with `forge-rl eval`."
            )
        max_new_tokens = self.eval.max_new_tokens or self.generator.max_new_tokens
        if self.eval.placement == "shared" and max_new_tokens > self.generator.max_new_tokens:
            raise ConfigError(
                f"eval.max_new_tokens ({max_new_tokens}) above generator.max_new_tokens ({self.generator.max_new_tokens}) "
                "with eval.placement shared: the run's generators are sized for their own requests. Lower "
                "--eval.max-new-tokens, or use --eval.placement own."
            )
        if max_new_tokens >= self.max_model_len:
            raise ConfigError(
                f"eval.max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the model's context "
                f"({self.max_model_len}). Lower --eval.max-new-tokens."
            )

    def _check_simulation(self) -> None:
        generator, trainer = self.generator.engine, self.trainer.engine
        if (generator == "sim") != (trainer == "sim"):
            raise ConfigError(
                f"generator.engine ({generator}) and trainer.engine ({trainer}) must both be sim or neither: a "
                "simulated trainer publishes version numbers without weights, and a real one would train on a "
                "simulated engine's placeholder tokens. Set --generator.engine sim --trainer.engine sim for a "
                "simulation of the control plane, or --generator.engine vllm --trainer.engine torchtitan."
            )
        if not self.simulated:
            return
        if self.uses_reference_model:
            raise ConfigError(
                f"trainer.loss.kl_beta ({self.trainer.loss.kl_beta}) > 0 needs the reference model, which a "
                "simulation (generator.engine sim) does not run. Set --trainer.loss.kl-beta 0."
            )
        if self.uses_teacher or self.scorer.judge.path is not None:
            raise ConfigError(
                "scorer.teacher (path or pin) and scorer.judge.path need models, which a simulation (generator.engine "
                "sim) does not run. Leave --scorer.teacher.path, --scorer.judge.path unset and --scorer.teacher.pin fixed."
            )
        if self.checkpoint.enabled:
            raise ConfigError(
                "checkpoint.enabled is true, but a simulated trainer (trainer.engine sim) has no state to "
                "checkpoint. Set --checkpoint.enabled false."
            )

    def _check_keep_routing(self) -> None:
        hf_config = self.model.hf_config()
        if self.generator.record_routing and not (hf_config.get("num_experts") or hf_config.get("num_local_experts")):
            raise ConfigError(
                "generator.record_routing is on but the model is dense: there is no expert routing to record. "
                "Set --model.tiny.num-experts (a tiny Qwen3-MoE) or --model.path to a MoE checkpoint, or "
                "--generator.no-record-routing."
            )
        if self.trainer.keep_routing and not self.generator.record_routing:
            raise ConfigError(
                "trainer.keep_routing is on but generator.record_routing is off: no completion would carry a "
                "routing record, so every one would fall back to the trainer's own routing. Set "
                "--generator.record-routing, or --trainer.no-keep-routing."
            )

    def adapter_serving(self, model_dir: str) -> AdapterServing | None:
        """With trainer.lora.enabled, how generators serve the adapter versions the trainer
        publishes: rank trainer.lora.rank, buffer.max_policy_age + 1 adapters resident (every
        version a request in flight may still use), on the base in `model_dir`. None otherwise."""
        if not self.trainer.lora.enabled:
            return None
        return AdapterServing(self.trainer.lora.rank, self.buffer.max_policy_age + 1, str(Path(model_dir)))

    @property
    def uses_reference_model(self) -> bool:
        """Whether a frozen reference model runs (for the KL penalty)."""
        return self.trainer.loss.kl_beta > 0

    @property
    def uses_teacher(self) -> bool:
        """Whether a distillation teacher runs (`forge_rl.scoring.teacher`)."""
        return self.scorer.teacher.enabled


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ConfigError(f"{name} ({value}) must be >= 1. Set --{name.replace('_', '-')}.")
