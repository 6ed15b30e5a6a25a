"""What DeepSeek-V4 (transformers' ``DeepseekV4ForCausalLM``) adds to the dense block
(chapters 08, 10, 12): compressed attention on every layer, hyper-connections, hash and
top-k routed experts.

:func:`deepseek_v4` has the signature of
:attr:`companion.checkpoints.hf_families.Family.fields`: it reads ``hf_model.config``
and appends to ``problems`` what ``companion`` cannot express. How transformers' fields
map:

* ``layer_types`` (``sliding_attention``, ``compressed_sparse_attention``,
  ``heavily_compressed_attention``) -> ``layer_types`` "sliding", "csa", "hca";
  ``compress_rates`` -> ``compression.csa_ratio`` / ``hca_ratio``; ``q_lora_rank``,
  ``o_groups``, ``o_lora_rank``, ``index_n_heads``, ``index_head_dim``, ``index_topk``
  -> the ``compression`` fields of those names; ``rope_parameters["compress"]``
  (``compress_rope_theta`` and its YaRN) -> ``compression.rope_theta`` /
  ``rope_scaling``, ``rope_parameters["main"]`` -> ``rope_theta`` / ``rope_scaling``.
* ``hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps`` -> ``residual.n_streams``,
  ``sinkhorn_iters``, ``eps``.
* ``mlp_layer_types`` (``hash_moe`` first, then ``moe``) -> ``moe.hash_layers``;
  ``scoring_func`` -> ``moe.router``; ``swiglu_limit`` -> ``moe.swiglu_limit``. As in
  transformers' model, every layer has one shared expert of ``moe_intermediate_size``
  whatever ``n_shared_experts`` says, and the top-k weights are always renormalised
  (``norm_topk_prob`` is not read).

``V4_NAMES`` renames the state-dict entries that differ from the other families.
"""

from __future__ import annotations

from companion.checkpoints.hf_reader import ConfigReader
from companion.layers.compressed_attention import HF_LAYER_TYPES
from companion.layers.router import SCORINGS
from companion.models.config_parts import MoEConfig
from companion.models.config_streams import (
    CompressedAttentionConfig,
    HyperConnectionConfig,
)
from companion.ops.rope import RopeScaling

__all__ = ["V4_NAMES", "deepseek_v4", "v4_layer_key"]

Fields = dict[str, object]

# transformers' names inside a decoder layer (by prefix) -> ours inside ``blocks.i``
V4_NAMES = {
    "attn_hc.": "residuals.attn.",
    "ffn_hc.": "residuals.ffn.",
    "mlp.gate.tid2eid": "ffn.router.table",
    "self_attn.compressor.indexer.scorer.weights_proj.": (
        "attn.compressor.indexer.weights_proj."
    ),
    "self_attn.": "attn.",
}


def v4_layer_key(rest: str) -> str | None:
    """Our name of a V4 layer tensor ``rest`` (after ``model.layers.i.``), or None if
    the shared rules name it (norms, experts, router weight and bias)."""
    for old, new in V4_NAMES.items():
        if rest.startswith(old):
            return new + rest[len(old) :]
    return None


def _compress_rope(
    c: ConfigReader, problems: list[str]
) -> tuple[float, RopeScaling | None]:
    """The CSA/HCA layers' RoPE base and scaling (``rope_parameters["compress"]``)."""
    rope = c.mapping("rope_parameters")
    rp = c.entry("rope_parameters", rope, "compress", "mapping")
    where = "rope_parameters['compress']"
    theta = float(c.entry(where, rp, "rope_theta", "number"))
    rp.pop("rope_theta", None)
    factor = rp.pop("partial_rotary_factor", None) or c.number("partial_rotary_factor")
    main = c.entry("rope_parameters", rope, "main", "mapping")
    main_factor = main.get("partial_rotary_factor", factor)
    if factor != main_factor:
        problems.append(
            f"partial_rotary_factor {factor!r} in rope_parameters['compress'] and "
            f"{main_factor!r} in ['main'] (only one for both)"
        )
    return theta, c.make(RopeScaling.from_mapping, rp)


def _hash_layers(c: ConfigReader, problems: list[str]) -> int:
    """How many first layers are hash-routed (``mlp_layer_types``: "hash_moe" first,
    then "moe"; anything else is a problem)."""
    kinds = c.sequence("mlp_layer_types")
    n = kinds.count("hash_moe")
    if kinds != ["hash_moe"] * n + ["moe"] * (len(kinds) - n):
        problems.append(f"mlp_layer_types={kinds!r} (only hash_moe layers first)")
    return n


def deepseek_v4(c: ConfigReader, problems: list[str]) -> Fields:
    """DeepSeek-V4: compressed attention (sliding, CSA, HCA) with sinks and one
    key/value head, hyper-connections, √softplus routing with hash-routed first layers,
    clamped SwiGLU experts beside one shared expert."""
    act, scoring = c.text("hidden_act"), c.text("scoring_func")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (the experts are SwiGLU)")
    types = c.sequence("layer_types", of="text")
    bad = sorted(set(types) - set(HF_LAYER_TYPES))
    if bad:
        problems.append(f"layer_types entries {bad}")
    if scoring not in SCORINGS:
        problems.append(f"scoring_func={scoring!r} (supported: {SCORINGS})")
    rates = c.mapping("compress_rates")
    theta, scaling = _compress_rope(c, problems)
    expert_d_ff = c.integer("moe_intermediate_size")
    return {
        "layer_types": tuple(HF_LAYER_TYPES.get(t, "sliding") for t in types),
        "sliding_window": c.integer("sliding_window"),
        "n_kv_heads": None,  # derived: one shared key/value head
        "head_dim": c.integer("head_dim"),
        "partial_rotary_factor": float(c.number("partial_rotary_factor")),
        "attn_sinks": True,
        "d_ff": expert_d_ff,  # no dense FFN: every layer is MoE
        "compression": c.make(
            CompressedAttentionConfig,
            q_lora_rank=c.integer("q_lora_rank"),
            o_groups=c.integer("o_groups"),
            o_lora_rank=c.integer("o_lora_rank"),
            index_n_heads=c.integer("index_n_heads"),
            index_head_dim=c.integer("index_head_dim"),
            index_topk=c.integer("index_topk"),
            csa_ratio=rates.get("compressed_sparse_attention", 4),
            hca_ratio=rates.get("heavily_compressed_attention", 128),
            rope_theta=theta,
            rope_scaling=scaling,
        ),
        "residual": c.make(
            HyperConnectionConfig,
            n_streams=c.integer("hc_mult"),
            sinkhorn_iters=c.integer("hc_sinkhorn_iters"),
            eps=float(c.number("hc_eps")),
        ),
        "moe": c.make(
            MoEConfig,
            n_experts=c.integer("n_routed_experts"),
            experts_per_token=c.integer("num_experts_per_tok"),
            expert_d_ff=expert_d_ff,
            shared_d_ff=expert_d_ff,
            router=scoring if scoring in SCORINGS else "softmax",
            router_norm_topk=True,
            router_scale=float(c.number("routed_scaling_factor")),
            router_selection_bias=True,
            hash_layers=_hash_layers(c, problems),
            swiglu_limit=float(c.number("swiglu_limit")),
        ),
    }
