"""Tool calls through the chat endpoint (forge_rl/envs/chat_client.py) on the real vLLM engine: an
unmodified OpenAI-client agent passes tools, vLLM samples a hermes call, vLLM's own hermes parser
reads it, the agent sends the tool result back, and the trajectory holds exactly the ids vLLM
sampled, in one sample.

A random tiny model would write noise, never a call. This one is built to answer deterministically:
its attention and MLP outputs are zeroed, so each position's logits depend on its own token only
(a bigram model), and its embeddings and output head make the character "\\n" (which ends the
template's assistant header) followed by <tool_call>, the call's JSON as one token, </tool_call>
and eos, by logit margins no temperature or top-p can overturn. Everything after the weights is the
real path: vLLM's engine, the chat template, the parser, the openai client.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the chat client needs the openai package (vLLM installs it)")

from forge_rl.engines.config import GeneratorConfig  # noqa: E402
from forge_rl.engines.vllm_engine import VLLMEngine  # noqa: E402
from forge_rl.envs.chat_client import ChatAgentEnvironment  # noqa: E402
from forge_rl.envs.renderers import ChatTemplateRenderer  # noqa: E402
from forge_rl.envs.runner import EpisodeLimits  # noqa: E402
from forge_rl.envs.trajectory import ContextSpan, TrajectoryStatus  # noqa: E402
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer  # noqa: E402
from tests.support.tool_chat import TOOL_ALPHABET, save_tool_chat_tokenizer  # noqa: E402

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 1024
"""The tools' system prompt alone is about 600 characters, one token each."""
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=8)
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "a*b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALL_JSON = '\n{"name": "multiply", "arguments": {"a": 37, "b": 52}}\n'
"""The call's body exactly as the template renders it between <tool_call> and </tool_call>."""
WHOLE_TOKENS = ("<tool_call>", CALL_JSON, "</tool_call>")
QUESTION = {"role": "user", "content": "What is 37*52?"}


def bigram_tool_model(model_dir: Path) -> Path:
    """A tiny Llama whose next token depends on the current token only: "\\n" -> <tool_call> ->
    the call's JSON -> </tool_call> -> eos, and eos after any other token."""
    import torch
    from safetensors.torch import load_file, save_file

    placeholders = "".join(chr(0x100 + i) for i in range(len(WHOLE_TOKENS)))  # rows for the whole tokens
    create_tiny_model(TinyModelConfig(max_position_embeddings=MAX_MODEL_LEN), model_dir, TOOL_ALPHABET + placeholders)
    save_tool_chat_tokenizer(model_dir, WHOLE_TOKENS)
    tokenizer = PromptTokenizer(model_dir)
    weights = load_file(model_dir / "model.safetensors")
    vocab_size, hidden_size = weights["model.embed_tokens.weight"].shape
    assert vocab_size <= hidden_size, "one embedding dimension per token"
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])  # each position sees its own token only
    weights["model.embed_tokens.weight"] = torch.eye(vocab_size, hidden_size)
    weights["model.norm.weight"] = torch.ones(hidden_size)
    chain = [tokenizer.encode_text("\n")[0], *(tokenizer.encode_text(t)[0] for t in WHOLE_TOKENS)]
    assert len(set(chain)) == 4, "each whole token is one id"
    successor = {token: tokenizer.eos_id for token in range(vocab_size)} | dict(zip(chain, chain[1:]))
    successor[chain[-1]] = tokenizer.eos_id
    head = torch.zeros(vocab_size, hidden_size)
    for token, following in successor.items():
        head[following, token] = 20.0  # x sqrt(hidden_size) after the norm: a margin of about 226 logits
    weights["lm_head.weight"] = head
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = bigram_tool_model(tmp_path_factory.mktemp("tool_model") / "model")
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(GeneratorConfig(max_new_tokens=8))
    loop.run_until_complete(engine.start(model_dir, MAX_MODEL_LEN))
    yield engine, loop, PromptTokenizer(model_dir)
    loop.run_until_complete(engine.shutdown())
    loop.close()


def test_a_call_vllm_sampled_is_read_by_vllms_parser_and_the_tool_loop_is_one_sample_of_sampled_ids(served):
    engine, loop, tokenizer = served
    sampled = []  # (prefix, turn) as the generator returned them: the witness

    async def generate(prefix, max_new_tokens):
        turn = await engine.generate_turn(prefix, max_new_tokens, eos_id=tokenizer.eos_id)
        sampled.append((list(prefix), turn))
        return turn

    replies = []

    async def agent(client):
        messages = [QUESTION]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[MULTIPLY])
        replies.append(reply)
        call = reply.choices[0].message.tool_calls[0]
        messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "1924"}]
        # tool_choice "none": the model writes its call again, and it comes back as text.
        replies.append(
            await client.chat.completions.create(
                model="policy", messages=messages, tools=[MULTIPLY], tool_choice="none"
            )
        )
        return 1.0

    renderer = ChatTemplateRenderer(tokenizer, tool_call_parser="hermes")
    trajectory = loop.run_until_complete(ChatAgentEnvironment(agent).play(generate, renderer, LIMITS))

    first, second = (reply.choices[0] for reply in replies)
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.tool_calls[0].function.name == "multiply"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"a": 37, "b": 52}
    assert second.finish_reason == "stop" and second.message.tool_calls is None
    assert second.message.content == "<tool_call>" + CALL_JSON + "</tool_call>"

    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_forks == 0
    [sample] = trajectory.samples
    assert [list(span.token_ids) for span in trajectory.generated_spans] == [turn.token_ids for _, turn in sampled]
    assert [list(span.logprobs) for span in trajectory.generated_spans] == [turn.logprobs for _, turn in sampled]
    assert sampled[0][0] == tokenizer.encode_chat([QUESTION], tools=[MULTIPLY])
    assert sampled[1][0] == sample.token_ids[: -len(sampled[1][1].token_ids)]  # after exactly the sample so far
    tool_result = tokenizer.decode(list(sample.spans[2].token_ids), skip_special_tokens=False)
    assert isinstance(sample.spans[2], ContextSpan) and "<tool_response>\n1924\n</tool_response>" in tool_result
