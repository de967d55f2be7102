"""Tool calls through forge_rl's in-process chat endpoint (forge_rl/envs/chat_client.py): an unmodified
`openai.AsyncOpenAI` agent passes `tools`, gets `message.tool_calls` read by vLLM's own hermes parser
(forge_rl/envs/tool_calls.py), sends the result back as a `tool` message, and the trajectory holds
exactly the sampled ids, tool results as context. The generator is a fake (tests/support/fakes.py
`FakeGenerate`) scripted with hermes-style turns; the chat template is a tiny Qwen2.5-style one
(tests/support/tool_chat.py). Bad input: malformed calls come back as content, tools a renderer cannot
write and tool_choice values that would need constrained decoding are 400s naming the field.

Apart from tests/unit/envs/test_chat_client.py because vLLM's parsers import vLLM (seconds)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the chat client needs the openai package (vLLM installs it)")
pytest.importorskip("vllm", reason="tool calls are read by vLLM's tool parsers")

from forge_rl.envs.chat_client import ChatAgentEnvironment  # noqa: E402
from forge_rl.envs.renderers import ChatTemplateRenderer, PlainTextRenderer  # noqa: E402
from forge_rl.envs.rollout import EnvironmentConfig, trajectory_completion  # noqa: E402
from forge_rl.envs.runner import EpisodeLimits, SampledTurn  # noqa: E402
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus  # noqa: E402
from forge_rl.errors import ConfigError  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer  # noqa: E402
from tests.support.fakes import FakeGenerate  # noqa: E402
from tests.support.tool_chat import save_tool_chat_tokenizer  # noqa: E402

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "The product of two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 37, "b": 52}}\n</tool_call>'
"""A call as the model writes it when it writes it as its template does."""
QUESTION = {"role": "user", "content": "What is 37*52?"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer(save_tool_chat_tokenizer(tmp_path_factory.mktemp("tool_chat")))


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatTemplateRenderer:
    return ChatTemplateRenderer(tokenizer, tool_call_parser="hermes")


def sampled(tokenizer, text: str, version: int = 0) -> SampledTurn:
    """A turn as a generator returns it: the text's ids then eos, distinct logprobs."""
    token_ids = tokenizer.encode_text(text) + [tokenizer.eos_id]
    return SampledTurn(token_ids, [-0.01 * (i + 1) for i in range(len(token_ids))], [version] * len(token_ids), "stop")


def play(agent, generate, renderer, limits=EpisodeLimits(max_total_tokens=4096, max_tokens_per_turn=256)):
    return asyncio.run(ChatAgentEnvironment(agent).play(generate, renderer, limits))


def multiply_agent(results: list):
    """An agent as OpenAI's function-calling guide writes it: call, run each requested tool, send
    the results back, until the model answers in text."""

    async def agent(client):
        messages = [QUESTION]
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[MULTIPLY])
            results.append(reply)
            message = reply.choices[0].message
            if not message.tool_calls:
                return float(message.content == "1924")
            messages.append(message)  # the reply itself, as the guide does
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] * arguments["b"])}
                )

    return agent


def test_an_openai_agent_runs_a_tool_loop_and_the_trajectory_holds_exactly_the_sampled_ids(tokenizer, renderer):
    turns = [sampled(tokenizer, CALL, version=3), sampled(tokenizer, "1924", version=4)]
    generate, replies = FakeGenerate(turns), []
    trajectory = play(multiply_agent(replies), generate, renderer)

    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    first = replies[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    assert call.type == "function" and call.function.name == "multiply" and call.id
    assert json.loads(call.function.arguments) == {"a": 37, "b": 52}
    assert first.model_extra["token_ids"] == turns[0].token_ids
    assert replies[1].choices[0].finish_reason == "stop" and replies[1].choices[0].message.tool_calls is None

    # The template re-renders the call exactly as sampled: one sample, the tool result its context.
    [sample] = trajectory.samples
    first_prompt = tokenizer.encode_chat([QUESTION], tools=[MULTIPLY])
    history = [
        QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 52}}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "1924"},
    ]
    second_prompt = tokenizer.encode_chat(history, tools=[MULTIPLY])
    assert sample.spans == [
        ContextSpan(tuple(first_prompt)),
        GeneratedSpan(tuple(turns[0].token_ids), tuple(turns[0].logprobs), tuple(turns[0].policy_versions)),
        ContextSpan(tuple(second_prompt[len(first_prompt) + len(turns[0].token_ids) :])),
        GeneratedSpan(tuple(turns[1].token_ids), tuple(turns[1].logprobs), tuple(turns[1].policy_versions)),
    ]
    assert [prefix for prefix, _ in generate.calls] == [first_prompt, second_prompt]
    tool_result = tokenizer.decode(list(sample.spans[2].token_ids), skip_special_tokens=False)
    assert "<tool_response>\n1924\n</tool_response>" in tool_result
    # Trained: the two sampled turns only; the tools, the question and the tool's answer are context.
    completion = trajectory_completion(trajectory)
    assert completion.token_ids == sample.token_ids and completion.generated == sample.loss_mask
    assert [t for t, g in zip(completion.token_ids, completion.generated) if g] == turns[0].token_ids + turns[
        1
    ].token_ids
    assert (
        trajectory.conversation[1].tool_calls[0].name == "multiply"
        and trajectory.conversation[2].tool_call_id == call.id
    )


