"""What one decoding step costs: work with and without a cache, bytes against FLOPs
(chapter 08).

Shape legend: P prompt tokens, n new tokens, s context (keys one query reads), b batch,
H query heads, D_qk / D_v query-key and value widths of a head, w cache width (numbers
one layer stores per position: 2·H_kv·D for K and V, C + R for a latent cache).

Pure arithmetic, no tensors: the chapter checks each formula against a model it runs.

* :func:`projected_tokens` and :func:`attended_pairs` count the work of greedy
  generation with a KV cache (the prompt once, then one token per step) and without one
  (the whole sequence re-read at every step): linear against quadratic in the tokens.
* :func:`decode_attention_flops` and :func:`decode_attention_bytes` are one layer's
  attention in one decode step; their ratio, :func:`arithmetic_intensity`, set against a
  chip's :func:`ridge_point`, says whether the step waits on memory or on arithmetic
  (:func:`attainable_flops` is the roofline).
* :func:`max_context_tokens` is how many cached tokens fit beside the weights.
"""

from __future__ import annotations

from companion.checks import check_int, check_number, check_positive

__all__ = [
    "arithmetic_intensity",
    "attainable_flops",
    "attended_pairs",
    "decode_attention_bytes",
    "decode_attention_flops",
    "max_context_tokens",
    "projected_tokens",
    "ridge_point",
]


def _steps(prompt: int, new_tokens: int) -> list[int]:
    """The sequence length each of the n forward passes of generation ends at."""
    check_int("prompt", prompt, 1)
    check_int("new_tokens", new_tokens, 0)
    return [prompt + i for i in range(new_tokens)]


def projected_tokens(prompt: int, new_tokens: int, *, cached: bool) -> int:
    """Token rows one layer's projections process to generate ``new_tokens`` after a
    ``prompt``: P + n − 1 with a cache (the prompt once, then each new token but the
    last), Σ (P + i) for i < n without (every pass re-reads the whole sequence)."""
    ends = _steps(prompt, new_tokens)
    if not ends:
        return 0
    return prompt + new_tokens - 1 if cached else sum(ends)


def attended_pairs(prompt: int, new_tokens: int, *, cached: bool) -> int:
    """(query, key) pairs one causal attention head scores during generation.

    A pass over positions [a, e) scores Σ (p + 1) pairs for p in [a, e). With a cache
    the passes cover [0, P), then [e − 1, e) for e = P + 1, ..., P + n − 1; without one,
    [0, e) for e = P, ..., P + n − 1 (T(T + 1)/2 pairs each).
    """
    ends = _steps(prompt, new_tokens)
    if not ends:
        return 0
    if cached:
        return prompt * (prompt + 1) // 2 + sum(ends[1:])
    return sum(e * (e + 1) // 2 for e in ends)


def decode_attention_flops(
    n_heads: int, qk_dim: int, v_dim: int, context: int, batch: int = 1
) -> int:
    """FLOPs of one layer's attention for one new token per sequence: 2·H·D_qk·s for the
    scores and 2·H·D_v·s for the weighted values, times b (softmax left out)."""
    for name, value in (("n_heads", n_heads), ("qk_dim", qk_dim), ("v_dim", v_dim)):
        check_int(name, value, 1)
    check_int("context", context, 0)
    check_int("batch", batch, 1)
    return 2 * n_heads * (qk_dim + v_dim) * context * batch


def decode_attention_bytes(
    cache_width: int, context: int, batch: int = 1, bytes_per_element: int = 2
) -> int:
    """Bytes of cache one layer reads for one new token per sequence: w·s·b·bytes, with
    w = 2·H_kv·D for K and V (each K/V head read once for all the query heads sharing
    it) or C + R for a latent cache read in absorbed form."""
    check_int("cache_width", cache_width, 1)
    check_int("context", context, 0)
    check_int("batch", batch, 1)
    check_int("bytes_per_element", bytes_per_element, 1)
    return cache_width * context * batch * bytes_per_element


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs done per byte moved."""
    check_positive("nbytes", nbytes)
    check_number("flops", flops, 0.0)
    return flops / nbytes


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOPs/byte) above which a chip is limited by arithmetic, below
    which by memory: peak FLOP/s ÷ bytes/s."""
    check_positive("peak_flops", peak_flops)
    check_positive("bandwidth", bandwidth)
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: FLOP/s a kernel of this intensity can reach, min(peak,
    I·bandwidth)."""
    check_positive("intensity", intensity)
    check_positive("peak_flops", peak_flops)
    check_positive("bandwidth", bandwidth)
    return min(peak_flops, intensity * bandwidth)


def max_context_tokens(
    memory_bytes: int, weight_bytes: int, per_token_bytes: int, batch: int = 1
) -> int:
    """Cached tokens per sequence that fit beside the weights:
    ⌊(memory − weights) / (per-token bytes · b)⌋. Activations and fragmentation are
    ignored, so this is an upper bound. Raises if the weights alone do not fit."""
    check_int("memory_bytes", memory_bytes, 1)
    check_int("weight_bytes", weight_bytes, 0)
    check_int("per_token_bytes", per_token_bytes, 1)
    check_int("batch", batch, 1)
    if weight_bytes > memory_bytes:
        raise ValueError(
            f"weight_bytes ({weight_bytes:,}) exceed memory_bytes ({memory_bytes:,}): "
            "the weights alone do not fit"
        )
    return (memory_bytes - weight_bytes) // (per_token_bytes * batch)
