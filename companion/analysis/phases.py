"""Prefill against decode: what each phase of serving computes and moves (chapter 16).

Shape legend: T prompt tokens read by one prefill, S context a decode step attends to
(its own token included), B batch, L layers, d model width, V vocabulary, N parameters;
MLA: H heads, C latent, R RoPE key width, Dn / Dv per-head key / value widths.

Serving a request runs two different programs on the same weights. *Prefill* reads the
T prompt tokens in one forward and writes their keys and values to the cache; *decode*
then makes one token per step, each step reading every weight and the whole cache for
one token's worth of arithmetic. Here both are counted on the model's own forward:

* :func:`meta_model` builds a :class:`~companion.models.decoder.DecoderLM` on the meta
  device with the reference attention (shapes only, no memory, nothing computed), so
  ``FlopCounterMode`` (:func:`~companion.analysis.scaling.count_flops`) sees every
  matmul, attention included; routed experts (MoE) need real values and are refused.
* :func:`phase_cost` counts the FLOPs of one forward of T new tokens after S − T
  cached ones (logits of the last position only, as generation computes them), and
  the bytes it must move (:class:`PhaseCost`): every weight read once, and the cache
  it touches, from :func:`~companion.analysis.cache_size.kv_cache_bytes`;
  :func:`prefill_cost` (T = S: the T positions written) and :func:`decode_step_cost`
  (T = 1: the S positions read) are its two phases. Activations are not counted:
  a prefill's are a few ``T·d`` per layer, a decode step's a few ``d``.
* :meth:`PhaseCost.attainable` and :meth:`PhaseCost.seconds` place a phase on a chip's
  roofline (:func:`~companion.analysis.decode_cost.attainable_flops`).
* :func:`latent_attention_flops` counts one MLA layer
  (:class:`~companion.layers.mla.MultiHeadLatentAttention`) in either form in either
  phase: naive re-expands every key, absorbed attends in the latent space.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from companion.analysis.cache_size import check_config, kv_cache_bytes
from companion.analysis.decode_cost import arithmetic_intensity, attainable_flops
from companion.analysis.scaling import count_flops
from companion.checks import check_choice, check_int, check_positive
from companion.layers.kv_cache import LatentCache
from companion.layers.mla import FORMS, MultiHeadLatentAttention
from companion.layers.rotary import RotaryEmbedding
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM

__all__ = [
    "PhaseCost",
    "decode_step_cost",
    "latent_attention_flops",
    "meta_model",
    "phase_cost",
    "prefill_cost",
]

META = torch.device("meta")


@dataclass(frozen=True)
class PhaseCost:
    """One forward of a serving phase: counted FLOPs and the bytes it must move."""

    tokens: int  # new tokens per sequence: T for prefill, 1 for decode
    context: int  # positions the step attends to: T for prefill, S for decode
    batch: int
    flops: int  # counted by FlopCounterMode on the model's forward
    weight_bytes: int  # every parameter read once
    cache_bytes: int  # written by prefill, read by a decode step

    @property
    def phase(self) -> str:
        """``"prefill"`` (T = S), ``"decode"`` (one token after cached ones) or
        ``"chunk"`` (a prefill chunk after cached tokens, Sarathi-Serve's)."""
        if self.tokens == self.context:
            return "prefill"
        return "decode" if self.tokens == 1 else "chunk"

    @property
    def nbytes(self) -> int:
        """The bytes moved, the weights plus the cache traffic."""
        return self.weight_bytes + self.cache_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return arithmetic_intensity(self.flops, self.nbytes)

    def attainable(self, peak_flops: float, bandwidth: float) -> float:
        """FLOP/s the roofline allows this phase on a chip: min(peak, I·bandwidth)."""
        return attainable_flops(self.intensity, peak_flops, bandwidth)

    def seconds(self, peak_flops: float, bandwidth: float) -> float:
        """The roofline's lower bound on the phase's time: max(FLOPs / peak, bytes /
        bandwidth)."""
        check_positive("peak_flops", peak_flops)
        check_positive("bandwidth", bandwidth)
        return max(self.flops / peak_flops, self.nbytes / bandwidth)


def meta_model(cfg: ModelConfig) -> DecoderLM:
    """``DecoderLM(cfg)`` on the meta device with ``attn_impl="reference"`` (CPU
    ``scaled_dot_product_attention`` is invisible to the FLOP counter): the same forward,
    shapes only."""
    check_config(cfg)
    if cfg.moe is not None:
        raise ValueError(
            "cfg: routed experts (moe) choose by value, which the meta device has not; "
            "count a dense or MLA config"
        )
    with META:
        model = DecoderLM(cfg.replace(attn_impl="reference"))
    return model.eval()


def _shapes(model: DecoderLM | ModelConfig) -> tuple[DecoderLM, int]:
    """The meta model to count on and the element size of ``model``'s weights (4 for a
    config: fp32, as built)."""
    if isinstance(model, ModelConfig):
        return meta_model(model), 4
    if not isinstance(model, DecoderLM):
        raise TypeError(
            "model must be a companion DecoderLM or ModelConfig, got "
            f"{type(model).__name__}"
        )
    size = model.tok_emb.weight.element_size()
    ready = model.tok_emb.weight.is_meta and model.cfg.attn_impl == "reference"
    return (model if ready else meta_model(model.cfg)), size


def _weight_bytes(model: DecoderLM, rows: int, dtype_bytes: int) -> int:
    """Every parameter once (tied ones once); an untied input embedding counts only the
    ``rows`` it looks up."""
    n = sum(p.numel() for p in model.parameters())
    table = model.tok_emb.weight
    if model.lm_head.weight is not table:
        n -= table.numel() - min(rows, table.shape[0]) * table.shape[1]
    return n * dtype_bytes


def phase_cost(
    model: DecoderLM | ModelConfig,
    tokens: int,
    context: int,
    *,
    batch: int = 1,
    dtype_bytes: int | None = None,
) -> PhaseCost:
    """One forward of ``tokens`` new tokens per sequence at the end of ``context``
    positions (prefill: T = S; decode: 1; a prefill chunk: between), counted on the
    meta model; ``dtype_bytes``: bytes per weight and cache number (default:
    ``model``'s own)."""
    check_int("tokens", tokens, 1)
    check_int("context", context, tokens)
    check_int("batch", batch, 1)
    if dtype_bytes is not None:
        check_int("dtype_bytes", dtype_bytes, 1)
    shape, size = _shapes(model)
    size = size if dtype_bytes is None else dtype_bytes
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=META)
    positions = torch.arange(context - tokens, context, device=META)
    cache = shape.new_cache(batch, context)  # the step attends to all `context` rows
    flops = count_flops(lambda: shape.forward_at(ids, positions, cache, last_only=True))
    weights = _weight_bytes(shape, batch * tokens, size)  # read once for all B·T tokens
    # the cache a step touches: prefill writes its T rows, decode reads all S rows
    moved = kv_cache_bytes(shape.cfg, context, size, batch=batch)
    return PhaseCost(tokens, context, batch, flops, weights, moved)


