"""What the DeepSeek-style transformers families add to the dense block: multi-head
latent attention, grouped sigmoid routing after dense first layers, and what each later
family composes onto them (chapters 08, 10, 11).

DeepSeek-V3 (MLA, experts); DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention: a
lightning indexer per layer, GLM-5's "shared" layers reusing the last "full" one's
selection); Kimi Linear and Ling's Bailing hybrid (Kimi Delta Attention on
"linear_attention" layers, MLA on the others: without RoPE in Kimi, with a sigmoid gate
per head in Bailing). ``LATENT_FAMILIES`` maps each ``model_type`` to its
function, with the signature of
:attr:`companion.checkpoints.hf_families.Family.fields`: it reads ``hf_model.config``
and appends to ``problems`` what ``companion`` cannot express.
"""

from __future__ import annotations

from companion.checkpoints.hf_reader import ConfigReader
from companion.models.config_parts import (
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    SparseConfig,
)

__all__ = ["LATENT_FAMILIES"]

Fields = dict[str, object]


def deepseek_v3(c: ConfigReader, problems: list[str]) -> Fields:
    """DeepSeek-V3: MLA (RoPE interleaved unless ``rope_interleave`` is False) and
    grouped sigmoid routing with shared experts after ``first_k_dense_replace`` dense
    layers."""
    dense = c.integer("first_k_dense_replace")
    return {
        "moe": _sigmoid_grouped_moe(c, c.integer("n_routed_experts"), dense),
        "mla": _mla(c),
        # MLA: qk_nope_head_dim + qk_rope_head_dim (HF's head_dim is the RoPE part)
        "head_dim": None,
        "rope_layout": "interleaved" if c.flag("rope_interleave", True) else "half",
    }


# the eps transformers' MLA gives its latent RMSNorms, whatever rms_norm_eps is
_LATENT_EPS = 1e-6


def _mla(c: ConfigReader, **more: object) -> MLAConfig | None:
    """The MLA fields every DeepSeek-style config shares, and ``more``."""
    if c.number("rms_norm_eps") != _LATENT_EPS:
        more["latent_norm_eps"] = _LATENT_EPS
    return c.make(
        MLAConfig,
        kv_lora_rank=c.integer("kv_lora_rank"),
        q_lora_rank=c.integer("q_lora_rank", 0) or 0,
        qk_nope_head_dim=c.integer("qk_nope_head_dim"),
        qk_rope_head_dim=c.integer("qk_rope_head_dim"),
        v_head_dim=c.integer("v_head_dim"),
        **more,
    )


def _dense_first(c: ConfigReader, problems: list[str]) -> int:
    """How many first layers keep a dense FFN (``mlp_layer_types``: "dense" layers, then
    "sparse" ones; anything else is a problem)."""
    kinds = c.sequence("mlp_layer_types")
    dense = kinds.count("dense")
    if kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
        problems.append(f"mlp_layer_types={kinds!r} (only dense layers first)")
    return dense


def _sigmoid_grouped_moe(
    c: ConfigReader, n_experts: int, dense: int
) -> MoEConfig | None:
    """DeepSeek-V3's router and experts, as Kimi Linear and Bailing name them: sigmoid
    scores with a selection-only bias, group-limited top-k, scaled weights, always-on
    shared experts."""
    expert_d_ff = c.integer("moe_intermediate_size")
    return c.make(
        MoEConfig,
        n_experts=n_experts,
        experts_per_token=c.integer("num_experts_per_tok"),
        expert_d_ff=expert_d_ff,
        dense_layers=dense,
        shared_d_ff=expert_d_ff * c.integer("n_shared_experts"),
        router="sigmoid",
        router_norm_topk=c.flag("norm_topk_prob"),
        router_groups=c.integer("n_group"),
        router_topk_groups=c.integer("topk_group"),
        router_scale=float(c.number("routed_scaling_factor")),
        router_selection_bias=True,
    )


