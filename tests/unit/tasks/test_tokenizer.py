"""PromptTokenizer on the char tokenizer as the tiny models save it, and on a directory laid out like
a real chat model's (Qwen-style: no bos, no pad, eos ids in generation_config.json, a chat template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_rl.tasks.synthetic import TASKS, make_prompt
from forge_rl.tasks.tokenizer import (
    BOS,
    EOS,
    PAD,
    VOCAB_SIZE,
    PromptTokenizer,
    build_char_tokenizer,
    save_char_tokenizer,
)

TOKEN_ID = build_char_tokenizer().token_to_id
# A miniature of the ChatML-like templates of Qwen/SmolLM: role header, content, end-of-turn token.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<bos>' + m['role'][0] | upper + '=' + m['content'] + '<eos>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<bos>A=' }}{% endif %}"
)


@pytest.fixture
def char_dir(tmp_path) -> Path:
    save_char_tokenizer(tmp_path)
    return tmp_path


@pytest.fixture
def chat_dir(tmp_path) -> Path:
    """bos_token null and no pad_token (as in Qwen3's tokenizer_config.json), eos only in
    generation_config.json (two ids, as instruct models list), and a chat template."""
    save_char_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(bos_token=None, chat_template=CHAT_TEMPLATE)
    for key in ("pad_token", "eos_token"):
        config.pop(key)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    eos_ids = [TOKEN_ID(EOS), TOKEN_ID("=")]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return tmp_path


def test_char_tokenizer_prepends_bos_and_names_its_special_tokens(char_dir):
    tokenizer = PromptTokenizer(char_dir)
    ids = tokenizer.encode_prompt("M37=")
    assert ids == [TOKEN_ID(BOS), TOKEN_ID("M"), TOKEN_ID("3"), TOKEN_ID("7"), TOKEN_ID("=")]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (TOKEN_ID(BOS), TOKEN_ID(EOS), TOKEN_ID(PAD))
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == "M37="


def test_without_bos_nothing_is_prepended_and_eos_and_pad_fall_back(chat_dir):
    tokenizer = PromptTokenizer(chat_dir)
    assert tokenizer.bos_id is None
    assert tokenizer.encode_prompt("M37=") == [TOKEN_ID("M"), TOKEN_ID("3"), TOKEN_ID("7"), TOKEN_ID("=")]
    assert tokenizer.eos_id == tokenizer.pad_id == TOKEN_ID(EOS)
    assert tokenizer.eos_ids == (TOKEN_ID(EOS), TOKEN_ID("="))


def test_encode_chat_renders_the_directory_template(chat_dir):
    ids = PromptTokenizer(chat_dir).encode_chat([{"role": "user", "content": "M37="}])
    expected = [BOS, "U", "=", "M", "3", "7", "=", EOS, BOS, "A", "="]
    assert ids == [TOKEN_ID(token) for token in expected]


def test_encode_chat_reads_a_transformers_5_chat_template_file(chat_dir, tmp_path_factory):
    """transformers 5 saves the template as chat_template.jinja, not in tokenizer_config.json."""
    from transformers import AutoTokenizer

    saved = tmp_path_factory.mktemp("saved")
    AutoTokenizer.from_pretrained(chat_dir).save_pretrained(saved)
    (saved / "generation_config.json").write_text((chat_dir / "generation_config.json").read_text())
    assert (saved / "chat_template.jinja").is_file()
    messages = [{"role": "user", "content": "1+2="}]
    assert PromptTokenizer(saved).encode_chat(messages) == PromptTokenizer(chat_dir).encode_chat(messages)


def test_encode_chat_without_a_template_says_so(char_dir):
    with pytest.raises(ValueError, match="has no chat template"):
        PromptTokenizer(char_dir).encode_chat([{"role": "user", "content": "M37="}])


def test_special_token_missing_from_the_vocabulary_is_named(char_dir):
    config = json.loads((char_dir / "tokenizer_config.json").read_text())
    (char_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"eos_token='<\|im_end\|>', which is not in tokenizer.json"):
        PromptTokenizer(char_dir)


def test_the_tiny_models_vocabulary_is_the_tokenizers_with_no_unused_rows(char_dir):
    """Every row of the tiny model's embedding is a token (no padding rows taking probability
    mass from early samples), and every task prompt and answer encodes without <unk>."""
    assert VOCAB_SIZE == build_char_tokenizer().get_vocab_size()
    tokenizer = PromptTokenizer(char_dir)
    unk = TOKEN_ID("<unk>")
    for task in TASKS:
        for index in range(50):
            prompt = make_prompt(task, 0, index)
            assert unk not in tokenizer.encode_prompt(prompt.text + prompt.answer)