def test_a_streamed_tool_call_reply_is_the_same_parse_cut_into_chunks(tokenizer, renderer):
    async def agent(client):
        stream = await client.chat.completions.create(
            model="policy", messages=[QUESTION], tools=[MULTIPLY], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [call for delta in deltas for call in delta.tool_calls or []]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert "".join(d.content or "" for d in deltas) == ""
        assert [(c.index, c.type, c.function.name) for c in calls] == [(0, "function", "multiply")] and calls[0].id
        assert json.loads(calls[0].function.arguments) == {"a": 37, "b": 52}
        assert chunks[-1].usage.completion_tokens == len(turn.token_ids)
        return 1.0

    turn = sampled(tokenizer, CALL)
    trajectory = play(agent, FakeGenerate([turn]), renderer)
    assert trajectory.status == TrajectoryStatus.DONE
    assert trajectory.generated_spans[0].token_ids == tuple(turn.token_ids)


def test_parallel_calls_come_back_in_order_and_parallel_tool_calls_false_keeps_the_first_as_vllm_does(
    tokenizer, renderer
):
    two = CALL + "\n" + CALL.replace("37", "6").replace("52", "7")
    seen = {}

    async def agent(client):
        for parallel in (None, False):
            reply = await client.chat.completions.create(
                model="p", messages=[QUESTION], tools=[MULTIPLY], parallel_tool_calls=parallel
            )
            seen[parallel] = [json.loads(c.function.arguments)["a"] for c in reply.choices[0].message.tool_calls]
        return 1.0

    play(agent, FakeGenerate([sampled(tokenizer, two), sampled(tokenizer, two)]), renderer)
    assert seen == {None: [37, 6], False: [37]}


def test_text_before_a_call_is_the_content_and_a_template_that_re_renders_it_differently_forks(tokenizer, renderer):
    # Qwen2.5's template writes "\n" + content + "\n<tool_call>": the content the parser returns
    # ("Let me multiply.\n") comes back with one newline more than the model sampled, so the next
    # call's prompt does not start with the sampled ids: a new sample, never unsampled ids trained.
    turns = [sampled(tokenizer, "Let me multiply.\n" + CALL), sampled(tokenizer, "1924")]
    replies = []
    trajectory = play(multiply_agent(replies), FakeGenerate(turns), renderer)

    assert replies[0].choices[0].message.content == "Let me multiply.\n"
    assert replies[0].choices[0].finish_reason == "tool_calls"
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_forks == 1
    assert [span.token_ids for span in trajectory.generated_spans] == [tuple(t.token_ids) for t in turns]
    assert all(isinstance(span, ContextSpan) for span in trajectory.samples[1].spans[:-1])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 37}\n</tool_call>',  # a brace short: invalid JSON
        '<tool_call>\n{"arguments": {"a": 37, "b": 52}}\n</tool_call>',  # no name
        "<tool_call>\nmultiply(37, 52)\n</tool_call>",  # not JSON at all
    ],
)
def test_a_call_the_model_wrote_badly_comes_back_as_content_not_a_crash(tokenizer, renderer, text):
    async def agent(client):
        reply = await client.chat.completions.create(model="p", messages=[QUESTION], tools=[MULTIPLY])
        choice = reply.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert choice.message.content == text
        return 0.0

    trajectory = play(agent, FakeGenerate([sampled(tokenizer, text)]), renderer)
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_turns == 1


