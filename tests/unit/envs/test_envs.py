"""Environments, token-in/token-out trajectories and the episode runner (the sandbox: test_sandbox.py).

Turns come from `FakeGenerate` (tests/support/fakes.py), scripted in the tiny models' char tokenizer. Hangs
are made by construction (an environment awaiting an Event that is never set) under a small
timeout; nothing sleeps to race a process.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from forge_rl.envs.calculator import MALFORMED_CALL, MALFORMED_TURN, CalculatorEnv, calculate, make_calculator_env
from forge_rl.envs.environment import MalformedTurn, Message, StepResult
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.runner import ContextExhausted, EpisodeLimits, SampledTurn, run_episode
from forge_rl.envs.sandbox import SandboxConfig
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus
from forge_rl.errors import GeneratorLost, SandboxUnavailable
from forge_rl.tasks.synthetic import leading_number_reward, make_prompt
from forge_rl.tasks.tokenizer import PAD, PromptTokenizer, save_char_tokenizer
from tests.support.fakes import FakeGenerate
from tests.support.helpers import episode_limits

# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


@pytest.fixture(scope="module")
def renderer(tokenizer) -> PlainTextRenderer:
    return PlainTextRenderer(tokenizer)


def sampled(tokenizer, text: str, policy_version: int | list[int] = 0, stop: bool = True) -> SampledTurn:
    """A turn spelling `text` (then eos when `stop`), with logprobs unique to each token so a test
    can tell them apart."""
    token_ids = tokenizer.encode_text(text) + ([tokenizer.eos_id] if stop else [])
    versions = policy_version if isinstance(policy_version, list) else [policy_version] * len(token_ids)
    logprobs = [-(token_id + i / 100) for i, token_id in enumerate(token_ids)]
    return SampledTurn(token_ids, logprobs, versions, "stop" if stop else "length")


def play(env, turns, renderer, **limits):
    generate = FakeGenerate(turns)
    trajectory = asyncio.run(run_episode(env, generate, renderer, episode_limits(**limits)))
    return trajectory, generate


class ScriptedEnv:
    """Answers turns with the scripted observations in order; closes with reward 1.0 after them."""

    def __init__(self, prompt="Q=", observations=()):
        self.prompt, self.observations = prompt, list(observations)

    async def reset(self):
        return self.prompt

    async def step(self, turn_text):
        if not self.observations:
            return StepResult(done=True, final_reward=1.0)
        return StepResult(observation=self.observations.pop(0), turn_reward=0.5)


class FailingEnv(ScriptedEnv):
    """Raises, hangs (awaits an Event never set) or misbehaves in reset or step, as told."""

    def __init__(self, where: str, how: str):
        super().__init__(observations=["R1="] * 10)
        self.where, self.how = where, how

    async def reset(self):
        return await self._misbehave() if self.where == "reset" else await super().reset()

    async def step(self, turn_text):
        return await self._misbehave() if self.where == "step" else await super().step(turn_text)

    async def _misbehave(self):
        if self.how == "raise":
            raise KeyError("the tool's server is gone")
        if self.how == "hang":
            await asyncio.Event().wait()
        if self.how == "hang_ignoring_one_cancel":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # a badly written environment carries on waiting
                await asyncio.Event().wait()
        if self.how == "bad_result":
            return StepResult(done=True)  # no final_reward: StepResult raises
        if self.how == "not_a_result":
            return "R1="


# ---------------------------------------------------------------------------------------------------
# Token in, token out
# ---------------------------------------------------------------------------------------------------


def test_the_trainer_sees_exactly_the_sampled_ids_turn_after_turn(tokenizer, renderer):
    env = CalculatorEnv(37, 52)
    turns = [sampled(tokenizer, "C37*52", policy_version=3), sampled(tokenizer, "1924", policy_version=[3, 3, 4, 4, 4])]
    trajectory, generate = play(env, turns, renderer)

    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    [sample] = trajectory.samples
    generated = [span for span in sample.spans if isinstance(span, GeneratedSpan)]
    assert [(list(s.token_ids), list(s.logprobs), list(s.policy_versions)) for s in generated] == [
        (t.token_ids, t.logprobs, t.policy_versions) for t in turns
    ]
    # Each turn was sampled after exactly the tokens the trainer will see before it.
    prompt = tokenizer.encode_prompt("37*52=")
    result = tokenizer.encode_text("R1924=")
    assert [prefix for prefix, _ in generate.calls] == [prompt, prompt + turns[0].token_ids + result]
    assert sample.token_ids == prompt + turns[0].token_ids + result + turns[1].token_ids
    assert sample.loss_mask == [False] * len(prompt) + [True] * 7 + [False] * len(result) + [True] * 5
    assert trajectory.oldest_policy_version == 3
    assert [m.content for m in trajectory.conversation] == ["37*52=", "C37*52", "R1924=", "1924"]


def test_each_tokens_kept_set_travels_with_its_turn_and_must_match_its_length(tokenizer, renderer):
    """top-k/top-p kept sets (SampledTurn.sampling_support) land in the GeneratedSpan as sampled;
    a generate whose kept sets disagree with its tokens is a caller's bug and raises."""
    turn = sampled(tokenizer, "1924")
    kept = [[token_id, 3] for token_id in turn.token_ids]
    trajectory, _ = play(CalculatorEnv(37, 52), [replace(turn, sampling_support=kept)], renderer)
    [span] = trajectory.generated_spans
    assert span.sampling_support == tuple(tuple(k) for k in kept)

    with pytest.raises(ValueError, match="5 token ids, 5 logprobs, 5 policy versions and 4 kept sets"):
        play(CalculatorEnv(37, 52), [replace(turn, sampling_support=kept[:4])], renderer)


