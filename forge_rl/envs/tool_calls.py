"""Tool calls read out of sampled text by vLLM's own tool parsers (vllm/tool_parsers/).

vLLM's OpenAI server reads a model's tool calls out of its output with the parser its
`--tool-call-parser` names (hermes for Qwen2.5, Qwen3 and Hermes models; llama3_json, mistral,
pythonic, ...). forge_rl's in-process chat endpoint (`forge_rl.envs.chat_client`) uses the same
parsers under the same names, so an agent gets back the calls vLLM's server would return for the
same tokens. A parser is a class built from the model's `transformers` tokenizer and the request's
tools; `extract_tool_calls(text, request)` reads one whole turn. The request is vLLM's own
`ChatCompletionRequest`, built here from the request's tool fields: no server, no engine, no
socket is involved, so the parsers run offline as they are.

    parser = ToolCallParser("hermes", tokenizer)
    request = parser.request({"tools": [...], "tool_choice": "auto"})    # ValueError: a bad field
    turn = parser.parse(sampled_token_ids, request)
    turn.content, turn.tool_calls     # None, (ToolCall(id="chatcmpl-tool-...", name="calc", arguments='{"x": 1}'),)

What is parsed is the turn's text as vLLM's server makes it: the stop token left out, and special
tokens kept or skipped as the parser's `adjust_request` decides (hermes keeps them: some models
mark <tool_call> special, and skipping it would hide every call). A call the model wrote badly
(invalid JSON, no name) is no call: the parser returns the text as content, as vLLM does, and the
agent reads what the model wrote.

Only the whole-turn method is used, for streamed replies too: the endpoint samples the whole turn
before it answers, so a streamed reply is this parse cut into chunks, never a second opinion from
the streaming parser.

vLLM is imported when a parser is made (seconds, torch included), never when this module is:
environments stay light (tests/unit/test_package_boundaries.py).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from forge_rl.envs.environment import ToolCall
from forge_rl.errors import ConfigError
from forge_rl.tasks.tokenizer import PromptTokenizer

TOOL_REQUEST_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
"""The request fields a parser reads (vLLM's parsers read no message)."""


@dataclass(frozen=True)
class ParsedTurn:
    """A sampled turn as the reply carries it: text outside the calls (None when there is none
    beside a call), and the calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


class ToolCallParser:
    """vLLM's tool parser `name` (vLLM's --tool-call-parser) for the model whose tokenizer is
    `tokenizer` (a directory with a chat template). ConfigError naming the known parsers when vLLM
    has none of that name."""

    def __init__(self, name: str, tokenizer: PromptTokenizer):
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError as e:
            raise ConfigError(
                f"environment.tool_call_parser ({name!r}) reads tool calls with vLLM's parsers, and vLLM cannot be "
                f"imported here ({e}). Install vLLM (forge_rl's generator needs it anyway), or unset the parser."
            ) from e
        known = ToolParserManager.list_registered()
        if name not in known:
            raise ConfigError(
                f"environment.tool_call_parser ({name!r}) is not one of vLLM's tool parsers ({', '.join(known)}). "
                "Set it to the model's format, as for vLLM's --tool-call-parser (hermes for Qwen2.5, Qwen3, Hermes)."
            )
        self.name, self.tokenizer = name, tokenizer
        self.parser_cls = ToolParserManager.get_tool_parser(name)

    def request(self, body: dict[str, Any]) -> Any:
        """vLLM's `ChatCompletionRequest` holding the tool fields of `body`, as the parser reads it;
        ValueError when vLLM's schema refuses them (a tool without a name, ...)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = {name: body[name] for name in TOOL_REQUEST_FIELDS if body.get(name) is not None}
        try:
            return ChatCompletionRequest(model=str(body.get("model") or "policy"), messages=[], **fields)
        except ValidationError as e:
            raise ValueError(str(e)) from None

    def parse(self, token_ids: Sequence[int], request: Any) -> ParsedTurn:
        """The calls in a sampled turn and the text around them (module docstring)."""
        parser = self.parser_cls(self.tokenizer.hf_tokenizer, request.tools)  # stateful: one per turn, as in vLLM
        request = parser.adjust_request(request.model_copy())
        ids = list(token_ids)
        if ids and ids[-1] in self.tokenizer.eos_ids:
            ids = ids[:-1]  # vLLM leaves the stop token out of a reply's text
        text = self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        try:
            with _parser_log_silenced(self.parser_cls.__module__):
                found = parser.extract_tool_calls(text, request)
        except Exception:
            # hermes catches its own errors and answers with the text; a parser that raises
            # instead is treated the same way: the model's text is the reply, not a crash.
            return ParsedTurn(text)
        if not found.tools_called:
            return ParsedTurn(text if found.content is None else found.content)
        calls = tuple(
            ToolCall(call.id or f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", call.function.name, call.function.arguments)
            for call in found.tool_calls
        )
        if request.parallel_tool_calls is False:
            calls = calls[:1]  # vLLM's maybe_filter_parallel_tool_calls: the first call only
        return ParsedTurn(found.content, calls)


@contextlib.contextmanager
def _parser_log_silenced(logger_name: str) -> Iterator[None]:
    """Silence vLLM's parser module while it reads a turn: it logs every badly written call with a
    traceback, and a policy in training writes many (each is returned as content, which is the
    whole report the agent needs)."""
    logger = logging.getLogger(logger_name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled
