"""The dials of chapter 13's static calculator (:mod:`companion.analysis.calculator_page`):
which config field each one sets, its label, its choices, and what it shows for a
model without the mechanism.

A dial is named by the field it sets (``d_model``), or for a field of a group by the
group's prefix and the field (``linear_key_heads`` sets ``linear.key_heads``,
``compression_o_groups`` sets ``compression.o_groups``); ``DIAL_FIELDS`` gives the
config's own name, as its errors spell it. A pattern dial has one letter per layer (layers:
``F`` full, ``S`` sliding, ``L`` linear, ``C`` CSA, ``H`` HCA; DSA indexer: ``F`` its
own, ``S`` shared), repeated to the depth.
"""

from __future__ import annotations

from companion.layers.kimi_delta import KDA_LAYOUTS
from companion.layers.moe import EXPERT_KINDS
from companion.models.config import (
    CHOICES,
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
)
from companion.models.config_parts import LINEAR_KINDS, SparseConfig
from companion.models.config_streams import (
    CompressedAttentionConfig,
    HyperConnectionConfig,
)

__all__ = [
    "ABSENT_VALUES",
    "DIAL_CHOICES",
    "DIAL_FIELDS",
    "DIALS",
    "FLOAT_DIALS",
    "GROUP_DIALS",
    "PATTERNS",
    "GROUP_SWITCHES",
    "USAGE",
]