def test_a_single_turn_task_is_the_one_turn_trajectory(tokenizer, renderer):
    """Today's Completion, played as an environment: prompt context, one generated span, its reward."""
    prompt = make_prompt("max_of_two", seed=0, index=3)

    class SingleTurnTask:
        async def reset(self):
            return prompt.text

        async def step(self, turn_text):
            return StepResult(done=True, final_reward=leading_number_reward(turn_text, prompt.answer))

    turn = sampled(tokenizer, prompt.answer)
    trajectory, _ = play(SingleTurnTask(), [turn], renderer)
    [sample] = trajectory.samples
    assert sample.spans == [
        ContextSpan(tuple(tokenizer.encode_prompt(prompt.text))),
        GeneratedSpan(tuple(turn.token_ids), tuple(turn.logprobs), tuple(turn.policy_versions)),
    ]
    assert (trajectory.status, trajectory.final_reward, trajectory.num_turns) == (TrajectoryStatus.DONE, 1.0, 1)


def test_a_turn_that_does_not_render_back_to_its_ids_forks_the_trajectory(tokenizer, renderer):
    """The model sampled a pad inside its call: its text drops it, so rendering the conversation no
    longer starts with the sampled ids. Those stay one sample, as sampled; the next turn is sampled
    after the re-rendered conversation, all context."""
    pad = tokenizer._tokenizer.token_to_id(PAD)
    call = sampled(tokenizer, "C37*52")
    call_with_pad = SampledTurn(call.token_ids[:3] + [pad] + call.token_ids[3:], [-1.0] * 8, [0] * 8, "stop")
    answer = sampled(tokenizer, "1924")
    trajectory, generate = play(CalculatorEnv(37, 52), [call_with_pad, answer], renderer)

    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_forks == 1
    first, second = trajectory.samples
    assert first.token_ids == tokenizer.encode_prompt("37*52=") + call_with_pad.token_ids
    rerendered = tokenizer.encode_prompt("37*52=C37*52") + [tokenizer.eos_id] + tokenizer.encode_text("R1924=")
    assert second.spans == [
        ContextSpan(tuple(rerendered)),
        GeneratedSpan(tuple(answer.token_ids), tuple(answer.logprobs), tuple(answer.policy_versions)),
    ]
    assert generate.calls[1][0] == rerendered
    assert [list(s.token_ids) for s in trajectory.generated_spans] == [call_with_pad.token_ids, answer.token_ids]


