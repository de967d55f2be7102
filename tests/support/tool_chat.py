"""A tiny tokenizer whose chat template renders tools, built from scratch (nothing downloaded), for the
tests of tool calls through the chat endpoint (forge_rl/envs/chat_client.py).

The template is Qwen2.5's (the hermes format that vLLM's `hermes` parser reads: a system block
listing the tools as JSON inside <tools></tools>, each call as
<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, tool results in a user turn inside
<tool_response></tool_response>), with the character tokenizer's <bos> and <eos> in place of
<|im_start|> and <|im_end|>. The alphabet is printable ASCII plus newline, one token per character.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from forge_rl.tasks.tokenizer import build_char_tokenizer, save_char_tokenizer

TOOL_ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
"""Every printable ASCII character, space and newline: enough to spell JSON and the template."""

HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<bos>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><eos>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<bos>system\\n' + messages[0]['content'] + '<eos>\\n' }}"
    "{%- else %}{{- '<bos>system\\nYou are a helpful assistant.<eos>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<bos>' + message.role + '\\n' + message.content + '<eos>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<bos>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<eos>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<bos>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<eos>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<bos>assistant\\n' }}{%- endif %}"
)


def save_tool_chat_tokenizer(model_dir: Path, whole_tokens: tuple[str, ...] = (), special: bool = False) -> Path:
    """Write the character tokenizer of TOOL_ALPHABET with HERMES_TEMPLATE into `model_dir`.
    `whole_tokens` are added as single tokens after the characters (ids from
    len(SPECIAL_TOKENS) + len(TOOL_ALPHABET) on), special ones when `special`: some hermes models
    mark <tool_call> and </tool_call> special, and a decode that skips special tokens drops them."""
    model_dir = Path(model_dir)
    save_char_tokenizer(model_dir, TOOL_ALPHABET)
    if whole_tokens:
        tokenizer = build_char_tokenizer(TOOL_ALPHABET)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)(list(whole_tokens))
        tokenizer.save(str(model_dir / "tokenizer.json"))
    config_path = model_dir / "tokenizer_config.json"
    config_path.write_text(
        json.dumps(json.loads(config_path.read_text()) | {"chat_template": HERMES_TEMPLATE}, indent=2)
    )
    return model_dir