def _kda_hybrid(c: ConfigReader, problems: list[str], **kda: object) -> Fields:
    """Kimi Linear and Bailing: KDA on "linear_attention" layers, MLA on the others,
    DeepSeek-V3 experts after dense first layers, SiLU in the KDA convolution."""
    act = c.text("hidden_act")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (KDA's convolution uses silu)")
    types = c.sequence("layer_types", of="text")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        problems.append(f"layer_types entries {bad}")
    mla = _mla(c, output_gate=kda.pop("output_gate"))
    heads, width = kda.pop("heads"), c.integer("linear_head_dim")
    dense = _dense_first(c, problems)
    return {
        "moe": _sigmoid_grouped_moe(c, c.integer("num_local_experts"), dense),
        "mla": mla,
        "head_dim": None,  # MLA: qk_nope_head_dim + qk_rope_head_dim
        "linear": c.make(
            LinearAttentionConfig,
            key_heads=heads,
            value_heads=heads,
            key_dim=width,
            value_dim=width,
            kind="kda",
            **kda,
        ),
    }


def kimi_linear(c: ConfigReader, problems: list[str]) -> Fields:
    """Kimi Linear: low-rank KDA gates, MLA without RoPE (the "rope" channels of its
    shared key stay unrotated)."""
    return _kda_hybrid(
        c,
        problems,
        heads=c.integer("linear_num_heads"),
        conv_kernel=c.integer("linear_conv_kernel_dim"),
        kda_layout="kimi",
        output_gate=False,
    ) | {"position": "none"}


def bailing_hybrid(c: ConfigReader, problems: list[str]) -> Fields:
    """Ling's Bailing hybrid: full-rank KDA gates (bounded when ``kda_safe_gate``), MLA
    with interleaved RoPE and a sigmoid gate per head. Its ``head_dim`` is overwritten
    with the RoPE width: the KDA heads' width is ``linear_head_dim``."""
    bound = float(c.number("kda_lower_bound")) if c.flag("kda_safe_gate") else None
    return _kda_hybrid(
        c,
        problems,
        heads=c.integer("num_attention_heads"),
        conv_kernel=c.integer("short_conv_kernel_size"),
        kda_layout="bailing",
        kda_gate_lower_bound=bound,
        output_gate=True,
    ) | {"rope_layout": "interleaved"}


def _sparse_mla(c: ConfigReader, problems: list[str], indexer: SparseConfig) -> Fields:
    """DeepSeek-V3.2 and GLM-5: MLA (interleaved RoPE) whose every layer attends to the
    ``index_topk`` keys its lightning indexer picks, DeepSeek-V3 experts after dense
    first layers."""
    bad = sorted(set(c.sequence("layer_types", of="text")) - {"indexed_attention"})
    if bad:
        problems.append(f"layer_types entries {bad} (only 'indexed_attention')")
    dense = _dense_first(c, problems)
    return {
        "moe": _sigmoid_grouped_moe(c, c.integer("n_routed_experts"), dense),
        "mla": _mla(c, indexer=indexer),
        "head_dim": None,  # MLA: qk_nope_head_dim + qk_rope_head_dim
        "rope_layout": "interleaved",
    }


def _indexer(
    c: ConfigReader, rope_layout: str, layers: object = None
) -> SparseConfig | None:
    return c.make(
        SparseConfig,
        n_heads=c.integer("index_n_heads"),
        head_dim=c.integer("index_head_dim"),
        topk=c.integer("index_topk"),
        rope_layout=rope_layout,
        layers=None if layers is None else tuple(layers),
    )


def deepseek_v32(c: ConfigReader, problems: list[str]) -> Fields:
    """DeepSeek-V3.2: the indexer rotates its first channels in the half layout."""
    return _sparse_mla(c, problems, _indexer(c, "half"))


def glm_moe_dsa(c: ConfigReader, problems: list[str]) -> Fields:
    """GLM-5: interleaved RoPE in the indexer too; "shared" layers reuse the selection
    of the last "full" one (``indexer_types``)."""
    layers = c.sequence("indexer_types", of="text")
    if all(t == "full" for t in layers):
        layers = None
    return _sparse_mla(c, problems, _indexer(c, "interleaved", layers))


# model_type -> its fields (the FAMILIES entries of these architectures use them)
LATENT_FAMILIES = {
    "deepseek_v3": deepseek_v3,
    "deepseek_v32": deepseek_v32,
    "glm_moe_dsa": glm_moe_dsa,
    "kimi_linear": kimi_linear,
    "bailing_hybrid": bailing_hybrid,
}