class ReasoningDroppingRenderer(PlainTextRenderer):
    """A fake chat template that, like Qwen3's, drops the reasoning of earlier assistant turns
    (here: their text up to "/")."""

    def render(self, conversation):
        return super().render(
            [Message(m.role, m.content.split("/")[-1]) if m.role == "assistant" else m for m in conversation]
        )


def test_a_template_that_rewrites_history_forks_instead_of_training_on_tokens_never_sampled(tokenizer):
    renderer = ReasoningDroppingRenderer(tokenizer)
    env = ScriptedEnv(prompt="Q=", observations=["R1=", "R2="])
    turns = [sampled(tokenizer, "A"), sampled(tokenizer, "THINK/B"), sampled(tokenizer, "C")]
    trajectory, generate = play(env, turns, renderer)

    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_forks == 1
    first, second = trajectory.samples
    # The turn with reasoning is kept in full where it was sampled...
    assert (
        first.token_ids
        == renderer.render([Message("user", "Q="), Message("assistant", "A"), Message("user", "R1=")])
        + turns[1].token_ids
    )
    # ...and the next turn continues after the template's rendering, which no longer holds it.
    rerendered = (
        tokenizer.encode_prompt("Q=A")
        + [tokenizer.eos_id]
        + tokenizer.encode_text("R1=B")
        + [tokenizer.eos_id]
        + tokenizer.encode_text("R2=")
    )
    assert generate.calls[2][0] == list(second.spans[0].token_ids) == rerendered
    assert [list(s.token_ids) for s in trajectory.generated_spans] == [t.token_ids for t in turns]


# ---------------------------------------------------------------------------------------------------
# Limits and terminal statuses
# ---------------------------------------------------------------------------------------------------


def test_max_turns_truncates_an_episode_the_environment_does_not_close(tokenizer, renderer):
    env = ScriptedEnv(observations=["R1="] * 5)
    trajectory, generate = play(env, [sampled(tokenizer, "A")] * 2, renderer, max_turns=2)
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TURNS and trajectory.status.trainable
    assert trajectory.num_turns == 2 and trajectory.final_reward == 0.0 and trajectory.turn_rewards == [0.5, 0.5]


def test_a_turn_that_fills_the_context_truncates_without_reaching_the_environment(tokenizer, renderer):
    env = ScriptedEnv()  # would close with reward 1.0 at the first step it saw
    long_turn = sampled(tokenizer, "A" * 50)
    trajectory, generate = play(env, [long_turn], renderer, max_total_tokens=20)
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS and trajectory.final_reward == 0.0
    assert generate.calls[0][1] == 20 - 3  # <bos>Q= leaves 17
    assert trajectory.samples[0].num_tokens == 20 and trajectory.turn_rewards == []


def test_max_tokens_per_turn_cuts_a_turn_that_the_environment_then_answers(tokenizer, renderer):
    turns = [sampled(tokenizer, "C37*52" + "9" * 20), sampled(tokenizer, "1924")]
    trajectory, generate = play(CalculatorEnv(37, 52), turns, renderer, max_tokens_per_turn=8)
    assert [budget for _, budget in generate.calls] == [8, 8]
    assert trajectory.conversation[1:3] == [Message("assistant", "C37*5299"), Message("user", "R196063=")]
    # The eos the cut turn lacks is context the renderer adds, not a token the model is trained on.
    assert trajectory.samples[0].spans[2] == ContextSpan((tokenizer.eos_id, *tokenizer.encode_text("R196063=")))
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_forks == 0


