"""The build-a-model calculator: parameters, KV cache and FLOPs from a config (chapter
13).

Shape legend: V vocabulary, d model width, L layers, H query heads, H_kv key/value
heads, D head width, F dense FFN width, E routed experts, k experts per token, F_e
expert width, F_s shared-expert width; MLA: r latent width, r_q query latent width, R
decoupled RoPE width, D_nope / D_v per-head key and value widths; Gated DeltaNet: H_k /
H_v heads, D_k / D_v head widths, K convolution width (Kimi Delta Attention: H heads of
width D, keys and values alike); DSA: H_I indexer heads of width D_I, top-k K_I; w
sliding window; s context (keys a token attends to).

Everything here is arithmetic on a :class:`~companion.models.config.ModelConfig`: no
tensor is built. :func:`count_params` counts exactly what
:class:`companion.models.decoder.DecoderLM` holds (tests check it against the model
built on the meta device), which is also what the released checkpoints hold, so the
published parameter counts come out to the integer.

Conventions, each a choice the published figures force or the chapter argues for:

- **Active parameters** are those one token's forward pass touches: everything except
  the routed experts it was not sent to. The input embedding counts as active in full,
  as the DeepSeek-V3 and Qwen3 reports count it (37.6B, 22.2B). OpenAI's gpt-oss card
  leaves the embedding table out (a token reads one row of it); that figure (5.13B) is
  :attr:`ParamCount.active_without_embeddings`.
- **DeepSeek-V3's selection bias** (one number per routed expert, moved by a balancing
  rule, not by gradients) is stored in the checkpoint and counted in ``total``; it is
  part of ``ParamCount.frozen``, which ``trainable`` leaves out.
- **Cache** sizes count what decoding must keep per sequence: K and V of every position
  for full attention, of the last w positions for sliding layers, one latent and one
  RoPE key per position for MLA (the absorbed form needs nothing else), and a fixed
  state for Gated DeltaNet layers (the H_v·D_k·D_v delta-rule memory, kept in fp32 by
  default as released hybrids do, plus the convolution's last K − 1 inputs in the cache
  dtype). A KDA layer keeps the same kind of state (H·D·D, conv over 3·H·D channels).
  A DSA layer with its own indexer also caches one D_I-wide indexer key per position
  (a "shared" indexer layer caches none). A DeepSeek-V4 layer keeps its window ring
  (min(tokens, w) keys of D), and on CSA/HCA layers tokens // m pooled entries, CSA's
  index keys (c each) and the compressors' source rows of the open block; per token,
  the entries are amortised (rounded up to a whole byte). A quantised cache's scales
  (``scale_bytes``, one per row held in the cache dtype) are priced as
  :mod:`companion.analysis.cache_size` says.
- **DeepSeek-V4**: hyper-connections are the ``residual`` component; a hash layer's
  table of V·k expert ids is stored in the checkpoint: counted in ``total`` and
  ``frozen``, and active in full like the embedding it is indexed with.
- **FLOPs** are a forward pass for one token: 2 per weight of every matrix (and conv
  kernel) the token goes through, the output head included even when tied, plus
  attention's 2·s·H·D for the scores and 2·s·H·D for the weighted values (sliding
  layers: s capped at w; DSA layers: s capped at K_I, plus the indexer's 2·s·H_I·D_I
  scores over every visible key on layers with their own indexer; V4 layers: the
  window's keys and the pooled entries they read, CSA's indexer 2·(s // m)·H_I·c).
  Norms, biases, the
  embedding lookup and element-wise gates are left out (well under 0.1%). Forward plus
  backward is about three times this (the 6N rule, N active).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from companion.analysis.cache_size import check_config
from companion.analysis.cache_size import (  # where they were first: chapters 09, 11
    kv_cache_bytes as kv_cache_bytes,
)
from companion.analysis.cache_size import (
    kv_cache_bytes_per_token as kv_cache_bytes_per_token,
)
from companion.analysis.mixer_params import (
    compressed_attention_flops,
    compressed_attention_params,
    gated_deltanet_params,
    hyper_connection_params,
    indexer_params,
    kimi_delta_params,
    latent_attention_params,
    own_indexer,
)
from companion.checks import check_int
from companion.models.config import ModelConfig

__all__ = [
    "COMPONENTS",
    "ParamCount",
    "Tally",
    "attention_layer_params",
    "count_params",
    "dense_ffn_params",
    "flops_per_token",
    "tally_moe",
]

# the rows of the chapter's breakdown table, in reading order
COMPONENTS = (
    "embedding",
    "positions",
    "attention",
    "ffn",
    "router",
    "experts",
    "shared_expert",
    "norms",
    "residual",
    "lm_head",
)
_NORMS_PER_LAYER = {"pre": 2, "post": 2, "sandwich": 4, "post_branch": 2}


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a config: totals, per component, and what one token uses.

    ``breakdown`` and ``active_breakdown`` map each of ``COMPONENTS`` to a count
    (0 where the model has none); they sum to ``total`` and ``active``.
    """

    breakdown: dict[str, int]
    active_breakdown: dict[str, int]
    frozen: int = 0

    @property
    def total(self) -> int:
        """Every stored number, tied weights once."""
        return sum(self.breakdown.values())

    @property
    def active(self) -> int:
        """What one token's forward pass touches (input embedding included)."""
        return sum(self.active_breakdown.values())

    @property
    def trainable(self) -> int:
        """``total`` without the numbers no gradient updates (the selection bias)."""
        return self.total - self.frozen

    @property
    def active_without_embeddings(self) -> int:
        """``active`` without the lookup tables (token and learned position
        embeddings)."""
        return self.active - self.breakdown["embedding"] - self.breakdown["positions"]


