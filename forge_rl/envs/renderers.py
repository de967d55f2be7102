"""Renderers: how a conversation becomes the token ids a model reads.

A renderer renders the whole conversation so far, ending with the cue for the model's next turn.
The trajectory builder (forge_rl/envs/trajectory.py) keeps only what lies past the tokens it
already holds, so earlier tokens, the sampled ones above all, are never replaced; and where the
rendering disagrees with them, it knows the prefix broke.

- `ChatTemplateRenderer`: the model directory's chat template (real models).
- `PlainTextRenderer`: the tiny models' plain format: no roles, bos then each message's text, each
  assistant turn closed by eos, as the single-turn tasks write prompts ("M37=" then "7<eos>").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forge_rl.envs.environment import Message
from forge_rl.tasks.tokenizer import PromptTokenizer


class Renderer(Protocol):
    def render(self, conversation: Sequence[Message]) -> list[int]:
        """Token ids of the whole conversation, ending where the model writes its next turn."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of sampled tokens, special tokens removed: what the environment reads."""
        ...


class PlainTextRenderer:
    """bos + each message's text (roles are not written) + eos after each assistant turn.

    For the character tokenizer of the tiny models every character is one token, so a sampled turn
    renders back to exactly its ids unless the model sampled a special token inside it.
    """

    def __init__(self, tokenizer: PromptTokenizer):
        self.tokenizer = tokenizer

    def render(self, conversation: Sequence[Message]) -> list[int]:
        token_ids = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        for message in conversation:
            token_ids += self._encode(message.content)
            if message.role == "assistant":
                token_ids.append(self.tokenizer.eos_id)
        return token_ids

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
    """The model directory's chat template, with the assistant header of the next turn at the end."""

    def __init__(self, tokenizer: PromptTokenizer):
        if not tokenizer.has_chat_template:
            raise ValueError(
                f"{tokenizer.model_dir} has no chat template. Use PlainTextRenderer for models without "
                "one (the tiny models), or point --model.path at a chat model's directory."
            )
        self.tokenizer = tokenizer

    def render(self, conversation: Sequence[Message]) -> list[int]:
        messages = [{"role": message.role, "content": message.content} for message in conversation]
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))


def make_renderer(kind: str, model_dir) -> Renderer:
    """The renderer `environment.renderer` names ("plain" or "chat_template") for the model in `model_dir`."""
    tokenizer = PromptTokenizer(model_dir)
    return PlainTextRenderer(tokenizer) if kind == "plain" else ChatTemplateRenderer(tokenizer)