def test_an_observation_that_overflows_the_context_truncates_and_is_not_added(tokenizer, renderer):
    env = ScriptedEnv(observations=["R" * 40])
    trajectory, _ = play(env, [sampled(tokenizer, "A")], renderer, max_total_tokens=30)
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS
    assert trajectory.samples[0].token_ids == tokenizer.encode_prompt("Q=A") + [tokenizer.eos_id]


def test_a_prompt_longer_than_the_context_truncates_before_any_turn(renderer):
    trajectory, generate = play(ScriptedEnv(prompt="Q" * 40), [], renderer, max_total_tokens=30)
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS and generate.calls == [] and trajectory.samples == []


def test_a_generator_whose_context_is_full_truncates_the_episode_with_its_reason(tokenizer, renderer):
    """max_total_tokens (the default 4096) beyond the generator's own context: generate raises
    ContextExhausted (VLLMEngine.generate_turn does, before sending anything) and the episode ends
    TRUNCATED_TOKENS, trainable, with the generator's reason."""
    first_turn = sampled(tokenizer, "C37*52")

    async def generate(prefix, max_new_tokens):
        if prefix == tokenizer.encode_prompt("37*52="):
            return first_turn
        raise ContextExhausted(f"the prefix has {len(prefix)} tokens and the generator's context is 16")

    trajectory = asyncio.run(run_episode(CalculatorEnv(37, 52), generate, renderer, episode_limits()))
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS and trajectory.status.trainable
    assert trajectory.error == "turn 2: the prefix has 20 tokens and the generator's context is 16"
    assert trajectory.num_turns == 1 and trajectory.final_reward == 0.0
    assert trajectory.samples[0].token_ids[-6:] == tokenizer.encode_text("R1924=")  # answered, then no room


def test_a_malformed_tool_call_gets_an_error_observation_and_the_episode_goes_on(tokenizer, renderer):
    turns = [sampled(tokenizer, "C37*"), sampled(tokenizer, "C37*52"), sampled(tokenizer, "1924")]
    trajectory, generate = play(CalculatorEnv(37, 52), turns, renderer)
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    assert trajectory.num_malformed_turns == 1
    assert generate.calls[1][0][-len(MALFORMED_CALL) :] == tokenizer.encode_text(MALFORMED_CALL)


def test_more_malformed_turns_than_allowed_end_the_episode_as_a_parse_error(tokenizer, renderer):
    turns = [sampled(tokenizer, "HELLO"), sampled(tokenizer, "C1*")]
    trajectory, _ = play(CalculatorEnv(37, 52), turns, renderer, max_malformed_turns=1)
    assert trajectory.status == TrajectoryStatus.PARSE_ERROR and trajectory.status.trainable
    assert trajectory.conversation[2] == Message("user", MALFORMED_TURN)
    assert trajectory.final_reward == 0.0 and "malformed" in trajectory.error


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_environment_that_raises_errors_its_episode_and_the_caller_goes_on(tokenizer, renderer, where):
    trajectory, _ = play(FailingEnv(where, "raise"), [sampled(tokenizer, "A")], renderer)
    assert trajectory.status == TrajectoryStatus.ENV_ERROR and not trajectory.status.trainable
    assert (
        trajectory.error.startswith(f"{where}")
        and "KeyError" in trajectory.error
        and "server is gone" in trajectory.error
    )


@pytest.mark.parametrize("where", ["reset", "step"])
@pytest.mark.parametrize("how", ["hang", "hang_ignoring_one_cancel"])
def test_an_environment_that_hangs_times_out_its_episode(tokenizer, renderer, where, how):
    trajectory, _ = play(FailingEnv(where, how), [sampled(tokenizer, "A")], renderer, env_step_timeout_s=0.05)
    assert trajectory.status == TrajectoryStatus.ENV_TIMEOUT and not trajectory.status.trainable
    assert "env_step_timeout_s (0.05 s)" in trajectory.error


