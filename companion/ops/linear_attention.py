"""Linear attention, recurrent and chunkwise, and the helpers every linear-attention
form shares (chapter 11). The delta rule and Gated DeltaNet are in
:mod:`companion.ops.delta_rule`.

Shape legend: B batch, T tokens, H_k query/key heads, H value heads (a multiple of H_k:
each query/key head serves H / H_k consecutive value heads), D_k query/key width, D_v
value width, C chunk size, N = ⌈T / C⌉ chunks. Inputs use the ``(B, T, heads, width)``
layout of transformers and flash-linear-attention: ``q, k (B, T, H_k, D_k)``, ``v (B, T,
H, D_v)``, ``g, beta (B, T, H)``; the state is ``S (B, H, D_k, D_v)``.

Orientation: the state maps keys to values, ``S ∈ R^{D_k×D_v}``; it is read as
``o_t = S_tᵀ (scale·q_t)`` and written with outer products ``k vᵀ``. Per head and token:

* linear attention:  ``S_t = S_{t-1} + k_t v_tᵀ``
* delta rule: ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ`` (one step of online
  regression: the state's prediction for ``k_t`` moves toward ``v_t``)
* gated delta rule:  ``P = exp(g_t) S_{t-1};  S_t = P + β_t k_t (v_t − Pᵀ k_t)ᵀ``,
  ``g_t ≤ 0`` a log-decay.

Every op comes twice with one signature and ``(output (B, T, H, D_v), final state or
None)`` as result: ``recurrent_*`` is the token-by-token reference, ``chunk_*`` the
chunkwise-parallel form (intra-chunk work batched over all chunks, only the state
recurrence across chunks looped); the recurrent forms take no ``chunk_size``. Linear
attention also has :func:`parallel_linear_attention`, the masked ``(q kᵀ) v`` product.
Work is done in fp32 (fp64 inputs stay fp64, for exact tests); the output is cast back
to ``q``'s dtype, the state is returned in the working dtype.
``use_qk_l2norm_in_kernel`` (default False, as in transformers' torch functions)
L2-normalises q and k first; ``scale`` defaults to ``1/√D_k`` and multiplies q after
that normalisation. Lengths that are not a multiple of C are zero-padded (a padded token
has k = 0, β = 0, g = 0 and leaves the state unchanged); a sequence shorter than C is
one chunk of its own length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_int

__all__ = [
    "GATE_RANGES",
    "check_chunk_size",
    "check_linear_inputs",
    "chunk_linear_attention",
    "heads_first",
    "heads_last",
    "inv_l2norm",
    "l2norm",
    "parallel_linear_attention",
    "recurrent_linear_attention",
    "split_chunks",
]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / √(Σx² + eps)`` over the last dimension (eps inside the root, as fla and
    HF)."""
    return x * inv_l2norm(x, eps)


def inv_l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``1 / √(Σx² + eps)`` over the last dimension, ``(..., 1)``, without an x-sized
    temporary."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps)


