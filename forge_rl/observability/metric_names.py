"""The names of the metrics that more than one module reads: the keys of metrics.jsonl, TensorBoard
and W&B, and of the run summary. Each constant's docstring is its entry in
docs/reference/metrics.md (`make reference`)."""

from __future__ import annotations

# The loop writes them; the summary, the progress line, the plots and the benchmarks read them.
STEP = "step"
"""Batches the trainer consumed: the step a record is of (1 for the first trained batch)."""


WALL_TIME_S = "wall_time_s"
"""Seconds since the loops started (the timeline's origin)."""


REWARD_MEAN = "reward/mean"
"""Mean reward of the step's completions, ERRORED ones aside."""


TEACHER_POLICY_VERSION = "teacher/policy_version"
"""Self-distillation: the policy version the pinned teacher serves (`forge_rl.scoring.teacher.TeacherPin`)."""


REWARD_COMPONENTS = "reward/components"
"""Prefix of each reward component's mean over the step's scored completions:
`reward/components/<name>` (`forge_rl.scoring.scorers.Score.components`)."""


LOSS = "loss"
"""The batch-wide loss of the step (the policy loss and any KL or entropy terms)."""


COMPLETIONS_ERRORED = "completions/errored"
"""Completions of the step's batch that ERRORED (a reward function or environment failed): advantage 0, left out of the group's statistics."""


POLICY_AGE_MAX = "policy_age/max"
"""The largest age (trainer version minus sampling version) of a token that reached the loss; tokens masked for their age are not counted."""


POLICY_AGE_MEAN = "policy_age/mean"
"""The mean age of the tokens that reached the loss, by the version that sampled each."""


POLICY_AGE_HISTOGRAM = "policy_age/histogram"
"""{age: number of trained tokens} of one step, ages as strings (JSON object keys)."""


POLICY_AGE_DEPENDENCY_MAX = "policy_age/dependency_max"
"""The largest age of a trained token by the oldest weights it depends on: those that sampled it
and those whose KV it attended to (`forge_rl.core.columns.exact_versions`); what
buffer.max_policy_age bounds. policy_age/max ages by the sampling version alone."""


POLICY_AGE_DEPENDENCY_MEAN = "policy_age/dependency_mean"
"""The mean of the same dependency ages over the trained tokens."""


POLICY_VERSION = "policy_version"
"""The trainer's version after the step (the versions it published; unchanged by a skipped step).
With several policies (`policies`), each one's as `policy_version/<policy>` ("main": the run's own),
and beside it `policy_age/max/<policy>`, `policy_age/dependency_max/<policy>` and
`reward/mean/<policy>` of its part of the batch, its ages against its own version."""


ZERO_ADVANTAGE_FRACTION = "groups/zero_advantage_fraction"
"""The step's groups whose advantages are all zero (every completion scored alike): no learning signal."""


POLICY_ENTROPY = "policy/entropy"
"""Mean entropy (nats) of the policy's next-token distribution over the trained tokens."""


MISMATCH_KL = "loss/mismatch_kl"
"""Trainer-vs-sampler KL (k3) over the trained tokens, at the trainer's weights: numerics on tokens of
the trainer's own version, plus the policy lag of older tokens (sampled by weights since updated)."""


MISMATCH_KL_BY_GENERATOR = "mismatch_kl/generator"
"""Prefix of the same KL per generator: `mismatch_kl/generator/<i>`. Tokens older than the trainer's
version add their policy lag (the last updates' size), so it moves with the updates."""


MISMATCH_KL_FRESH_BY_GENERATOR = "mismatch_kl_fresh/generator"
"""Prefix of the KL per generator over its exact tokens, those whose turn so far was sampled at the
trainer's version (absent for a generator with none that step; `forge_rl.core.columns.exact_versions`):
numerics alone while the generator serves the weights its versions name, whatever
the updates (`forge_rl.observability.health` watches it)."""


MISMATCH_ALARMS = "health/mismatch_alarms"
"""Generators whose mismatch KL jumped this step (`forge_rl.observability.health`); each also printed as a warning."""


