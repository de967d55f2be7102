"""Which Hugging Face checkpoints the TorchTitan trainer can train, and how each family is built.

`FAMILIES` has one row per TorchTitan model family (Qwen3-MoE is the qwen3 row with MoE blocks,
`forge_rl.models.moe`): the config.json `architectures` it serves,
the TorchTitan classes that rebuild it (model, block, RoPE flavour), the state-dict adapter that
renames HF weights, the parallelize function, and the config.json values it can represent.
Adding a dense family that TorchTitan already ships is one more row, not another branch.

`family_for` checks a config.json against the table and only reads JSON, so the controller can
call it before any trainer starts; `build_model_config` imports TorchTitan (a slow import), so it
runs in the trainer processes only.

Example: Qwen3-0.6B's config.json (architectures ["Qwen3ForCausalLM"], head_dim 128,
tie_word_embeddings true, rope_theta 1e6) maps to a `Qwen3Model.Config` with 28 dense
`Qwen3TransformerBlock`s, q/k RMSNorms of width 128, `CosSinRoPE` and tied embeddings.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldRule:
    """A config.json field whose value the family must reject unless `accepts` it."""

    field: str
    """Key in config.json."""
    default: Any
    """Value transformers assumes when the key is absent."""
    accepts: Callable[[Any], bool]
    """True for values the TorchTitan model represents exactly."""
    supported: str
    """What is supported, for the error message (e.g. "'silu'")."""


def _equals(field: str, value: Any) -> FieldRule:
    return FieldRule(field, value, lambda v: v == value, repr(value))


def _off(field: str, what: str) -> FieldRule:
    """A feature switched on by a truthy value (a count, a size, a flag)."""
    return FieldRule(field, None, lambda v: not v, f"unset/0/false ({what} is not supported)")


def _full_attention_only(field: str = "layer_types") -> FieldRule:
    return FieldRule(
        field,
        None,
        lambda v: v is None or all(t == "full_attention" for t in v),
        "every layer 'full_attention' (sliding-window layers are not supported)",
    )


@dataclass(frozen=True)
class ModelFamily:
    """One TorchTitan dense decoder family and the HF checkpoints it can rebuild exactly.

    Class paths are "module:attribute" strings resolved on use, so reading this table imports
    nothing from TorchTitan.
    """

    name: str
    """TorchTitan's name for the family (its package under torchtitan.models)."""
    architectures: tuple[str, ...]
    """config.json `architectures` entries served by this family."""
    model_class: str
    """The TorchTitan Decoder subclass; its nested Config is built from config.json."""
    block_class: str
    """The TorchTitan TransformerBlock subclass of every layer."""
    rope_class: str
    """RoPE flavour whose layout the adapter assumes: ComplexRoPE (interleaved pairs, which the
    llama3 adapter gets by permuting q/k rows) or CosSinRoPE (HF's rotate-half, no permutation)."""
    qk_norm: bool
    """Whether each attention layer RMS-normalizes q and k per head before RoPE (Qwen3)."""
    adapter_class: str
    """TorchTitan StateDictAdapter converting between HF and TorchTitan weight names."""
    parallelize_fn: str
    """TorchTitan's TP + FSDP2 recipe for the family."""
    rope_types: tuple[str, ...]
    """Supported `rope_parameters.rope_type` values."""
    field_rules: tuple[FieldRule, ...]
    """config.json fields the TorchTitan model cannot represent unless they hold these values."""
    moe: bool = False
    """Every layer's MLP is a mixture of experts (`forge_rl.models.moe` builds it) instead of
    one SwiGLU feed-forward."""

    def describe(self) -> str:
        rules = ", ".join(f"{rule.field}={rule.supported}" for rule in self.field_rules)
        kind = "mixture of experts" if self.moe else "dense"
        return (
            f"{'/'.join(self.architectures)} (TorchTitan {self.name}; {kind}; rope_type in "
            f"{list(self.rope_types)}; {rules})"
        )


_COMMON_RULES = (
    # TorchTitan's FeedForward is SwiGLU: w2(silu(w1 x) * w3 x).
    _equals("hidden_act", "silu"),
    # Neither adapter maps a bias key, and TorchTitan's GQA config builds bias-free projections.
    _equals("attention_bias", False),
)

LLAMA3 = ModelFamily(
    name="llama3",
    architectures=("LlamaForCausalLM",),
    model_class="torchtitan.models.llama3.model:Llama3Model",
    block_class="torchtitan.models.llama3.model:Llama3TransformerBlock",
    rope_class="torchtitan.models.common.rope:ComplexRoPE",
    qk_norm=False,
    adapter_class="torchtitan.models.llama3.state_dict_adapter:Llama3StateDictAdapter",
    parallelize_fn="torchtitan.models.llama3.parallelize:parallelize_llama",
    rope_types=("default", "llama3"),
    field_rules=(*_COMMON_RULES, _equals("mlp_bias", False)),
)

QWEN3 = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_class="torchtitan.models.qwen3.model:Qwen3Model",
    block_class="torchtitan.models.qwen3.model:Qwen3TransformerBlock",
    rope_class="torchtitan.models.common.rope:CosSinRoPE",
    qk_norm=True,
    adapter_class="torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
    parallelize_fn="torchtitan.models.qwen3.parallelize:parallelize_qwen3",
    # CosSinRoPE's yarn omits HF's attention scaling factor, so only unscaled RoPE is exact.
    rope_types=("default",),
    field_rules=(
        *_COMMON_RULES,
        _off("use_sliding_window", "sliding-window attention"),
        _full_attention_only(),
        # Qwen3-MoE checkpoints say Qwen3MoeForCausalLM; these catch a MoE config relabelled dense
        # (transformers 5 writes the expert count as num_local_experts).
        _off("num_experts", "mixture of experts"),
        _off("num_local_experts", "mixture of experts"),
        _off("moe_intermediate_size", "mixture of experts"),
    ),
)

