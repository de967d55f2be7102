"""forge_rl/envs/verifiers_adapter.py: a verifiers environment (the sums taskset, built with
verifiers' own classes) played by verifiers' own chat program against forge_rl's in-process chat
client, scored by the task's own reward. A fake generator stands in for the engine
(tests/integration/test_envs_engine.py plays it on vLLM)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4 (Python >= 3.11; make env-adapters)")

import verifiers.v1 as vf  # noqa: E402

from forge_rl.envs.renderers import PlainTextRenderer  # noqa: E402
from forge_rl.envs.rollout import play_episode, trajectory_completion  # noqa: E402
from forge_rl.envs.runner import SampledTurn  # noqa: E402
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus  # noqa: E402
from forge_rl.envs.verifiers_adapter import verifiers_environment  # noqa: E402
from forge_rl.envs.verifiers_sums import sums_environment  # noqa: E402
from forge_rl.errors import ConfigError  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer  # noqa: E402
from tests.support.fakes import FakeGenerate  # noqa: E402
from tests.support.helpers import episode_limits


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


def sampled(tokenizer, text: str, version: int) -> SampledTurn:
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [-0.3] * len(token_ids), [version] * len(token_ids), "stop")


def test_a_verifiers_task_is_played_by_its_chat_program_on_the_generator_and_scored_by_its_reward(tokenizer):
    renderer = PlainTextRenderer(tokenizer)
    env = sums_environment(seed=0, index=3)
    prompt, answer = env.task.data.prompt, env.task.data.answer
    right, wrong = sampled(tokenizer, answer, version=5), sampled(tokenizer, "99", version=5)
    generate = FakeGenerate([right])
    trajectory = asyncio.run(play_episode(env, generate, renderer, episode_limits()))
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    [sample] = trajectory.samples
    prompt_ids = renderer.render([]) + tokenizer.encode_text(prompt)
    assert sample.spans == [
        ContextSpan(tuple(prompt_ids)),
        GeneratedSpan(tuple(right.token_ids), tuple(right.logprobs), (5,) * len(right.token_ids)),
    ]
    assert generate.calls[0][0] == prompt_ids
    completion = trajectory_completion(trajectory)
    assert completion.reward == 1.0 and sum(completion.generated) == len(right.token_ids)
    again = asyncio.run(
        play_episode(sums_environment(seed=0, index=3), FakeGenerate([wrong]), renderer, episode_limits())
    )
    assert again.status == TrajectoryStatus.DONE and again.final_reward == 0.0


def test_the_chat_programs_context_overflow_ends_the_episode_truncated(tokenizer):
    # verifiers' loop ends its run on a context overflow (a 400 context_length_exceeded) and scores it;
    # forge_rl keeps the truncation and does not train on that score.
    trajectory = asyncio.run(
        play_episode(
            sums_environment(0, 0), FakeGenerate([]), PlainTextRenderer(tokenizer), episode_limits(max_total_tokens=3)
        )
    )
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS and trajectory.final_reward == 0.0


class ConversationTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    """Scores the trace's conversation, as rewards that read more than the last reply do."""

    @vf.reward
    async def conversation(self, trace) -> float:
        roles = [message.role for message in trace.messages]
        return float(roles == ["system", "user", "assistant"] and trace.num_turns == 1 and trace.last_reply == "7")


class ConversationTaskset(vf.Taskset[ConversationTask, vf.TasksetConfig]):
    def load(self):
        yield ConversationTask(vf.TaskData(prompt="3+4=", system_prompt="SUM"))


def test_the_task_scores_a_trace_holding_the_whole_conversation(tokenizer):
    make_env = verifiers_environment(ConversationTaskset(vf.TasksetConfig()))
    generate = FakeGenerate([sampled(tokenizer, "7", version=0)])
    trajectory = asyncio.run(play_episode(make_env(0, 0), generate, PlainTextRenderer(tokenizer), episode_limits()))
    assert trajectory.final_reward == 1.0
    assert generate.calls[0][0] == PlainTextRenderer(tokenizer).render([]) + tokenizer.encode_text("SUM3+4=")


class SandboxData(vf.TaskData):
    pass


class SandboxTask(vf.Task[SandboxData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def tests_pass(self, task, trace, runtime) -> float:
        return 1.0


class SandboxTaskset(vf.Taskset[SandboxTask, vf.TasksetConfig]):
    def load(self):
        yield SandboxTask(SandboxData(prompt="1+1="))


def test_a_task_whose_reward_needs_a_sandbox_is_refused_rather_than_scored_partially():
    with pytest.raises(ConfigError, match="tests_pass need a runtime"):
        verifiers_environment(SandboxTaskset(vf.TasksetConfig()))