TRUNCATED_KEPT_SETS = "completions/truncated_kept_sets"
"""Trained tokens whose top-k/top-p kept set may have been cut to generator.max_support_ids (CPU
engines): their importance ratios are biased above 1. 0 unless that limit is too low."""


TRAINED_TOKENS = "num_tokens"
"""Tokens the step trained (reported by the trainer)."""


SIMULATED = "simulated"
"""1 on the steps of a simulated trainer (trainer.engine sim): no loss, nothing learned."""


STEP_SKIPPED = "step_skipped"
"""1 when the step's loss or gradient norm was NaN or infinite: no optimizer step, the weights and the policy version stay as they were."""


DATA_SKIPPED_ROWS = "data/skipped_rows"
"""Rows of the data file passed over so far as too long for the context (data.too_long skip); each
counted once, however many epochs met it."""


DATA_EPOCH = "data/epoch"
"""The epoch of the data file the next new prompt comes from (0 during the first pass)."""


BRANCH_PIVOTS_TOTAL = "branch/pivots_total"
"""Branch rollouts (docs/branches.md): pivots branched from, since the start."""


BRANCH_COMPLETIONS_TOTAL = "branch/completions_total"
"""Branch completions sampled (pivots x branch.branches_per_pivot)."""


BRANCH_UNBRANCHED_TOTAL = "branch/unbranched_total"
"""Completions the pivot rule found no pivot in: they train as plain samples."""


BRANCH_PIVOT_ERRORS_TOTAL = "branch/pivot_errors_total"
"""Completions left unbranched because branch.function raised or named a position outside them."""


BRANCH_PREFIX_CACHE_HIT_FRACTION = "branch/prefix_cache_hit_fraction"
"""Of the prefix tokens of branch requests (prompt and head), the fraction read from the
generator's prefix cache: 0 where the weights changed between the pivot's sampling and its
branches (the prefix is encoded afresh), near 1 where they did not."""


BRANCH_TOKENS_TOTAL = "branch/tokens_total"
"""Tokens the branches sampled."""


GENERATED_TOKENS_TOTAL = "tokens/generated_total"
"""Tokens every generator sampled since the run started, trained or not."""


GENERATED_TOKENS_PER_S = "throughput/generated_tokens_per_s"
"""Tokens sampled per second since the previous step, over every generator."""


TRAINED_TOKENS_PER_S = "throughput/trained_tokens_per_s"
"""Tokens the step trained over the step's wall time."""


TRAINER_IDLE_FRACTION = "idle_fraction/trainer"
"""Since the loops started, 1 - the trainer's busy time over elapsed time (`timeline.idle_fraction`)."""


GENERATORS_IDLE_FRACTION = "idle_fraction/generators"
"""Since the loops started, generator-seconds idle over generator-seconds (`timeline.idle_fraction`)."""


DROPPED_COMPLETIONS = "buffer/dropped_completions"
"""Completions the buffer dropped for their age since the start (older than buffer.max_policy_age)."""


DROPPED_EPISODES = "buffer/dropped_episodes"
"""Episodes (groups) the buffer dropped for their age since the start."""


GENERATOR_POLICY_VERSIONS = "generator/policy_versions"
"""The version each generator serves at the step, a list by generator index (one scalar per index in TensorBoard and W&B: `generator/policy_versions/<i>`)."""


NUM_GENERATORS = "generator/count"
"""Generators in the pool at the step (the run's num_generators, then as `forge-rl scale` changes it)."""


WEIGHTS_FETCHED_BYTES_TOTAL = "weights/fetched_bytes_total"
"""Bytes every generator's weight updates moved between hosts since the run started: one copy per
version per remote host (store/host_copies.py), 0 when every generator shares the trainer's host."""


# The train loop's critical path, per step, from the previous step's return to this one's
# (`forge_rl.run.loop.critical_path_breakdown`): waiting for data, the trainer's compute (rank 0's
# forward, backward, optimizer), and everything else (batching, publishing the weights, messages,
# the loop's bookkeeping; sampling the buffer only when the batch could not be taken ahead).
TRAINER_DATA_WAIT_S = "trainer/data_wait_s"
"""Waiting for the admission gate to have a batch (generation is behind): not overhead."""


