"""Renderers: how a conversation becomes the token ids a model reads.

A renderer renders the whole conversation so far, ending with the cue for the model's next turn.
The trajectory builder (`forge_rl.envs.trajectory`) keeps only what lies past the tokens it
already holds, so earlier tokens, the sampled ones above all, are never replaced; and where the
rendering disagrees with them, it knows the prefix broke.

- `ChatTemplateRenderer`: the model directory's chat template (real models). It also renders
  tools (OpenAI function definitions, passed to the template as `transformers` passes them),
  assistant turns that made tool calls, and tool results; with a tool-call parser named (vLLM's
  --tool-call-parser names: `forge_rl.envs.tool_calls`) it reads calls back out of sampled turns.
- `PlainTextRenderer`: the tiny models' plain format: no roles, bos then each message's text, each
  assistant turn closed by eos, as the single-turn tasks write prompts ("M37=" then "7<eos>"). It
  has no syntax for tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from forge_rl.envs.environment import Message
from forge_rl.envs.tool_calls import ToolCallParser
from forge_rl.tasks.tokenizer import PromptTokenizer


class Renderer(Protocol):
    """How a conversation becomes token ids. Renderers written before tools existed may leave out
    `tools`, `renders_tools` and `tool_call_parser`: the chat endpoint then refuses tools with a 400."""

    tool_call_parser: ToolCallParser | None
    """Reads tool calls out of sampled turns (`forge_rl.envs.tool_calls`); None: no calls are read."""

    def render(self, conversation: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the whole conversation, ending where the model writes its next turn; `tools`
        (OpenAI function definitions) written where the model's format puts them."""
        ...

    def renders_tools(self, tools: Sequence[dict]) -> bool:
        """Whether `tools` change what the model reads (a template that ignores them would hide
        them from the model)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of sampled tokens, special tokens removed: what the environment reads."""
        ...


class PlainTextRenderer:
    """bos + each message's text (roles are not written) + eos after each assistant turn.

    For the character tokenizer of the tiny models every character is one token, so a sampled turn
    renders back to exactly its ids unless the model sampled a special token inside it.
    """

    tool_call_parser: ToolCallParser | None = None

    def __init__(self, tokenizer: PromptTokenizer):
        self.tokenizer = tokenizer

    def render(self, conversation: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        if tools or any(message.tool_calls for message in conversation):
            raise ValueError(
                "PlainTextRenderer cannot render tools or tool calls: the tiny models' plain format has no syntax "
                "for them. Use a chat model whose template renders tools (--environment.renderer chat_template, "
                "--environment.tool-call-parser hermes)."
            )
        token_ids = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        for message in conversation:
            token_ids += self._encode(message.content)
            if message.role == "assistant":
                token_ids.append(self.tokenizer.eos_id)
        return token_ids

    def renders_tools(self, tools: Sequence[dict]) -> bool:
        return False

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def _encode(self, text: str) -> list[int]:
        token_ids = self.tokenizer.encode_text(text)
        if self.tokenizer.decode(token_ids) != text:
            # The character tokenizer maps an unknown character to <unk>, which decodes to nothing:
            # the model would read a different text from the one the environment wrote.
            raise ValueError(
                f"{text!r} holds characters the tokenizer of {self.tokenizer.model_dir} cannot spell "
                f"(it reads back as {self.tokenizer.decode(token_ids)!r}). Write observations in the "
                "model's vocabulary (forge_rl/tasks/tokenizer.py ALPHABET for the tiny models)."
            )
        return token_ids


class ChatTemplateRenderer:
    """The model directory's chat template, with the assistant header of the next turn at the end.
    `tool_call_parser` names the vLLM tool parser that reads the model's calls (vLLM's
    --tool-call-parser: hermes for Qwen2.5, Qwen3, Hermes); unset, tools are rendered but no call
    is read back."""

    def __init__(self, tokenizer: PromptTokenizer, tool_call_parser: str | None = None):
        if not tokenizer.has_chat_template:
            raise ValueError(
                f"{tokenizer.model_dir} has no chat template. Use PlainTextRenderer for models without "
                "one (the tiny models), or point --model.path at a chat model's directory."
            )
        self.tokenizer = tokenizer
        self.tool_call_parser = None if tool_call_parser is None else ToolCallParser(tool_call_parser, tokenizer)
        self._renders_tools: dict[str, bool] = {}

    def render(self, conversation: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        messages = [template_message(message) for message in conversation]
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=list(tools) if tools else None)

    def renders_tools(self, tools: Sequence[dict]) -> bool:
        key = json.dumps(list(tools), sort_keys=True)
        if key not in self._renders_tools:
            probe = [Message("user", "?")]
            self._renders_tools[key] = self.render(probe, tools) != self.render(probe)
        return self._renders_tools[key]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))


def template_message(message: Message) -> dict:
    """`message` as chat templates read it: OpenAI's shape, with each tool call's arguments as an
    object, not JSON text (what transformers asks of tool-use templates, and what vLLM's
    renderer does in `_postprocess_messages`: arguments that are not a JSON object become {})."""
    rendered: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_object(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments_object(arguments: str) -> dict:
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def make_renderer(kind: str, model_dir, tool_call_parser: str | None = None) -> Renderer:
    """The renderer `environment.renderer` names ("plain" or "chat_template") for the model in
    `model_dir`, reading tool calls with `environment.tool_call_parser` (chat_template only)."""
    tokenizer = PromptTokenizer(model_dir)
    if kind == "plain":
        return PlainTextRenderer(tokenizer)
    return ChatTemplateRenderer(tokenizer, tool_call_parser)