def test_a_reply_without_a_call_is_content_with_finish_reason_stop(tokenizer, renderer):
    async def agent(client):
        reply = await client.chat.completions.create(model="p", messages=[QUESTION], tools=[MULTIPLY])
        assert reply.choices[0].message.content == "1924" and reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.tool_calls is None
        return 1.0

    assert play(agent, FakeGenerate([sampled(tokenizer, "1924")]), renderer).final_reward == 1.0


def test_tool_call_tokens_marked_special_are_still_read_as_vllms_hermes_parser_asks(tmp_path):
    tokenizer = PromptTokenizer(save_tool_chat_tokenizer(tmp_path, ("<tool_call>", "</tool_call>"), special=True))
    turn = sampled(tokenizer, CALL)
    assert "<tool_call>" not in tokenizer.decode(turn.token_ids)  # a decode skipping special tokens hides the call

    async def agent(client):
        reply = await client.chat.completions.create(model="p", messages=[QUESTION], tools=[MULTIPLY])
        assert reply.choices[0].message.tool_calls[0].function.name == "multiply"
        return 1.0

    assert play(agent, FakeGenerate([turn]), ChatTemplateRenderer(tokenizer, "hermes")).status == TrajectoryStatus.DONE


def test_tool_choice_none_shows_the_tools_and_reads_no_call(tokenizer, renderer):
    generate = FakeGenerate([sampled(tokenizer, CALL)])

    async def agent(client):
        reply = await client.chat.completions.create(
            model="p", messages=[QUESTION], tools=[MULTIPLY], tool_choice="none"
        )
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == CALL
        return 1.0

    play(agent, generate, renderer)
    assert generate.calls[0][0] == tokenizer.encode_chat([QUESTION], tools=[MULTIPLY])


def refusal(renderer, tokenizer, question=QUESTION, **request) -> openai.BadRequestError:
    """The 400 a request gets; the agent then makes a plain call, so the episode is done."""
    caught = []

    async def agent(client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="p", messages=[question], **request)
        caught.append(refused.value)
        await client.chat.completions.create(model="p", messages=[question])
        return 1.0

    trajectory = play(agent, FakeGenerate([sampled(tokenizer, "A")]), renderer)
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_turns == 1
    return caught[0]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "multiply"}}])
def test_tool_choice_that_forces_a_call_is_refused_naming_the_field(tokenizer, renderer, tool_choice):
    error = refusal(renderer, tokenizer, tools=[MULTIPLY], tool_choice=tool_choice)
    assert error.param == "tool_choice" and "constrained" in str(error) and '"auto"' in str(error)


def test_tool_choice_without_tools_and_a_tool_that_is_not_a_function_are_refused(tokenizer, renderer):
    assert refusal(renderer, tokenizer, tool_choice="auto").param == "tool_choice"
    error = refusal(renderer, tokenizer, tools=[{"type": "function", "function": {"description": "no name"}}])
    assert error.param == "tools[0]" and "not a function definition" in str(error)


def test_tools_on_the_plain_renderer_are_refused_naming_the_field_and_the_fix(tmp_path):
    save_char_tokenizer(tmp_path)
    tokenizer = PromptTokenizer(tmp_path)
    error = refusal(PlainTextRenderer(tokenizer), tokenizer, {"role": "user", "content": "37*52="}, tools=[MULTIPLY])
    assert error.param == "tools" and "PlainTextRenderer" in str(error)
    assert "--environment.renderer chat_template --environment.tool-call-parser hermes" in str(error)


def test_tools_without_a_parser_or_with_a_template_that_ignores_them_are_refused(tokenizer, tmp_path):
    error = refusal(ChatTemplateRenderer(tokenizer), tokenizer, tools=[MULTIPLY])
    assert error.param == "tools" and "--environment.tool-call-parser" in str(error)

    save_char_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    no_tools_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": no_tools_template}))
    ignoring = PromptTokenizer(tmp_path)
    error = refusal(ChatTemplateRenderer(ignoring, "hermes"), ignoring, tools=[MULTIPLY])
    assert error.param == "tools" and "never see them" in str(error)


