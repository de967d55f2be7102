"""Tokenizers of model directories: `PromptTokenizer` for any HF directory, and the tiny models'
character-level tokenizer.

`PromptTokenizer` reads the directory's tokenizer.json (HF `tokenizers`) and its special-token
files, and renders chat templates through `transformers` when the directory has one. The character
tokenizer is a `tokenizers` BPE model with no merges (so every character is one token), stored as a
standard tokenizer.json that `transformers.AutoTokenizer` and `tokenizers.Tokenizer.from_file` both
load offline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ=+-*/ "
# The real vocabulary, unpadded: padding rows would never be a target, yet a from-scratch model
# gives them probability mass at every early sample. vLLM pads its embedding rows itself.
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(ALPHABET)


def build_char_tokenizer(alphabet: str = ALPHABET):
    """Ids: the special tokens (0-3), then one per character of `alphabet`, in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def save_char_tokenizer(model_dir: Path, alphabet: str = ALPHABET) -> None:
    """Write tokenizer.json and tokenizer_config.json so AutoTokenizer loads the directory."""
    build_char_tokenizer(alphabet).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "unk_token": UNK,
                "add_bos_token": False,
                "model_max_length": 4096,
            },
            indent=2,
        )
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What turns text into a model directory's token ids: the vocabulary and merges, the special
tokens, the chat template (in tokenizer_config.json or beside it)."""


def tokenizer_fingerprint(model_dir: Path) -> str:
    """A digest of `model_dir`'s TOKENIZER_FILES (those it has): two directories with the same one
    map every text and chat to the same ids, so token ids sampled under one continue under the other."""
    digest = hashlib.blake2b(digest_size=16)
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_ids(value) -> list[int]:
    """An `eos_token_id` field: an int, a list of ints (Llama 3, Qwen3 instruct), or null."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class PromptTokenizer:
    """Encodes prompts and decodes completions with a model directory's tokenizer.json.

    Generator and trainer share token ids end to end: completions are never re-tokenized.

    Special tokens, from the directory's own files:
    - bos: tokenizer_config.json `bos_token`. `encode_prompt` prepends it when there is one; Qwen
      directories set it to null, so their prompts start with the text itself.
    - eos: tokenizer_config.json `eos_token`, else generation_config.json `eos_token_id` (its
      first entry when a list), else config.json `eos_token_id`. `eos_ids` holds every id these
      files call an end of sequence, `eos_id` first (instruct models list several).
    - pad: tokenizer_config.json `pad_token`, else eos (padding is masked out of the loss anyway).
    """

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing. A model directory needs tokenizer.json beside config.json; "
                "re-create the tiny model (omit --model.path) or copy the tokenizer files in."
            )
        self._tokenizer = Tokenizer.from_file(str(path))
        self._config = _read_json(self.model_dir / "tokenizer_config.json")
        self.bos_id = self._special_id("bos_token")
        self.eos_ids = self._eos_ids()
        self.eos_id = self.eos_ids[0]
        pad_id = self._special_id("pad_token")
        self.pad_id: int = self.eos_id if pad_id is None else pad_id
        self._hf_tokenizer = None

    def _eos_ids(self) -> tuple[int, ...]:
        named = self._special_id("eos_token")
        generation = _read_json(self.model_dir / "generation_config.json").get("eos_token_id")
        model = _read_json(self.model_dir / "config.json").get("eos_token_id")
        ids = ([] if named is None else [named]) + _as_ids(generation) + _as_ids(model)
        if not ids:
            raise ValueError(
                f"{self.model_dir} names no end-of-sequence token: set eos_token in "
                "tokenizer_config.json or eos_token_id in generation_config.json."
            )
        return tuple(dict.fromkeys(ids))

    def _special_id(self, key: str) -> int | None:
        """Id of tokenizer_config.json's `key` token; None when the config leaves it unset."""
        content = _token_content(self._config.get(key))
        if content is None:
            return None
        token_id = self._tokenizer.token_to_id(content)
        if token_id is None:
            raise ValueError(
                f"{self.model_dir / 'tokenizer_config.json'} sets {key}={content!r}, which is not in "
                "tokenizer.json's vocabulary. Fix the tokenizer files of the model directory."
            )
        return token_id

    def encode_prompt(self, text: str) -> list[int]:
        """bos (when the tokenizer has one) + the text's tokens, no other special tokens."""
        prefix = [] if self.bos_id is None else [self.bos_id]
        return prefix + self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        """The text's tokens alone: no bos, no special tokens (a piece of a longer sequence)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def has_chat_template(self) -> bool:
        """tokenizer_config.json `chat_template` (transformers < 5) or chat_template.jinja/.json
        beside it (transformers 5 writes the template there)."""
        return bool(self._config.get("chat_template")) or any(
            (self.model_dir / name).is_file() for name in ("chat_template.jinja", "chat_template.json")
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of `messages` ([{"role": "user", "content": "..."}, ...], OpenAI-shaped: an
        assistant message may hold `tool_calls`, a tool message `tool_call_id`) rendered by the
        directory's chat template, ending with the assistant header when add_generation_prompt.
        `tools` (OpenAI function definitions) go to the template as transformers passes them; a
        template that does not read `tools` ignores them.

        The template writes its own special tokens (bos included), so nothing is prepended.
        """
        return list(
            self.hf_tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
            )
        )

    @property
    def hf_tokenizer(self):
        """The directory's `transformers` tokenizer, which renders its chat template (and which vLLM's
        tool parsers read); ValueError when the directory has no chat template."""
        if not self.has_chat_template:
            raise ValueError(
                f"{self.model_dir} has no chat template (no chat_template in tokenizer_config.json, "
                "no chat_template.jinja). Use plain-text prompts (encode_prompt), or point "
                "--model.path at a chat model's directory."
            )
        if self._hf_tokenizer is None:
            # transformers is imported only here: plain prompts never pay for its slow import.
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._hf_tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
