"""Environment episodes as training data (forge_rl/envs/rollout.py): trajectory -> completion,
the batch the trainer builds from it, the age bound on it, group play, the episode metrics."""

from __future__ import annotations

import asyncio

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.core.batching import make_train_batch
from forge_rl.core.buffer import BufferConfig, ReplayBuffer
from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.environment import StepResult
from forge_rl.envs.graph import EpisodeGraph
from forge_rl.envs.python_tool import PythonToolEnv
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import (
    EnvironmentConfig,
    EnvWaitClock,
    TimedEnvironment,
    group_completions,
    play_group,
    trajectory_completion,
)
from forge_rl.envs.runner import EpisodeLimits, SampledTurn, turn_span
from forge_rl.envs.sandbox import SandboxConfig
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, Trajectory, TrajectorySample, TrajectoryStatus
from forge_rl.errors import ConfigError, GeneratorLost
from forge_rl.observability import metric_names as m
from forge_rl.observability.metrics import EpisodeStats, batch_metrics
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.training.losses.config import LossConfig
from forge_rl.training.trainer_config import TrainerConfig
from forge_rl.types import CompletionStatus, Episode
from tests.support.helpers import episode_limits


def trajectory(*spans, status=TrajectoryStatus.DONE, final_reward=1.0, samples=None, **fields) -> Trajectory:
    defaults = dict(
        turn_rewards=[None, 0.5], conversation=[], num_turns=2, num_malformed_turns=0, env_latencies_s=[0.1, 0.2]
    )
    return Trajectory(
        samples=samples if samples is not None else [TrajectorySample(list(spans))],
        status=status,
        final_reward=final_reward,
        **(defaults | fields),
    )


PROMPT = ContextSpan((1, 7, 11, 40))
CALL = GeneratedSpan((16, 7, 2), (-0.9, -0.1, -0.05), (3, 3, 3))
RESULT = ContextSpan((31, 5, 40))
ANSWER = GeneratedSpan((5, 2), (-0.4, -0.02), (3, 4))


def test_a_trajectory_is_one_completion_with_its_context_masked_and_its_ids_as_sampled():
    completion = trajectory_completion(trajectory(PROMPT, CALL, RESULT, ANSWER))

    assert completion.token_ids == [1, 7, 11, 40, 16, 7, 2, 31, 5, 40, 5, 2]
    assert completion.generated == [False] * 4 + [True] * 3 + [False] * 3 + [True] * 2
    assert completion.loss_mask == completion.generated
    assert completion.logprobs == [0.0] * 4 + [-0.9, -0.1, -0.05] + [0.0] * 3 + [-0.4, -0.02]
    # Context carries the version of the generated token before it (the first one's, before any),
    # so the oldest generated token alone bounds staleness.
    assert completion.policy_versions == [3] * 4 + [3] * 3 + [3] * 3 + [3, 4]
    assert completion.oldest_policy_version == 3 and completion.num_generated_tokens == 5
    assert (completion.reward, completion.status, completion.end_reason) == (1.0, CompletionStatus.OK, "done")
    assert (completion.num_turns, completion.turn_rewards) == (2, [None, 0.5])
    # The turns' rewards are process rewards: step 0 = prompt, call, tool result; step 1 = the answer.
    assert (completion.step_ends, completion.step_rewards) == ([10, 12], [0.0, 0.5])


def test_the_trainer_trains_only_generated_tokens_of_a_trajectory_with_their_behaviour_logprobs():
    completions = [
        trajectory_completion(trajectory(PROMPT, CALL, RESULT, ANSWER, final_reward=r, turn_rewards=[None, None]))
        for r in (1.0, 0.0)
    ]
    batch = make_train_batch([Episode(0, "", "", [], completions)], pad_id=0)

    assert batch.input_ids_NL[0].tolist() == completions[0].token_ids
    assert batch.loss_mask_NL[0].tolist() == completions[0].generated
    assert batch.behaviour_logprobs_NL[0].tolist() == pytest.approx(completions[0].logprobs)
    assert batch.num_generated_tokens == 10  # 5 per trajectory: no prompt, no tool output
    # No turn rewards: every token's advantage is the group's, from the final reward.
    assert batch.advantages_NL[:, 0].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert (batch.advantages_NL[0] == batch.advantages_NL[0, 0]).all()