QWEN3_MOE = dataclasses.replace(
    QWEN3,
    # The same TorchTitan Qwen3Model: its blocks take a MoE config in place of the feed-forward,
    # and the qwen3 adapter maps HF's per-expert weights (mlp.experts.{e}.gate_proj, ...) to the
    # stacked w1_EFD/w2_EDF/w3_EFD and mlp.gate to the router.
    architectures=("Qwen3MoeForCausalLM",),
    moe=True,
    field_rules=(
        *_COMMON_RULES,
        _off("use_sliding_window", "sliding-window attention"),
        _full_attention_only(),
        # Every layer sparse: decoder_sparse_step 1 and no dense (mlp_only) layers.
        _equals("decoder_sparse_step", 1),
        FieldRule("mlp_only_layers", None, lambda v: not v, "[] (dense layers between MoE layers are not supported)"),
        # Qwen2-MoE's shared expert has no Qwen3-MoE counterpart in TorchTitan's adapter.
        _off("shared_expert_intermediate_size", "a shared expert"),
    ),
)

FAMILIES: tuple[ModelFamily, ...] = (LLAMA3, QWEN3, QWEN3_MOE)


def supported_summary() -> str:
    return "; ".join(family.describe() for family in FAMILIES)


def rope_type(hf_config: dict) -> str:
    """transformers 5 writes `rope_parameters`; older configs `rope_scaling` (null = default)."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default"))


def family_for(hf_config: dict, source: str = "config.json") -> ModelFamily:
    """The family that rebuilds `hf_config` exactly; ValueError naming what is supported otherwise.

    `source` names the file in the message (its path, normally).
    """
    architectures = hf_config.get("architectures") or []
    family = next((f for f in FAMILIES if set(architectures) & set(f.architectures)), None)
    if family is None:
        raise ValueError(
            f"{source} describes architectures {architectures} (model_type "
            f"{hf_config.get('model_type')!r}); the TorchTitan trainer supports: {supported_summary()}. "
            "Point --model.path at a checkpoint of a supported architecture."
        )
    problems = [
        f"{rule.field}={hf_config.get(rule.field, rule.default)!r} (supported: {rule.supported})"
        for rule in family.field_rules
        if not rule.accepts(hf_config.get(rule.field, rule.default))
    ]
    if rope_type(hf_config) not in family.rope_types:
        problems.append(f"rope_type={rope_type(hf_config)!r} (supported: {list(family.rope_types)})")
    if problems:
        raise ValueError(
            f"{source} is a {family.name} checkpoint with {'; '.join(problems)}, which the TorchTitan "
            f"{family.name} model cannot represent. The trainer supports: {supported_summary()}."
        )
    return family


def resolve(path: str) -> Any:
    """The object at "module:attribute" (imports the module)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _rope_config(family: ModelFamily, hf_config: dict, head_dim: int):
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    common = dict(dim=head_dim, max_seq_len=hf_config["max_position_embeddings"], theta=theta)
    rope_cls = resolve(family.rope_class)
    if rope_type(hf_config) == "llama3":
        return rope_cls.Config(
            **common,
            scaling="llama",
            scaling_factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    return rope_cls.Config(**common)


def build_model_config(family: ModelFamily, hf_config: dict, inner_attention):
    """The family's TorchTitan model Config with exactly the dimensions of `hf_config`.

    `inner_attention` is the attention kernel's config (titan.py picks it). Parameter initializers
    are left empty: every weight is then loaded from the checkpoint.
    """
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    from forge_rl.models.moe import moe_config

    dim, vocab, eps = hf_config["hidden_size"], hf_config["vocab_size"], hf_config["rms_norm_eps"]
    n_heads = hf_config["num_attention_heads"]
    # Qwen3 decouples head_dim from hidden_size / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128).
    head_dim = hf_config.get("head_dim") or dim // n_heads
    rope = _rope_config(family, hf_config, head_dim)
    block_cls = resolve(family.block_class)

    def block():
        return block_cls.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=hf_config.get("num_key_value_heads"),
                head_dim=head_dim,
                fuse_qkv=True,
                # A copy per layer: TorchTitan's sharding setup writes into each layer's config.
                inner_attention=dataclasses.replace(inner_attention),
                rope=rope,
                # HF Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps) on q and k, before RoPE.
                qk_norm=RMSNorm.Config(normalized_shape=head_dim, eps=eps) if family.qk_norm else None,
                wqkv_param_init={},
                wo_param_init={},
            ),
            # make_ffn_config takes the final width (compute_ffn_hidden_dim would re-derive it from
            # dim, multiple_of and ffn_dim_multiplier), so intermediate_size is used as is.
            feed_forward=None
            if family.moe
            else make_ffn_config(
                dim=dim, hidden_dim=hf_config["intermediate_size"], w1_param_init={}, w2w3_param_init={}
            ),
            moe=moe_config(hf_config) if family.moe else None,
        )

    return resolve(family.model_class).Config(
        dim=dim,
        vocab_size=vocab,
        # Decoder.__init__ shares one Parameter between tok_embeddings and lm_head; both adapters
        # then read lm_head from embed_tokens and leave it out of the HF export.
        enable_weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=[block() for _ in range(hf_config["num_hidden_layers"])],
    )