def prefill_cost(
    model: DecoderLM | ModelConfig,
    tokens: int,
    *,
    batch: int = 1,
    dtype_bytes: int | None = None,
) -> PhaseCost:
    """One prefill of ``tokens`` prompt tokens per sequence: FLOPs counted on the
    forward that fills the cache (last position's logits only); bytes: the weights
    once, plus the T positions of cache written. ``dtype_bytes``: bytes per weight and
    cache number (default: ``model``'s own)."""
    return phase_cost(model, tokens, tokens, batch=batch, dtype_bytes=dtype_bytes)


def decode_step_cost(
    model: DecoderLM | ModelConfig,
    context: int,
    *,
    batch: int = 1,
    dtype_bytes: int | None = None,
) -> PhaseCost:
    """One decode step per sequence at ``context`` positions (S − 1 cached and the new
    one): FLOPs counted on that step's forward; bytes: the weights once, plus the S
    positions of cache it reads."""
    return phase_cost(model, 1, context, batch=batch, dtype_bytes=dtype_bytes)


def latent_attention_flops(
    shape: dict[str, int], form: str, tokens: int, context: int
) -> int:
    """Counted FLOPs of one causal MLA layer of ``shape`` (``d_model``, ``n_heads`` and
    :class:`~companion.layers.mla.MultiHeadLatentAttention`'s keyword widths) in
    ``form`` reading ``tokens`` new tokens at the end of ``context`` positions (prefill:
    ``tokens == context``; decode: ``tokens == 1``), batch 1, on the meta device."""
    check_choice("form", form, FORMS)
    check_int("tokens", tokens, 1)
    check_int("context", context, 1)
    if tokens > context:
        raise ValueError(f"tokens ({tokens}) must be <= context ({context})")
    widths = dict(shape)
    try:
        d, h = widths.pop("d_model"), widths.pop("n_heads")
    except KeyError as missing:
        raise ValueError(
            f"shape needs d_model and n_heads, missing {missing}"
        ) from None
    with META:
        rope = RotaryEmbedding(widths["qk_rope_head_dim"], max_len=context)
        layer = MultiHeadLatentAttention(
            d, h, **widths, form=form, impl="reference", causal=True, rope=rope
        )
        cache = LatentCache(1, context, layer.kv_lora_rank, layer.qk_rope_head_dim)
        x = torch.zeros(1, tokens, d)
        positions = torch.arange(context - tokens, context)
    return count_flops(lambda: layer(x, positions, cache))
