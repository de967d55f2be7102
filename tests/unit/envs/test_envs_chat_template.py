"""ChatTemplateRenderer on a real chat template (rendered by transformers, as for real models): the
prefix holds turn after turn, and a template that rewrites history forks the trajectory.

Apart from tests/unit/envs/test_envs.py because importing transformers takes seconds."""

from __future__ import annotations

import asyncio
import json

import pytest

from forge_rl.envs.environment import Message, StepResult
from forge_rl.envs.renderers import ChatTemplateRenderer
from forge_rl.envs.runner import SampledTurn, run_episode
from forge_rl.envs.trajectory import ContextSpan, TrajectoryStatus
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from tests.support.fakes import FakeGenerate
from tests.support.helpers import episode_limits

# A miniature of Qwen3's template: role header, content, end of turn; earlier assistant turns lose
# their reasoning (here: the text up to "/", as Qwen3 drops <think>...</think>).
REASONING_DROPPING_TEMPLATE = (
    "{% for m in messages %}"
    "{% set content = m['content'].split('/')[-1] if m['role'] == 'assistant' else m['content'] %}"
    "{{ '<bos>' + m['role'][0] | upper + '=' + content + '<eos>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<bos>A=' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("chat_model")
    save_char_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(config | {"chat_template": REASONING_DROPPING_TEMPLATE})
    )
    return PromptTokenizer(model_dir)


class TwoObservations:
    def __init__(self):
        self.observations = [[Message("user", "R1=")], [Message("user", "R2=")]]

    async def reset(self):
        return [Message("system", "S"), Message("user", "Q")]

    async def step(self, turn_text):
        if self.observations:
            return StepResult(observation=self.observations.pop(0))
        return StepResult(done=True, final_reward=1.0)


def turn(tokenizer, text: str) -> SampledTurn:
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [-0.5] * len(token_ids), [0] * len(token_ids), "stop")


def test_the_chat_template_prefix_holds_until_it_rewrites_history_and_then_the_trajectory_forks(tokenizer):
    renderer = ChatTemplateRenderer(tokenizer)
    turns = [turn(tokenizer, "A"), turn(tokenizer, "THINK/B"), turn(tokenizer, "C")]
    generate = FakeGenerate(turns)
    trajectory = asyncio.run(run_episode(TwoObservations(), generate, renderer, episode_limits()))

    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_forks == 1
    first, second = trajectory.samples
    encode = tokenizer.encode_chat
    # Turn 1 left the template's rendering intact: its observation was appended after it as context.
    assert (
        first.token_ids
        == encode(
            [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": "R1="},
            ]
        )
        + turns[1].token_ids
    )
    # Turn 2's reasoning is dropped by the template: the next turn is sampled after that rendering.
    history = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "R1="},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "R2="},
    ]
    assert second.spans[0] == ContextSpan(tuple(encode(history)))
    assert generate.calls[2][0] == encode(history)
    assert [list(span.token_ids) for span in trajectory.generated_spans] == [t.token_ids for t in turns]


def test_an_openai_client_agent_on_the_chat_template_forks_where_the_builder_does(tokenizer):
    """The same conversation driven by agent code through forge_rl/envs/chat_client.py: the calls
    group into the same samples as run_episode's builder makes, with the same ids."""
    pytest.importorskip("openai", reason="the chat client needs the openai package (vLLM installs it)")
    from forge_rl.envs.chat_client import ChatAgentEnvironment

    renderer = ChatTemplateRenderer(tokenizer)
    turns = [turn(tokenizer, "A"), turn(tokenizer, "THINK/B"), turn(tokenizer, "C")]
    generate = FakeGenerate(turns)

    async def agent(client):
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
        for observation in ("R1=", "R2=", None):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            messages += [{"role": "user", "content": observation}] if observation else []
        return 1.0

    via_client = asyncio.run(ChatAgentEnvironment(agent).play(generate, renderer, episode_limits()))
    via_runner = asyncio.run(run_episode(TwoObservations(), FakeGenerate(turns), renderer, episode_limits()))
    assert via_client.status == TrajectoryStatus.DONE and via_client.num_forks == 1
    assert [s.spans for s in via_client.samples] == [s.spans for s in via_runner.samples]


def test_a_model_without_a_chat_template_is_refused_with_the_fix(tmp_path):
    save_char_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="PlainTextRenderer"):
        ChatTemplateRenderer(PromptTokenizer(tmp_path))


def test_a_chat_task_prompt_is_one_user_message_ending_with_the_assistant_header(tokenizer):
    from forge_rl.tasks import TaskConfig, encode_task_prompt

    chat = encode_task_prompt(TaskConfig(prompt_format="chat"), tokenizer, "M37=")
    assert chat == tokenizer.encode_text("<bos>U=M37=<eos><bos>A=")
    assert encode_task_prompt(TaskConfig(), tokenizer, "M37=") == tokenizer.encode_prompt("M37=")
