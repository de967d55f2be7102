"""The character-level tokenizer of the tiny demo models, stored as a standard tokenizer.json.

It is a Hugging Face `tokenizers` BPE model with no merges (so every character is one token), which
`transformers.AutoTokenizer` and `tokenizers.Tokenizer.from_file` both load offline.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ=+-*/ "
# Padded so the vocabulary splits evenly across tensor-parallel ranks (TP shards the embedding).
VOCAB_SIZE = 64


def build_char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def save_char_tokenizer(model_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json so AutoTokenizer loads the directory."""
    build_char_tokenizer().save(str(model_dir / "tokenizer.json"))
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


class PromptTokenizer:
    """Encodes prompts and decodes completions with a model directory's tokenizer.json.

    Generator and trainer share token ids end to end: completions are never re-tokenized.
    """

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing. A model directory needs tokenizer.json beside config.json; "
                "re-create the tiny model (omit --model.path) or copy the tokenizer files in."
            )
        self._tokenizer = Tokenizer.from_file(str(path))
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        self.bos_id = self._tokenizer.token_to_id(config["bos_token"])
        self.eos_id = self._tokenizer.token_to_id(config["eos_token"])
        self.pad_id = self._tokenizer.token_to_id(config["pad_token"])

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