@dataclass
class Tally:
    """Running sums while walking the layers: total and active per component, the active
    multiply-accumulate weights (for FLOPs) and the frozen numbers."""

    total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    active: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    macs: int = 0
    frozen: int = 0

    def add(
        self, part: str, total: int, active: int | None = None, macs: int = 0
    ) -> None:
        self.total[part] += total
        self.active[part] += total if active is None else active
        self.macs += macs


def attention_layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matrix weights) of one softmax-attention layer with H and H_kv
    heads."""
    d, h, d_head = cfg.d_model, cfg.n_heads, cfg.head_dim
    q_out = (
        h * d_head * (2 if cfg.attn_output_gate else 1)
    )  # the gate rides on q's matrix
    kv_out = cfg.n_kv_heads * d_head
    matrices = d * (q_out + 2 * kv_out) + h * d_head * d
    extra = (q_out + 2 * kv_out if cfg.qkv_bias else 0) + (d if cfg.bias else 0)
    if cfg.qk_norm == "head":
        extra += 2 * d_head
    elif cfg.qk_norm == "full":
        extra += h * d_head + kv_out
    if cfg.attn_sinks:
        extra += h
    return matrices + extra, matrices


def _mixer_params(cfg: ModelConfig, layer: int, kind: str) -> tuple[int, int]:
    """(parameters, matrix weights) of layer ``layer``'s token mixer."""
    if kind == "linear":
        if cfg.linear.kind == "kda":
            return kimi_delta_params(cfg)
        return gated_deltanet_params(cfg)
    if cfg.compression is not None:
        return compressed_attention_params(cfg, kind)
    if not cfg.is_mla:
        return attention_layer_params(cfg)
    params, weights = latent_attention_params(cfg)
    if cfg.mla.output_gate:  # a gate logit per head
        params, weights = (
            params + cfg.n_heads * cfg.d_model,
            weights + cfg.n_heads * cfg.d_model,
        )
    if own_indexer(cfg, layer):
        more, more_w = indexer_params(cfg)
        params, weights = params + more, weights + more_w
    return params, weights