@pytest.mark.parametrize(
    "how,message", [("bad_result", "needs final_reward|done=True"), ("not_a_result", "not a StepResult")]
)
def test_an_environment_returning_a_bad_result_errors_its_episode(tokenizer, renderer, how, message):
    trajectory, _ = play(FailingEnv("step", how), [sampled(tokenizer, "A")], renderer)
    assert trajectory.status == TrajectoryStatus.ENV_ERROR
    assert any(part in trajectory.error for part in message.split("|"))


def test_an_observation_the_tokenizer_cannot_spell_errors_the_episode_with_the_reason(tokenizer, renderer):
    trajectory, _ = play(ScriptedEnv(observations=["result: 7"]), [sampled(tokenizer, "A")], renderer)
    assert trajectory.status == TrajectoryStatus.ENV_ERROR and "cannot spell" in trajectory.error


def test_fatal_errors_and_generator_failures_reach_the_caller(tokenizer, renderer):
    class NoSandbox(ScriptedEnv):
        async def step(self, turn_text):
            raise SandboxUnavailable("Landlock is unavailable")

    with pytest.raises(SandboxUnavailable):
        play(NoSandbox(), [sampled(tokenizer, "A")], renderer)

    async def lost_generator(prefix, max_new_tokens):
        raise GeneratorLost(0, "process died")

    with pytest.raises(GeneratorLost):
        asyncio.run(run_episode(ScriptedEnv(), lost_generator, renderer, episode_limits()))


def test_step_result_refuses_an_end_without_a_reward_and_a_reward_without_an_end():
    with pytest.raises(ValueError, match="final_reward"):
        StepResult(done=True)
    with pytest.raises(ValueError, match="final_reward"):
        StepResult(observation="R1=", final_reward=1.0)
    with pytest.raises(ValueError, match="finite"):
        StepResult(done=True, final_reward=float("nan"))


def test_limits_that_would_stop_everything_or_nothing_are_refused_with_the_field():
    with pytest.raises(ValueError, match=r"environment.limits.max_turns \(0\) must be >= 1"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match=r"env_step_timeout_s \(inf\).*hung environment"):
        EpisodeLimits(env_step_timeout_s=float("inf"))
    with pytest.raises(ValueError, match=r"SandboxConfig.max_wall_time_s \(0\)"):
        SandboxConfig(max_wall_time_s=0)


# ---------------------------------------------------------------------------------------------------
# The calculator
# ---------------------------------------------------------------------------------------------------


def test_the_calculator_parses_calls_and_refuses_malformed_ones():
    assert [calculate(c) for c in ("C37*52", "C5+7", "C3-10")] == [1924, 12, -7]
    for call in ("C37*", "C*52", "C37x52", "C1234567*2", "C3*4*5"):
        with pytest.raises(MalformedTurn) as raised:
            calculate(call)
        assert raised.value.observation == MALFORMED_CALL


def test_calculator_problems_are_two_digit_and_depend_only_on_seed_and_index():
    env = make_calculator_env(seed=0, index=7)
    assert (env.left, env.right) == (make_calculator_env(0, 7).left, make_calculator_env(0, 7).right)
    assert all(
        10 <= n <= 99 for i in range(50) for n in (make_calculator_env(0, i).left, make_calculator_env(0, i).right)
    )


def test_a_wrong_answer_closes_the_calculator_episode_with_no_reward(tokenizer, renderer):
    trajectory, _ = play(CalculatorEnv(37, 52), [sampled(tokenizer, "1925")], renderer)
    assert (trajectory.status, trajectory.final_reward) == (TrajectoryStatus.DONE, 0.0)


# ---------------------------------------------------------------------------------------------------
# The docs
# ---------------------------------------------------------------------------------------------------


def test_the_custom_environment_of_the_docs_runs(capsys):
    page = (Path(__file__).resolve().parents[3] / "docs" / "environments.md").read_text()
    code = page.split("```python\n")[1].split("```")[0]
    exec(compile(code, "docs/environments.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out == "done 3 1.0\n"