# (dial, label) per fieldset, in the order the panel shows them
DIALS: dict[str, tuple[tuple[str, str], ...]] = {
    "model": (
        ("vocab_size", "vocabulary V"),
        ("d_model", "width d"),
        ("n_layers", "layers L"),
        ("layer_types", "layer pattern (F/S/L/C/H)"),
        ("max_seq_len", "max positions"),
        ("position", "positions"),
        ("norm", "norm"),
        ("norm_placement", "norm placement"),
        ("bias", "biases"),
        ("tie_embeddings", "tied head"),
    ),
    "attention": (
        ("n_heads", "query heads H"),
        ("n_kv_heads", "KV heads H_kv"),
        ("head_dim", "head width D"),
        ("sliding_window", "window w (0: none)"),
        ("partial_rotary_factor", "rotated fraction"),
        ("qkv_bias", "q/k/v biases"),
        ("qk_norm", "QK-norm"),
        ("attn_output_gate", "output gate"),
        ("attn_sinks", "sinks"),
    ),
    "feed-forward and experts": (
        ("ffn", "FFN form"),
        ("d_ff", "FFN width F"),
        ("n_experts", "experts E (0: none)"),
        ("experts_per_token", "top-k"),
        ("expert_d_ff", "expert width F_e"),
        ("shared_d_ff", "shared width F_s"),
        ("shared_expert_gate", "shared gate"),
        ("dense_layers", "dense first layers"),
        ("hash_layers", "hash-routed layers"),
        ("expert_kind", "expert form"),
        ("swiglu_limit", "SwiGLU clamp (0: none)"),
        ("router_bias", "router bias"),
        ("router_selection_bias", "selection bias"),
    ),
    "latent attention (MLA) and its sparse indexer (DSA)": (
        ("kv_lora_rank", "KV latent r (0: none)"),
        ("q_lora_rank", "query latent r_q"),
        ("qk_nope_head_dim", "D_nope"),
        ("qk_rope_head_dim", "RoPE key R"),
        ("v_head_dim", "value width D_v"),
        ("mla_output_gate", "head gate"),
        ("indexer_topk", "top-k K_I (0: dense)"),
        ("indexer_n_heads", "indexer heads H_I"),
        ("indexer_head_dim", "indexer width D_I"),
        ("indexer_layers", "indexer pattern (F/S)"),
    ),
    "linear attention (Gated DeltaNet, KDA)": (
        ("linear_kind", "recurrence"),
        ("linear_key_heads", "key heads H_k"),
        ("linear_value_heads", "value heads H_v"),
        ("linear_key_dim", "key width D_k"),
        ("linear_value_dim", "value width D_v"),
        ("linear_conv_kernel", "conv width K"),
        ("kda_layout", "KDA gate layout"),
    ),
    "compressed attention (CSA/HCA) and hyper-connections (DeepSeek-V4)": (
        ("compression_q_lora_rank", "query latent C_q (0: none)"),
        ("compression_o_groups", "output groups G"),
        ("compression_o_lora_rank", "output rank r_o"),
        ("compression_csa_ratio", "CSA pooling m"),
        ("compression_hca_ratio", "HCA pooling m"),
        ("compression_index_n_heads", "CSA indexer heads H_I"),
        ("compression_index_head_dim", "CSA indexer width c"),
        ("compression_index_topk", "CSA top-k K_I"),
        ("residual_n_streams", "streams n (0: plain residual)"),
    ),
}
# the dials of a mechanism group: group -> (its class, {dial: field}); a model without
# the group shows its ABSENT_VALUES entry, or 0 (False for a gate or bias)
GROUP_DIALS: dict[str, tuple[type, dict[str, str]]] = {
    "moe": (
        MoEConfig,
        {n: n for n in ("n_experts", "experts_per_token", "expert_d_ff", "shared_d_ff")}
        | {n: n for n in ("shared_expert_gate", "dense_layers", "expert_kind")}
        | {n: n for n in ("router_bias", "router_selection_bias", "hash_layers")}
        | {"swiglu_limit": "swiglu_limit"},
    ),
    "mla": (
        MLAConfig,
        {n: n for n in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim")}
        | {n: n for n in ("qk_rope_head_dim", "v_head_dim")}
        | {"mla_output_gate": "output_gate"},
    ),
    "mla.indexer": (
        SparseConfig,
        {f"indexer_{name}": name for name in ("n_heads", "head_dim", "topk", "layers")},
    ),
    "linear": (
        LinearAttentionConfig,
        {f"linear_{n}": n for n in ("kind", "key_heads", "value_heads", "key_dim")}
        | {f"linear_{n}": n for n in ("value_dim", "conv_kernel")}
        | {"kda_layout": "kda_layout"},
    ),
    "compression": (
        CompressedAttentionConfig,
        {
            f"compression_{n}": n
            for n in ("q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads")
        }
        | {
            f"compression_{n}": n
            for n in ("index_head_dim", "index_topk", "csa_ratio", "hca_ratio")
        },
    ),
    "residual": (HyperConnectionConfig, {"residual_n_streams": "n_streams"}),
}
# the config's name for each group dial ("moe.n_experts"), as errors name it
DIAL_FIELDS = {
    d: f"{g}.{f}" for g, (_, names) in GROUP_DIALS.items() for d, f in names.items()
}
# the dial that switches a group on (its "absent" value, 0, leaves the group None);
# linear layers in the pattern switch on "linear"
GROUP_SWITCHES = {
    "moe": "n_experts",
    "mla": "kv_lora_rank",
    "mla.indexer": "indexer_topk",
}
GROUP_SWITCHES |= {"compression": "compression_q_lora_rank"}
GROUP_SWITCHES |= {"residual": "residual_n_streams"}
# dials that hold a float (0 for swiglu_limit: None, no clamp)
FLOAT_DIALS = ("partial_rotary_factor", "swiglu_limit")
# dials with fixed choices beyond the config's own CHOICES
DIAL_CHOICES = CHOICES | {"expert_kind": EXPERT_KINDS, "kda_layout": KDA_LAYOUTS}
DIAL_CHOICES |= {"linear_kind": LINEAR_KINDS}
# pattern dials: letter -> value, repeated to the depth
PATTERNS: dict[str, dict[str, str]] = {
    "layer_types": {"F": "full", "S": "sliding", "L": "linear", "C": "csa", "H": "hca"},
    "indexer_layers": {"F": "full", "S": "shared"},
}
# what a dial shows for a model without its group, where 0 would not do
ABSENT_VALUES: dict[str, object] = {
    "expert_kind": "glu",
    "linear_kind": "gated_deltanet",
}
ABSENT_VALUES |= {
    "kda_layout": "kimi",
    "linear_conv_kernel": 4,
    "indexer_layers": ("full",),
}
ABSENT_VALUES |= {"compression_csa_ratio": 4, "compression_hca_ratio": 128}
# the calculator's own arguments: name -> (label, default)
USAGE: dict[str, tuple[str, int]] = {
    "context": ("sequence length s", 8192),
    "batch": ("batch", 1),
    "dtype_bytes": ("bytes per cached number", 2),
    "scale_bytes": ("bytes of scale per cached row", 0),
    "state_dtype_bytes": ("bytes per state number", 4),
}