def test_each_turns_reward_reaches_exactly_that_turns_tokens():
    """Two trajectories with the same final reward, the second one's answer turn rewarded. With
    step_discount 0 a turn's reward is credited to its own tokens only: the answer's (step 1,
    positions 10 and 11) are above the first trajectory's, and nothing else differs.
    With the default discount 1 the call's tokens (step 0) share the answer's credit."""
    completions = [
        trajectory_completion(trajectory(PROMPT, CALL, RESULT, ANSWER, final_reward=1.0, turn_rewards=rewards))
        for rewards in ([0.0, 0.0], [0.0, 1.0])
    ]
    episode = Episode(0, "", "", [], completions)

    plain, rewarded = make_train_batch([episode], pad_id=0, step_discount=0.0).advantages_NL.tolist()
    assert plain[:10] == pytest.approx(rewarded[:10])  # step 0: the same reward (0) in both
    assert rewarded[10] == rewarded[11] > plain[10] == plain[11]

    plain, rewarded = make_train_batch([episode], pad_id=0).advantages_NL.tolist()
    assert rewarded[4] > plain[4]  # step_discount 1: the answer's reward reaches back to the call


def test_a_trajectory_whose_turns_all_lack_a_reward_gets_all_zero_steps_when_its_group_has_turn_rewards():
    """Whether turns are steps is decided for the group: the unrewarded trajectory's turns count 0
    in the group's step statistics, so its call (reward 0, like the other's call) is judged the same
    as the rewarded trajectory's call, and its answer below the rewarded answer."""
    rewarded = trajectory(PROMPT, CALL, RESULT, ANSWER, turn_rewards=[None, 1.0])
    unrewarded = trajectory(PROMPT, CALL, RESULT, ANSWER, turn_rewards=[None, None])
    completions = group_completions([EpisodeGraph.of(rewarded), EpisodeGraph.of(unrewarded)])

    assert [(c.step_ends, c.step_rewards) for c in completions] == [([10, 12], [0.0, 1.0]), ([10, 12], [0.0, 0.0])]
    episode = Episode(0, "", "", [], completions)
    with_answer, without = make_train_batch([episode], pad_id=0, step_discount=0.0).advantages_NL.tolist()
    assert with_answer[4] == pytest.approx(without[4])  # the calls: both unrewarded turns
    assert with_answer[10] > without[10]  # the answers: rewarded against unrewarded


def test_a_group_without_any_turn_reward_trains_on_its_final_rewards_alone():
    completions = group_completions(
        [EpisodeGraph.of(trajectory(PROMPT, CALL, RESULT, ANSWER, turn_rewards=[None, None]))] * 2
    )
    assert [(c.step_ends, c.step_rewards) for c in completions] == [(None, None)] * 2


def test_the_age_bound_masks_a_trajectorys_turns_older_than_it_and_keeps_the_rest():
    fresh_answer = GeneratedSpan((5, 2), (-0.4, -0.02), (4, 4))  # a turn submitted under version 4
    completions = [trajectory_completion(trajectory(PROMPT, CALL, RESULT, answer)) for answer in (fresh_answer, ANSWER)]
    buffer = ReplayBuffer(BufferConfig(max_policy_age=0, drop_policy="mask_tokens", capacity_episodes=4))
    buffer.put(Episode(0, "", "", [], completions), trainer_version=0)

    [aged] = buffer.sample(1, trainer_version=4)
    kept = [[t for t, trains in zip(c.token_ids, c.loss_mask) if trains] for c in aged.completions]
    # Every version-3 token is out, and so is ANSWER's last one: decoded by version 4, it attends
    # to the KV that version 3 encoded its turn's first token with.
    assert kept == [[5, 2], []]


def test_an_environment_failure_is_an_errored_completion_never_trained_and_a_failed_reset_an_empty_one():
    errored = trajectory_completion(
        trajectory(PROMPT, CALL, status=TrajectoryStatus.ENV_TIMEOUT, final_reward=0.0, error="step 1: no answer")
    )
    no_reset = trajectory_completion(
        trajectory(samples=[], status=TrajectoryStatus.ENV_ERROR, final_reward=0.0, num_turns=0)
    )
    truncated = trajectory_completion(
        trajectory(PROMPT, CALL, status=TrajectoryStatus.TRUNCATED_TURNS, final_reward=0.0)
    )

    assert (
        errored.status == CompletionStatus.ERRORED
        and not any(errored.loss_mask)
        and errored.error == "step 1: no answer"
    )
    assert no_reset.status == CompletionStatus.ERRORED and no_reset.token_ids == []
    assert truncated.status == CompletionStatus.TRUNCATED and truncated.end_reason == "truncated_turns"
    batch = make_train_batch([Episode(0, "", "", [], [errored, no_reset, truncated])], pad_id=0)
    assert batch.num_generated_tokens == len(CALL.token_ids)  # the truncated one's turn only