def dense_ffn_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matrix weights) of one dense FFN of width F."""
    d, f = cfg.d_model, cfg.d_ff
    glu = cfg.ffn == "glu"
    matrices = (3 if glu else 2) * d * f
    biases = ((2 * f if glu else f) + d) if cfg.bias else 0
    return matrices + biases, matrices


def tally_moe(cfg: ModelConfig, tally: Tally) -> None:
    """One MoE layer: the router scores all E experts, k of them run, the shared one
    always."""
    moe = cfg.moe
    d, e, k, f_e = cfg.d_model, moe.n_experts, moe.experts_per_token, moe.expert_d_ff
    router = e * d + (e if moe.router_bias else 0)
    if moe.router_selection_bias:
        router += e
        tally.frozen += e
    tally.add("router", router, macs=e * d)
    one = 3 * d * f_e + (2 * f_e + d if moe.expert_kind == "gpt_oss" else 0)
    tally.add("experts", e * one, k * one, macs=k * 3 * d * f_e)
    if moe.shared_d_ff:
        shared = 3 * d * moe.shared_d_ff + (d if moe.shared_expert_gate else 0)
        tally.add("shared_expert", shared, macs=shared)


def _tally(cfg: ModelConfig) -> Tally:
    check_config(cfg)
    d, v = cfg.d_model, cfg.vocab_size
    tally = Tally()
    tally.add("embedding", v * d)
    if cfg.position == "learned":
        tally.add("positions", cfg.max_seq_len * d)
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    hashed = _hash_router_config(cfg)
    for layer, kind in enumerate(cfg.layer_types):
        params, weights = _mixer_params(cfg, layer, kind)
        tally.add("attention", params, macs=weights)
        if cfg.residual is not None:  # one hyper-connection around each sublayer
            hc, hc_weights, _ = hyper_connection_params(cfg)
            tally.add("residual", 2 * hc, macs=2 * hc_weights)
        if cfg.is_hash_layer(layer):  # no selection bias; a table of k ids per token
            tally_moe(hashed, tally)
            tally.add("router", v * cfg.moe.experts_per_token)
            tally.frozen += v * cfg.moe.experts_per_token
        elif cfg.is_moe_layer(layer):
            tally_moe(cfg, tally)
        else:
            params, weights = dense_ffn_params(cfg)
            tally.add("ffn", params, macs=weights)
        tally.add("norms", _NORMS_PER_LAYER[cfg.norm_placement] * norm)
    if cfg.norm_placement != "post":
        tally.add("norms", norm)
    if cfg.residual is not None:  # the head that collapses the streams
        head = hyper_connection_params(cfg)[2]
        tally.add("residual", head, macs=head - cfg.residual.n_streams - 1)
    tally.add("lm_head", 0 if cfg.tie_embeddings else v * d, macs=v * d)
    return tally


def _hash_router_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as a hash-routed layer's router sees it: no selection bias."""
    if cfg.moe is None or not cfg.moe.hash_layers:
        return cfg
    return cfg.replace(moe=cfg.moe.replace(router_selection_bias=False))


def count_params(cfg: ModelConfig) -> ParamCount:
    """Total and active parameters of ``cfg``, with a per-component breakdown."""
    tally = _tally(cfg)
    return ParamCount(tally.total, tally.active, tally.frozen)


def flops_per_token(cfg: ModelConfig, context: int) -> int:
    """Forward FLOPs of one token that attends to ``context`` keys (its own included).

    2 × the active matrix weights, plus per attention layer 2·s·H·D_qk (scores) and
    2·s·H·D_v (weighted values) with s = ``context`` (sliding layers: min(s, w)); MLA
    counts its heads' full widths (D_qk = D_nope + R); a DSA layer attends to min(s,
    K_I) keys and, with its own indexer, adds 2·s·H_I·D_I for the index scores. A
    Gated DeltaNet (or KDA) layer's state costs 6·H_v·D_k·D_v whatever the context
    (read-out, the delta rule's read and its write).
    """
    tally = _tally(cfg)
    check_int("context", context, 0)
    mixing = 0
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "linear":
            lin = cfg.linear
            mixing += 6 * lin.value_heads * lin.key_dim * lin.value_dim
            continue
        if cfg.compression is not None:
            mixing += compressed_attention_flops(cfg, kind, context)
            continue
        s = min(context, cfg.sliding_window) if kind == "sliding" else context
        d_v = cfg.mla.v_head_dim if cfg.mla is not None else cfg.head_dim
        sparse = cfg.mla.indexer if cfg.mla is not None else None
        if sparse is not None:
            if own_indexer(cfg, layer):  # the indexer scores every visible key
                mixing += 2 * s * sparse.n_heads * sparse.head_dim
            s = min(s, sparse.topk)
        mixing += 2 * s * cfg.n_heads * (cfg.head_dim + d_v)
    return 2 * tally.macs + mixing