def test_an_assistant_tool_call_sent_to_the_plain_renderer_is_refused(tmp_path):
    save_char_tokenizer(tmp_path)
    tokenizer = PromptTokenizer(tmp_path)
    history = [
        {"role": "user", "content": "37*52="},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": "{}"}}],
        },
    ]

    async def agent(client):
        with pytest.raises(openai.BadRequestError, match="cannot render tools or tool calls") as refused:
            await client.chat.completions.create(model="p", messages=history)
        assert refused.value.param == "messages"
        return 1.0

    play(agent, FakeGenerate([]), PlainTextRenderer(tokenizer))


def test_an_unknown_parser_and_a_parser_without_a_chat_template_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match="not one of vLLM's tool parsers .*hermes"):
        ChatTemplateRenderer(tokenizer, tool_call_parser="hermes2")
    with pytest.raises(ConfigError, match="--environment.renderer chat_template"):
        EnvironmentConfig(tool_call_parser="hermes")
    assert EnvironmentConfig(renderer="chat_template", tool_call_parser="hermes").tool_call_parser == "hermes"


def test_the_tool_agent_example_of_the_docs_runs(tokenizer, renderer):
    page = (Path(__file__).resolve().parents[3] / "docs" / "environments.md").read_text()
    blocks = [piece.split("```")[0] for piece in page.split("```python\n")[1:]]
    [code] = [block for block in blocks if "tool_calls" in block]
    namespace = {"__name__": "docs_example"}
    exec(compile(code, "docs/environments.md", "exec"), namespace)
    trajectory = play(
        namespace["agent"], FakeGenerate([sampled(tokenizer, CALL), sampled(tokenizer, "1924")]), renderer
    )
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0 and trajectory.num_forks == 0


def test_verifiers_chat_program_reads_the_streamed_calls_and_sends_the_results_back(tokenizer, renderer):
    """A third-party consumer of streamed tool calls: verifiers' bundled chat program (run unmodified,
    as forge_rl/envs/verifiers_adapter.py runs it) accumulates the stream with openai's
    AsyncChatCompletionStream, answers the call (here: an unknown tool, its own error text) and calls
    again; the trajectory is one sample, the program's tool message its context."""
    pytest.importorskip("verifiers", reason="verifiers is optional")
    import argparse

    from forge_rl.envs.verifiers_adapter import _chat_program

    program, transcript = _chat_program(), []

    async def agent(client):
        args = argparse.Namespace(tool_interception_url="", bash=False, edit=False, search=False)
        compactor = program["Compactor"](client, "policy", [MULTIPLY], False, None)
        transcript.extend([QUESTION])
        await program["run_chat_loop"](args, compactor, transcript, {}, {}, None)
        return float(transcript[-1]["content"] == "1924")

    turns = [sampled(tokenizer, CALL), sampled(tokenizer, "1924")]
    trajectory = play(agent, FakeGenerate(turns), renderer)
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0 and trajectory.num_forks == 0
    assert transcript[1]["tool_calls"][0]["function"]["name"] == "multiply"
    assert transcript[2]["role"] == "tool" and "unknown tool" in transcript[2]["content"]
    assert [span.token_ids for span in trajectory.generated_spans] == [tuple(t.token_ids) for t in turns]


def test_preflight_refuses_an_unknown_parser_and_a_model_without_a_chat_template_before_any_process(tmp_path):
    from forge_rl.config import GRPOConfig, ModelConfig
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
    from forge_rl.run.preflight import check_model_inputs
    from tests.support.tool_chat import TOOL_ALPHABET

    plain = create_tiny_model(
        TinyModelConfig(), tmp_path / "plain", TOOL_ALPHABET
    )  # a character tokenizer, no template
    chat = save_tool_chat_tokenizer(create_tiny_model(TinyModelConfig(), tmp_path / "chat", TOOL_ALPHABET))

    def config(model_dir, parser):
        environment = EnvironmentConfig(
            name="calculator",
            renderer="chat_template",
            tool_call_parser=parser,
            limits=EpisodeLimits(max_total_tokens=128),
        )
        return GRPOConfig(model=ModelConfig(path=model_dir), environment=environment)

    with pytest.raises(ConfigError, match="not one of vLLM's tool parsers"):
        check_model_inputs(config(chat, "hermes2"), chat)
    with pytest.raises(ConfigError, match=r"environment.renderer \('chat_template'\): .* has no chat template"):
        check_model_inputs(config(plain, "hermes"), plain)
    check_model_inputs(config(chat, "hermes"), chat)
