"""Linear attention, the delta rule and Gated DeltaNet: recurrent and chunkwise forms (chapter 11).

Shape legend: B batch, T tokens, H_k query/key heads, H value heads (a multiple of H_k: each
query/key head serves H / H_k consecutive value heads), D_k query/key width, D_v value width,
C chunk size, N = ⌈T / C⌉ chunks. Inputs use the ``(B, T, heads, width)`` layout of
transformers and flash-linear-attention: ``q, k (B, T, H_k, D_k)``, ``v (B, T, H, D_v)``,
``g, beta (B, T, H)``; the state is ``S (B, H, D_k, D_v)``.

Orientation: the state maps keys to values, ``S ∈ R^{D_k×D_v}``; it is read as
``o_t = S_tᵀ (scale·q_t)`` and written with outer products ``k vᵀ``. Per head and token:

* linear attention:  ``S_t = S_{t-1} + k_t v_tᵀ``
* delta rule:        ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``
  (one step of online regression: the state's prediction for ``k_t`` moves toward ``v_t``)
* gated delta rule:  ``P = exp(g_t) S_{t-1};  S_t = P + β_t k_t (v_t − Pᵀ k_t)ᵀ``,
  ``g_t ≤ 0`` a log-decay.

Every op comes twice with one signature and ``(output (B, T, H, D_v), final state or None)``
as result: ``recurrent_*`` is the token-by-token reference, ``chunk_*`` the chunkwise-parallel
form (intra-chunk work batched over all chunks, only the state recurrence across chunks
looped); the recurrent forms take no ``chunk_size``. Linear attention also has
:func:`parallel_linear_attention`, the masked ``(q kᵀ) v`` product. Work is done in fp32
(fp64 inputs stay fp64, for exact tests); the output is cast back to ``q``'s dtype, the state
is returned in the working dtype. ``use_qk_l2norm_in_kernel`` (default False, as in
transformers' torch functions) L2-normalises q and k first; ``scale`` defaults to ``1/√D_k``
and multiplies q after that normalisation. Lengths that are not a multiple of C are
zero-padded (a padded token has k = 0, β = 0, g = 0 and leaves the state unchanged); a
sequence shorter than C is one chunk of its own length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_linear_attention",
    "l2norm",
    "parallel_linear_attention",
    "recurrent_delta_rule",
    "recurrent_gated_delta_rule",
    "recurrent_linear_attention",
]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / √(Σx² + eps)`` over the last dimension (eps inside the root, as fla and HF)."""
    return x * _inv_norm(x, eps)


def _inv_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``1 / √(Σx² + eps)`` over the last dimension, ``(..., 1)``, without an x-sized temporary."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps)


def _check(q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor], state: Tensor | None):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape (B, T, H, D), got {tuple(x.shape)}")
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


def _prepare(q, k, v, gates, state, scale, l2):
    """Check; go to contiguous heads-first ``(B, H, T, D)`` in the working dtype; share q/k
    heads; L2-normalise q and k if asked, and scale q."""
    _check(q, k, v, gates, state)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp32, or exact tests
    groups = v.shape[2] // k.shape[2]
    q, k, v = (x.to(dt).transpose(1, 2).contiguous() for x in (q, k, v))
    if groups > 1:
        q, k = (x.repeat_interleave(groups, dim=1) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q * (_inv_norm(q) * scale if l2 else scale)
    k = k * _inv_norm(k) if l2 else k
    gates = [x.to(dt).transpose(1, 2) for x in gates.values()]
    b, h, _, dk = k.shape
    s = state.to(dt) if state is not None else v.new_zeros(b, h, dk, v.shape[-1])
    return q, k, v, gates, s


def _finish(o: Tensor, s: Tensor, dtype: torch.dtype, keep: bool) -> tuple[Tensor, Tensor | None]:
    o = o.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)  # (B, T, H, D_v)
    return o, (s if keep else None)


def _check_chunk(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _chunked(x: Tensor, c: int) -> Tensor:
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
    """Reference: ``S_t = S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, one token at a time."""
    dtype = q.dtype
    q, k, v, _, s = _prepare(q, k, v, {}, initial_state, scale, False)
    outs = []
    for t in range(q.shape[2]):
        s = s + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, D_k, D_v)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return _finish(torch.stack(outs, dim=2), s, dtype, output_final_state)


def parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Softmax-free attention as one masked product: ``o = tril(q kᵀ) v + q S_0`` (O(T²))."""
    dtype = q.dtype
    q, k, v, _, s = _prepare(q, k, v, {}, initial_state, scale, False)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    o = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0) @ v + q @ s  # (B, H, T, D_v)
    return _finish(o, s + k.transpose(-1, -2) @ v, dtype, output_final_state)


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
    """Chunkwise: masked attention inside each chunk plus a read of the state at its start.

    The states at the chunk starts are an exclusive prefix sum of the chunks' ``Kᵀ V``, so
    this form needs no loop at all.
    """
    _check_chunk(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, _, s = _prepare(q, k, v, {}, initial_state, scale, False)
    c = min(chunk_size, t)
    q, k, v = (_chunked(x, c) for x in (q, k, v))  # (B, H, N, C, D)
    kv = k.transpose(-1, -2) @ v  # (B, H, N, D_k, D_v)
    starts = s[:, :, None] + torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], 2).cumsum(2)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    o = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0) @ v + q @ starts  # (B, H, N, C, D_v)
    o = o.flatten(2, 3)[:, :, :t]
    return _finish(o, starts[:, :, -1] + kv[:, :, -1], dtype, output_final_state)


# --- the delta rule, gated or not -------------------------------------------------------


def _recurrent_delta(q, k, v, g, beta, s):
    """The token loop shared by both delta rules (``g`` None: no decay)."""
    outs = []
    for t in range(q.shape[2]):
        if g is not None:
            s = s * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]  # (B, H, D_k)
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * delta[..., None, :]  # (B, H, D_k, D_v)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outs, dim=2), s


def _chunk_delta(q, k, v, g, beta, s, c):
    """Chunkwise delta rule on ``(B, H, T, D)`` working-dtype tensors (``g`` None: no decay).

    Within a chunk (positions r, s; γ_r the cumulative log-decay since the chunk start,
    S_0 the state at the start), the corrections ``δ_r = β_r (v_r − P_rᵀ k_r)`` written to
    the state satisfy a unit-lower-triangular system (the UT / WY representation):

        (I + L) δ = β v − diag(β e^γ) K S_0,   L_rs = β_r e^{γ_r − γ_s} k_r·k_s  (s < r)

    so ``δ = u − w S_0`` with ``[u | w] = (I + L)⁻¹ [β v | β e^γ k]``: one batched triangular
    solve for all chunks at once. Across chunks only a short loop remains,
    ``δ = u − w S_0``, ``S_C = e^{γ_C} S_0 + Σ_s e^{γ_C − γ_s} k_s δ_sᵀ``; the outputs
    ``o_r = e^{γ_r} S_0ᵀ q_r + Σ_{s≤r} e^{γ_r−γ_s} (q_r·k_s) δ_s`` are again batched.
    """
    t, dk = q.shape[2], q.shape[3]
    q, k, v = (_chunked(x, c) for x in (q, k, v))  # (B, H, N, C, D)
    beta = _chunked(beta[..., None], c)  # (B, H, N, C, 1)
    kb = k * beta
    kk = kb @ k.transpose(-1, -2)  # (B, H, N, C, C): β_r k_r·k_s
    qk = q @ k.transpose(-1, -2)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # In-place ops below act on fresh temporaries only (fewer C×C allocations).
    if g is None:
        w_rhs, k_end, q_decay, chunk_decay = kb, k, None, None
        qk.masked_fill_(upper, 0)
    else:
        gam = _chunked(g[..., None], c).cumsum(dim=3)  # (B, H, N, C, 1)
        decay = (gam - gam.transpose(-1, -2)).masked_fill_(upper, float("-inf")).exp_()
        kk.mul_(decay)  # (B, H, N, C, C), zero above the diagonal
        qk.mul_(decay)
        q_decay = gam.exp()  # (B, H, N, C, 1)
        w_rhs = kb * q_decay
        k_end = k * (gam[:, :, :, -1:] - gam).exp()
        chunk_decay = gam[:, :, :, -1:].exp()  # (B, H, N, 1, 1)
    # solve_triangular reads only the strict lower triangle of kk (L): unit diagonal implied.
    uw = torch.linalg.solve_triangular(
        kk, torch.cat([v * beta, w_rhs], dim=-1), upper=False, unitriangular=True
    )
    u, w = uw.split([v.shape[-1], dk], dim=-1)  # (B, H, N, C, D_v), (B, H, N, C, D_k)
    k_end = k_end.transpose(-1, -2)  # (B, H, N, D_k, C)
    starts, deltas = [], []
    for n in range(q.shape[2]):
        starts.append(s)
        deltas.append(u[:, :, n] - w[:, :, n] @ s)  # (B, H, C, D_v)
        s = s if chunk_decay is None else s * chunk_decay[:, :, n]
        s = s + k_end[:, :, n] @ deltas[-1]  # (B, H, D_k, D_v)
    s0, delta = torch.stack(starts, dim=2), torch.stack(deltas, dim=2)
    o = qk @ delta  # (B, H, N, C, D_v)
    if q_decay is None:
        o += q @ s0
    else:
        o.addcmul_(q_decay, q @ s0)
    return o.flatten(2, 3)[:, :, :t], s


def recurrent_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Reference: ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ q_t``."""
    dtype = q.dtype
    q, k, v, (beta,), s = _prepare(
        q, k, v, {"beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = _recurrent_delta(q, k, v, None, beta, s)
    return _finish(o, s, dtype, output_final_state)


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise delta rule (DeltaNet): UT-transform inside chunks, recurrence across them."""
    _check_chunk(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, (beta,), s = _prepare(
        q, k, v, {"beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = _chunk_delta(q, k, v, None, beta, s, min(chunk_size, t))
    return _finish(o, s, dtype, output_final_state)


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Reference: decay ``S`` by ``exp(g_t)``, then one delta-rule step; ``o_t = S_tᵀ q_t``."""
    dtype = q.dtype
    q, k, v, (g, beta), s = _prepare(
        q, k, v, {"g": g, "beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = _recurrent_delta(q, k, v, g, beta, s)
    return _finish(o, s, dtype, output_final_state)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise gated delta rule (Gated DeltaNet, Qwen3-Next); ``g ≤ 0`` is a log-decay."""
    _check_chunk(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, (g, beta), s = _prepare(
        q, k, v, {"g": g, "beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = _chunk_delta(q, k, v, g, beta, s, min(chunk_size, t))
    return _finish(o, s, dtype, output_final_state)
