"""The requests of the in-process chat endpoint (`forge_rl.envs.chat_client`): a body parsed and
checked (`parse_request`), every field the generator cannot honour refused with an error naming it
(`ChatRequestError`, an HTTP 400 to the agent), never silently ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from forge_rl.envs.environment import Message, ToolCall

MODEL_NAME = "policy"
"""What `GET /models` lists. Any model name is accepted: there is one policy."""


_ACCEPTED_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "user",
    "metadata",
    "store",
    "seed",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
"""Request fields the endpoint honours, or that change nothing the trajectory records (user,
metadata, store; seed: the generator's own randomness decides, and the logprobs describe it);
n and top_logprobs only at their one-sample, no-alternatives values, tool_choice at "auto" and
"none". Any other set field is refused with a 400 naming it."""


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "logit_bias"}


class ChatRequestError(Exception):
    """A request answered with an HTTP error: `status`, the message, the field at fault, an OpenAI error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status == 400 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[Message]
    max_tokens: int | None
    logprobs: bool
    model: str
    tools: list[dict] | None = None
    """OpenAI function definitions, as sent."""
    tool_fields: dict = field(default_factory=dict)
    """tools, tool_choice and parallel_tool_calls as sent: what vLLM's tool parser reads."""

    @property
    def reads_tool_calls(self) -> bool:
        """Whether replies are parsed for calls: tools given, and tool_choice not "none" (vLLM's rule)."""
        return bool(self.tools) and self.tool_fields.get("tool_choice") != "none"


def parse_request(body: Any) -> ChatRequest:
    """The request's messages and options; ChatRequestError (400) naming what cannot be served."""
    if not isinstance(body, dict):
        raise ChatRequestError("the request body must be a JSON object")
    for name, value in body.items():
        if value is None or name in _ACCEPTED_FIELDS:
            continue
        if name in _SAMPLING_FIELDS:
            raise ChatRequestError(
                f"{name} is not supported: the policy samples with the generator's own settings "
                "(generator.temperature, generator.top_p), which the recorded behaviour logprobs describe. "
                f"Leave {name} unset.",
                param=name,
            )
        raise ChatRequestError(f"{name} is not supported by forge_rl's chat endpoint; leave it unset.", param=name)
    if body.get("n") not in (None, 1):
        raise ChatRequestError(
            f"n ({body['n']}) is not supported: one call samples one turn. Make n calls (a GRPO group is "
            "group_size episodes, each its own agent run).",
            param="n",
        )
    if body.get("top_logprobs"):
        raise ChatRequestError(
            f"top_logprobs ({body['top_logprobs']}) is not supported: the reply carries the sampled tokens' "
            "logprobs only (logprobs=true).",
            param="top_logprobs",
        )
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if any(not isinstance(v, int) or v < 1 for v in limits):
        raise ChatRequestError(f"max_tokens ({limits}) must be a positive integer", param="max_tokens")
    tools = _tools(body.get("tools"))
    _check_tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(body.get("messages") or [])] or _no_messages(),
        max_tokens=min(limits) if limits else None,
        logprobs=bool(body.get("logprobs")),
        model=str(body.get("model") or MODEL_NAME),
        tools=tools,
        tool_fields={k: body[k] for k in ("tools", "tool_choice", "parallel_tool_calls") if body.get(k) is not None},
    )


def _tools(tools: Any) -> list[dict] | None:
    """The request's function definitions; 400 naming the first that is not one."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError(f"tools ({tools!r}) must be a list of function definitions", param="tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise ChatRequestError(
                f"tools[{index}] ({tool!r}) is not a function definition: expected "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}',
                param=f"tools[{index}]",
            )
    return tools


def _check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> None:
    """ "auto" and "none" are served; forcing calls is not (module docstring)."""
    if tool_choice is None:
        return
    if not tools:
        raise ChatRequestError(
            f"tool_choice ({tool_choice!r}) is set without tools; pass tools or leave it unset", param="tool_choice"
        )
    if tool_choice not in ("auto", "none"):
        raise ChatRequestError(
            f'tool_choice ({tool_choice!r}) is not supported: forcing a call ("required", or a named function) needs '
            "decoding constrained to the call's schema, and the recorded logprobs would then describe a distribution "
            'the trainer cannot recompute. Use tool_choice "auto" (the model decides) and check the reply\'s tool_calls.',
            param="tool_choice",
        )


def _no_messages() -> list[Message]:
    raise ChatRequestError("messages is empty: a chat completion needs at least one message", param="messages")


def _message(message: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatRequestError(f"{where} must be an object with a role", param=where)
    tool_calls = tuple(
        _tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(message.get("tool_calls") or [])
    )
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise ChatRequestError(f"{where}.tool_call_id ({tool_call_id!r}) must be text", param=f"{where}.tool_call_id")
    content = message.get("content")
    if content is None and tool_calls:
        content = ""  # an assistant message that only made calls
    if isinstance(content, list):  # content parts: text only
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ChatRequestError(f"{where}.content holds a part that is not text", param=f"{where}.content")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(content, str):
        raise ChatRequestError(f"{where}.content must be text", param=f"{where}.content")
    return Message(message["role"], content, tool_calls, tool_call_id)


def _tool_call(call: Any, where: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or call.get("type", "function") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise ChatRequestError(
            f'{where} ({call!r}) is not a function call: expected {{"id": ..., "type": "function", '
            '"function": {"name": ..., "arguments": "<JSON text>"}}',
            param=where,
        )
    arguments = function.get("arguments")
    arguments = json.dumps(arguments) if isinstance(arguments, dict) else arguments or ""
    if not isinstance(arguments, str):
        raise ChatRequestError(
            f"{where}.function.arguments ({arguments!r}) must be JSON text", param=f"{where}.function.arguments"
        )
    return ToolCall(str(call.get("id") or ""), function["name"], arguments)