def test_a_trajectory_counts_the_possibly_truncated_kept_sets_of_every_turn():
    """A turn's kept sets that filled generator.max_support_ids are counted as the generator
    returned them, and the trajectory's completion sums its turns', so the step's metric sees them."""
    call = turn_span(
        SampledTurn([16, 7, 2], [-0.9, -0.1, -0.05], [3, 3, 3], "stop", [[16, 5], [7], [2]], num_truncated_support=1)
    )
    answer = turn_span(SampledTurn([5, 2], [-0.4, -0.02], [3, 4], "stop", [[5, 6], [2, 3]], num_truncated_support=2))
    completion = trajectory_completion(trajectory(PROMPT, call, RESULT, answer))

    assert (call.num_truncated_support, answer.num_truncated_support) == (1, 2)
    assert completion.num_truncated_support == 3
    assert batch_metrics([Episode(0, "", "", [], [completion])], train_version=4)[m.TRUNCATED_KEPT_SETS] == 3


def test_a_forked_trajectory_trains_its_first_sample_and_counts_the_rest():
    forked = trajectory(samples=[TrajectorySample([PROMPT, CALL]), TrajectorySample([ContextSpan((1, 7, 31)), ANSWER])])
    assert trajectory_completion(forked).token_ids == list(PROMPT.token_ids + CALL.token_ids)
    stats = EpisodeStats()
    stats.observe(EpisodeGraph.of(forked))
    assert stats.figures()[m.FORKED_SAMPLES_DROPPED] == 1


def test_episode_figures_count_turns_tokens_tool_errors_latencies_updates_and_statuses():
    stats = EpisodeStats()
    stats.observe(
        EpisodeGraph.of(trajectory(PROMPT, CALL, RESULT, ANSWER, num_malformed_turns=1, env_latencies_s=[0.1, 0.3]))
    )
    stats.observe(
        EpisodeGraph.of(
            trajectory(
                PROMPT,
                CALL,
                status=TrajectoryStatus.TRUNCATED_TURNS,
                final_reward=0.0,
                num_turns=1,
                env_latencies_s=[0.2],
            )
        )
    )
    figures = stats.figures()

    assert figures[m.EPISODES_PLAYED] == 2
    assert figures[m.TURNS_PER_EPISODE] == 1.5
    assert figures[m.TOOL_ERROR_RATE] == pytest.approx(1 / 3)
    assert figures[m.TOKENS_PER_EPISODE] == (12 + 7) / 2
    assert figures[m.GENERATED_TOKENS_PER_EPISODE] == (5 + 3) / 2
    assert figures[m.SPANNED_WEIGHT_UPDATE_FRACTION] == 0.5  # the first one's answer: versions 3 and 4
    assert (figures[m.ENV_STEP_LATENCY_P50_S], figures[m.ENV_STEP_LATENCY_P99_S]) == (0.2, 0.3)
    assert figures[f"{m.EPISODE_STATUS_PREFIX}done"] == figures[f"{m.EPISODE_STATUS_PREFIX}truncated_turns"] == 1


def test_generator_idle_on_environments_counts_only_time_with_no_turn_in_flight_and_a_call_waiting():
    now = [0.0]
    clock = EnvWaitClock(num_generators=2, clock=lambda: now[0])
    with clock.env_call(0):  # 0-2: waiting on the environment, no turn: idle
        now[0] = 2.0
        with clock.turn(0):  # 2-5: a turn decodes meanwhile: busy
            now[0] = 5.0
        now[0] = 6.0  # 5-6: idle again
    now[0] = 10.0  # 6-10: nothing at all: not an environment's doing
    assert clock.idle_waiting_s(0) == 3.0 and clock.idle_waiting_s(1) == 0.0


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> PlainTextRenderer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PlainTextRenderer(PromptTokenizer(model_dir))


def test_a_lost_generator_cancels_the_whole_group_and_reaches_the_rollout(renderer):
    """The group is handed out again whole; its other episodes must not run on unseen."""
    cancelled = []

    class WaitsForever:
        async def reset(self):
            return "1*2="

        async def step(self, turn_text):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(turn_text)
                raise
            return StepResult(done=True, final_reward=0.0)

    turns = {"n": 0}

    async def generate(prefix, max_new_tokens):
        turns["n"] += 1
        if turns["n"] == 2:
            raise GeneratorLost(0, "its process died")
        return SampledTurn([5, 2], [-0.1, -0.1], [0, 0], "stop")

    with pytest.raises(GeneratorLost):
        asyncio.run(
            play_group([WaitsForever(), WaitsForever()], generate, renderer, episode_limits(max_total_tokens=64))
        )
    assert len(cancelled) == 1


def test_an_environment_must_fit_the_models_context_and_be_one_that_exists():
    with pytest.raises(
        ConfigError,
        match=r"max_total_tokens \(4096\) exceeds the model's context .*128.*--environment.limits.max-total-tokens",
    ):
        GRPOConfig(environment=EnvironmentConfig(name="calculator", limits=EpisodeLimits(max_total_tokens=4096)))
    with pytest.raises(ConfigError, match=r"environment.name \('chess'\) is not a registered environment.*calculator"):
        EnvironmentConfig(name="chess")
    with pytest.raises(
        ConfigError, match=r"environment.name \('no_such_pkg:make'\): module 'no_such_pkg' cannot be imported"
    ):
        EnvironmentConfig(name="no_such_pkg:make")
    config = GRPOConfig(environment=EnvironmentConfig(name="calculator", limits=EpisodeLimits(max_total_tokens=128)))
    assert config.max_episode_tokens == config.group_size * 128


def test_unset_token_limits_follow_the_models_context_and_max_new_tokens():
    config = GRPOConfig(environment=EnvironmentConfig(name="calculator"), generator=GeneratorConfig(max_new_tokens=2))
    limits = config.environment.limits
    assert (limits.max_total_tokens, limits.max_tokens_per_turn) == (config.max_model_len, 2) == (128, 2)
    assert config.max_tokens_per_request == 2 and config.max_episode_tokens == config.group_size * 128
    # A limit the user set stays as set; the other still follows.
    config = GRPOConfig(environment=EnvironmentConfig(name="calculator", limits=EpisodeLimits(max_tokens_per_turn=16)))
    assert (config.environment.limits.max_total_tokens, config.environment.limits.max_tokens_per_turn) == (128, 16)
    # Unresolved limits are refused by the runner, naming how to resolve them.
    with pytest.raises(ValueError, match=r"limits.resolved\(max_model_len, max_new_tokens\)"):
        EpisodeLimits().max_generated_tokens


def test_dr_grpo_with_an_environment_divides_by_the_most_tokens_a_trajectory_can_generate():
    """Dr. GRPO's constant is the longest possible completion: with an environment, a trajectory's
    turns (max_turns x max_tokens_per_turn) within its token budget, not generator.max_new_tokens."""
    env = EnvironmentConfig(
        name="calculator", limits=EpisodeLimits(max_turns=3, max_tokens_per_turn=24, max_total_tokens=128)
    )

    def dr_grpo(length_normalizer: int) -> GRPOConfig:
        return GRPOConfig(
            environment=env, trainer=TrainerConfig(loss=LossConfig(name="dr_grpo", length_normalizer=length_normalizer))
        )

    assert dr_grpo(72).max_completion_tokens == 72
    with pytest.raises(
        ConfigError, match=r"length_normalizer \(4\) must equal 72 .*--trainer.loss.length-normalizer 72"
    ):
        dr_grpo(GeneratorConfig().max_new_tokens)
    budget = EnvironmentConfig(
        name="calculator", limits=EpisodeLimits(max_turns=8, max_tokens_per_turn=32, max_total_tokens=128)
    )
    assert GRPOConfig(environment=budget).max_completion_tokens == 128  # the token budget binds before the turns


def test_a_step_timeout_shorter_than_a_sandboxs_start_up_and_run_is_refused_before_any_episode(renderer):
    """A known failure elsewhere: sandboxes killed mid-rollout. The python tool's step runs one
    sandbox, so env_step_timeout_s must cover its start-up and whole run (SandboxConfig.max_run_s)."""
    env = PythonToolEnv("1+1?", "2", SandboxConfig(max_wall_time_s=10))

    async def generate(prefix, max_new_tokens):
        raise AssertionError("no turn may be sampled")

    with pytest.raises(
        ConfigError, match=r"env_step_timeout_s \(30\) is below what one step of PythonToolEnv may take \(45 s"
    ):
        asyncio.run(play_group([env], generate, renderer, episode_limits(env_step_timeout_s=30)))
    timed = TimedEnvironment(env, EnvWaitClock(1), 0)
    with pytest.raises(ConfigError, match="--environment.limits.env-step-timeout-s to at least 45"):
        asyncio.run(play_group([timed], generate, renderer, episode_limits(env_step_timeout_s=44)))