TRAINER_FORWARD_S = "trainer/forward_s"
"""The forward pass of the step on rank 0 (the policy, and the reference where one is trained against)."""


TRAINER_BACKWARD_S = "trainer/backward_s"
"""Backward, and the LoRA adapters' gradient reduction."""


TRAINER_OPTIMIZER_S = "trainer/optimizer_s"
"""Gradient clipping and the AdamW step."""


TRAINER_BATCHING_S = "trainer/batching_s"
"""Building the padded/packed batch from the episodes, in the trainer's process."""


TRAINER_PUBLISH_S = "trainer/publish_s"
"""Snapshotting the new weights and handing them to the store's writer (the write itself is
in the background)."""


TRAINER_OVERHEAD_S = "trainer/overhead_s"
"""The critical path minus data wait and compute: batching, publishing, sampling, messages and the
loop's bookkeeping. The bookkeeping after a step (logging, checkpoints) counts in the next step."""


# Environment episodes (`forge_rl.envs.rollout`), over those played since the previous step.
EPISODES_PLAYED = "episodes/played"
"""Environment episodes played since the previous step."""


TURNS_PER_EPISODE = "episodes/turns_mean"
"""Mean model turns per episode played since the previous step."""


TOKENS_PER_EPISODE = "episodes/tokens_mean"
"""Tokens of the trajectory's sequences, context included (what the context budget counts)."""


GENERATED_TOKENS_PER_EPISODE = "episodes/generated_tokens_mean"
"""Mean tokens the model sampled per episode (the trainable ones; environment text aside)."""


TOOL_ERROR_RATE = "episodes/tool_error_rate"
"""Malformed turns (a tool call that does not parse, an unknown tool) per model turn."""


SPANNED_WEIGHT_UPDATE_FRACTION = "episodes/spanned_weight_update_fraction"
"""Episodes whose generated tokens carry more than one policy version (a partial rollout)."""


ENV_STEP_LATENCY_P50_S = "env/step_latency_p50_s"
"""Median wall time of the environment resets and steps that answered since the previous step (timeouts are counted as statuses)."""


ENV_STEP_LATENCY_P99_S = "env/step_latency_p99_s"
"""The 99th percentile of the same wall times."""


FORKED_SAMPLES_DROPPED = "episodes/forked_samples_dropped"
"""Samples after a prefix break, not trained (`forge_rl.envs.rollout` says why)."""


EPISODE_STATUS_PREFIX = "episodes/status/"
"""`episodes/status/<status>`: agents' views that ended so (`forge_rl.envs.trajectory`,
TrajectoryStatus); one per episode of a single-agent environment."""


AGENTS_PER_EPISODE = "episodes/agents_mean"
"""Agents whose views an episode trains (`forge_rl.envs.graph`); 1 for a single-agent environment."""


REWARD_BY_SEAT = "reward/by_seat"
"""`reward/by_seat/<seat>`: the mean reward of a multi-agent episode's agents of that seat, over
the completions of the step (ERRORED ones aside)."""


GENERATORS_IDLE_ON_ENV_FRACTION = "idle_fraction/generators_waiting_on_env"
"""Since the loops started, generator-seconds with no turn in flight while episodes waited on
environment calls (`forge_rl.envs.rollout.EnvWaitClock`), over all generator-seconds."""


TRAINER_BREAKDOWN = (
    TRAINER_DATA_WAIT_S, TRAINER_FORWARD_S, TRAINER_BACKWARD_S, TRAINER_OPTIMIZER_S,
    TRAINER_BATCHING_S, TRAINER_PUBLISH_S, TRAINER_OVERHEAD_S,
)  # fmt: skip


TRAINER_STEP_CLOCK = frozenset({"step_time_s", TRAINER_FORWARD_S, TRAINER_BACKWARD_S, TRAINER_OPTIMIZER_S})
"""The wall-clock readings among a `PolicyTrainer.train_step`'s metrics: everything else it
returns is a pure function of the weights and the batch (what parity tests compare)."""