def check_linear_inputs(
    q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor], state: Tensor | None
) -> None:
    """Raise a ValueError naming the input whose shape does not fit the legend above,
    or a gate (``g``, ``beta``) with a value outside ``GATE_RANGES``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape (B, T, H, D), got {tuple(x.shape)}"
            )
    if q.shape[1] == 0:
        raise ValueError("q, k, v must hold at least one token (T >= 1), got T = 0")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if v.shape[:2] != k.shape[:2] or v.shape[2] % k.shape[2]:
        raise ValueError(
            f"v must share B and T with k and have a multiple of k's heads; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for name, x in gates.items():
        if x.shape != v.shape[:3]:
            raise ValueError(
                f"{name} must have shape (B, T, H) = {tuple(v.shape[:3])}, got {tuple(x.shape)}"
            )
    want = (v.shape[0], v.shape[2], k.shape[3], v.shape[3])
    if state is not None and state.shape != want:
        raise ValueError(
            f"initial_state must have shape (B, H, D_k, D_v) = {want}, got {tuple(state.shape)}"
        )
    if not torch.compiler.is_compiling():  # a check of values: one sync, never traced
        for name, x in gates.items():
            _check_range(name, x)


# the documented range of each gate: g a log-decay (exp(g) in (0, 1]); β in [0, 2], where
# the transition I − β k kᵀ of a unit key keeps its eigenvalues in [−1, 1]
GATE_RANGES = {"g": (float("-inf"), 0.0), "beta": (0.0, 2.0)}


def _check_range(name: str, x: Tensor) -> None:
    """Raise a ValueError naming ``name`` if any value is NaN, infinite or outside
    its range in ``GATE_RANGES``."""
    lo, hi = GATE_RANGES[name]
    if bool((~torch.isfinite(x) | (x < lo) | (x > hi)).any()):
        allowed = f"<= {hi:g}" if lo == float("-inf") else f"in [{lo:g}, {hi:g}]"
        raise ValueError(
            f"{name} must be finite and {allowed}, got values in "
            f"[{x.min().item():g}, {x.max().item():g}]"
        )


def heads_first(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: dict[str, Tensor],
    state: Tensor | None,
    scale: float | None,
    l2: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], Tensor]:
    """Check; go to contiguous heads-first ``(B, H, T, D)`` in the working dtype; share
    q/k heads; L2-normalise q and k if asked, and scale q."""
    check_linear_inputs(q, k, v, gates, state)
    dt = (
        torch.float64 if q.dtype == torch.float64 else torch.float32
    )  # fp32, or exact tests
    groups = v.shape[2] // k.shape[2]
    q, k, v = (x.to(dt).transpose(1, 2).contiguous() for x in (q, k, v))
    if groups > 1:
        q, k = (x.repeat_interleave(groups, dim=1) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q * (inv_l2norm(q) * scale if l2 else scale)
    k = k * inv_l2norm(k) if l2 else k
    gates = [x.to(dt).transpose(1, 2) for x in gates.values()]
    b, h, _, dk = k.shape
    s = state.to(dt) if state is not None else v.new_zeros(b, h, dk, v.shape[-1])
    return q, k, v, gates, s


def heads_last(
    o: Tensor, s: Tensor, dtype: torch.dtype, keep: bool
) -> tuple[Tensor, Tensor | None]:
    """Back to ``(B, T, H, D_v)`` in ``dtype``; the final state if ``keep``, else
    None."""
    o = o.transpose(1, 2).to(
        dtype, memory_format=torch.contiguous_format
    )  # (B, T, H, D_v)
    return o, (s if keep else None)


def check_chunk_size(chunk_size: int) -> None:
    """Raise a ValueError unless ``chunk_size`` is a positive int."""
    check_int("chunk_size", chunk_size, 1)


def split_chunks(x: Tensor, c: int) -> Tensor:
    """``(B, H, T, ...) -> (B, H, N, C, ...)``, zero-padding T up to a multiple of C."""
    pad = -x.shape[2] % c
    if pad:
        x = F.pad(x, (0, 0) * (x.ndim - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, c, *x.shape[3:])


# --- linear attention -------------------------------------------------------------------


def recurrent_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Reference: ``S_t = S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, one token at a
    time."""
    dtype = q.dtype
    q, k, v, _, s = heads_first(q, k, v, {}, initial_state, scale, False)
    outs = []
    for t in range(q.shape[2]):
        s = s + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, D_k, D_v)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return heads_last(torch.stack(outs, dim=2), s, dtype, output_final_state)


def parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Softmax-free attention as one masked product: ``o = tril(q kᵀ) v + q S_0``
    (O(T²))."""
    dtype = q.dtype
    q, k, v, _, s = heads_first(q, k, v, {}, initial_state, scale, False)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    o = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0) @ v + q @ s  # (B, H, T, D_v)
    return heads_last(o, s + k.transpose(-1, -2) @ v, dtype, output_final_state)


def chunk_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise: masked attention inside each chunk plus a read of the state at its
    start.

    The states at the chunk starts are an exclusive prefix sum of the chunks' ``Kᵀ V``,
    so this form needs no loop at all.
    """
    check_chunk_size(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, _, s = heads_first(q, k, v, {}, initial_state, scale, False)
    c = min(chunk_size, t)
    q, k, v = (split_chunks(x, c) for x in (q, k, v))  # (B, H, N, C, D)
    kv = k.transpose(-1, -2) @ v  # (B, H, N, D_k, D_v)
    starts = s[:, :, None] + torch.cat(
        [torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], 2
    ).cumsum(2)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    o = (q @ k.transpose(-1, -2)).masked_fill(
        ~causal, 0
    ) @ v + q @ starts  # (B, H, N, C, D_v)
    o = o.flatten(2, 3)[:, :, :t]
    return heads_last(o, starts[:, :, -1] + kv[:, :, -1], dtype, output_final_state)
