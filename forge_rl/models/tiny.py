"""Create a tiny Llama-architecture model (or, with experts, a Qwen3-MoE) from scratch as a standard
HF model directory.

The directory holds config.json, model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json: what vLLM, `transformers` and the TorchTitan trainer all read. Nothing is
downloaded. head_dim must be >= 32 because vLLM's CPU attention backend rejects 16.

A model is built once per (config, alphabet, transformers version) and kept in a cache
(`tiny_model_cache_dir`); later runs copy it. Building it means importing `transformers`' modeling
code, seconds of every run's start-up on a CPU, on the controller's critical path
before any process is spawned; the copy is the same bytes (the seed fixes the weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from forge_rl.tasks import tokenizer as char_tokenizer


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; head_dim = hidden_size / num_heads must be >= 32 (vLLM CPU attention)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 128
    """Longest sequence (prompt + completion) the model serves."""
    seed: int = 0
    """Initialization seed: the same seed gives the same weights."""
    num_experts: int = 0
    """0: a dense Llama. More: a Qwen3-MoE (Qwen3MoeForCausalLM) whose every layer routes each token
    to `num_experts_per_tok` of this many experts (`forge_rl.models.moe`, Keep Routing)."""
    num_experts_per_tok: int = 2
    """Experts per token (top-k) of the MoE model."""
    moe_intermediate_size: int = 64
    """Width of each expert's MLP."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.tiny.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.tiny.num_heads ({self.num_heads})."
            )
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"model.tiny head_dim = hidden_size / num_heads = {self.hidden_size // self.num_heads} "
                "is below 32, which vLLM's CPU attention rejects. Raise --model.tiny.hidden-size "
                "or lower --model.tiny.num-heads."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.tiny.num_heads ({self.num_heads}) must be divisible by "
                f"model.tiny.num_kv_heads ({self.num_kv_heads})."
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.tiny.num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..model.tiny.num_experts "
                f"({self.num_experts}). Set --model.tiny.num-experts-per-tok."
            )


CACHE_ENV = "FORGE_RL_CACHE_DIR"
_CACHE_FORMAT = 1
"""Part of every cache key: raise it when what `_build_tiny_model` writes changes."""


def tiny_model_cache_dir() -> Path:
    """Where built tiny models are kept: $FORGE_RL_CACHE_DIR/tiny-models, else
    $XDG_CACHE_HOME/forge_rl/tiny-models (~/.cache/forge_rl/tiny-models). Safe to delete."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "tiny-models"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forge_rl" / "tiny-models"


def _cache_key(config: TinyModelConfig, alphabet: str) -> str:
    """What the built files depend on: the config, the alphabet, the transformers that wrote them."""
    identity = {
        "format": _CACHE_FORMAT,
        "config": dataclasses.asdict(config),
        "alphabet": alphabet,
        "transformers": version("transformers"),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def create_tiny_model(config: TinyModelConfig, model_dir: Path, alphabet: str = char_tokenizer.ALPHABET) -> Path:
    """Write a randomly initialized tiny Llama (Qwen3-MoE with `num_experts`) with the character
    tokenizer of `alphabet` into `model_dir` (one embedding row per special token and character),
    from the cache when it holds the same model (module docstring)."""
    model_dir = Path(model_dir)
    cached = tiny_model_cache_dir() / _cache_key(config, alphabet)
    if not cached.is_dir():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(prefix=".building-", dir=cached.parent))
        except OSError:  # a read-only or full cache: build in place, as without one
            return _build_tiny_model(config, model_dir, alphabet)
        try:
            _build_tiny_model(config, building, alphabet)
            os.rename(building, cached)  # atomic: a reader sees the whole directory or none
        except OSError:
            pass  # another process put it there first (same bytes), or the cache is full
        finally:
            shutil.rmtree(building, ignore_errors=True)
        if not cached.is_dir():
            return _build_tiny_model(config, model_dir, alphabet)
    shutil.copytree(cached, model_dir, dirs_exist_ok=True)
    return model_dir


def _build_tiny_model(config: TinyModelConfig, model_dir: Path, alphabet: str) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer.build_char_tokenizer(alphabet)
    moe = dict(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=True,  # Qwen3-30B-A3B's setting
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    config_cls, model_cls = (
        (Qwen3MoeConfig, Qwen3MoeForCausalLM) if config.num_experts else (LlamaConfig, LlamaForCausalLM)
    )
    hf_config = config_cls(
        **(moe if config.num_experts else {}),
        vocab_size=len(char_tokenizer.SPECIAL_TOKENS) + len(alphabet),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(char_tokenizer.BOS),
        eos_token_id=tokenizer.token_to_id(char_tokenizer.EOS),
        pad_token_id=tokenizer.token_to_id(char_tokenizer.PAD),
        torch_dtype="float32",
    )
    # The caller's random state is left as it was, as on a cache hit, which builds nothing.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = model_cls(hf_config)
    model.save_pretrained(model_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id, pad_token_id=hf_config.pad_token_id
    ).save_pretrained(model_dir)
    char_tokenizer.save_char_tokenizer(model_dir, alphabet)
    return model_dir
