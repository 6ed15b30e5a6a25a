"""The delta rule and the gated delta rule (DeltaNet, Gated DeltaNet, Kimi Delta
Attention): recurrent and chunkwise forms (chapter 11).

Shapes, orientation, dtypes and the shared signature are those of
:mod:`companion.ops.linear_attention`; per head and token

* delta rule: ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ`` (one step of online
  regression: the state's prediction for ``k_t`` moves toward ``v_t``)
* gated delta rule:  ``P = exp(g_t) S_{t-1};  S_t = P + β_t k_t (v_t − Pᵀ k_t)ᵀ``,
  ``g_t ≤ 0`` a log-decay, one per head: ``g (B, T, H)``
* KDA (Kimi Delta Attention): the same with one log-decay per key channel, ``g (B, T,
  H, D_k)``, and ``P = Diag(exp(g_t)) S_{t-1}``: each row of the state (one key
  channel) forgets at its own rate. A gate equal across channels is the gated delta rule.

The token loop and the chunk machinery are shared: they take ``g`` as ``(B, H, T)`` or
``(B, H, T, D_k)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.ops.linear_attention import (
    GATE_RANGES,
    check_chunk_size,
    heads_first,
    heads_last,
    split_chunks,
)

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "delta_rule_chunks",
    "delta_rule_loop",
    "recurrent_delta_rule",
    "recurrent_gated_delta_rule",
    "recurrent_kda",
]


def delta_rule_loop(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, s: Tensor
) -> tuple[Tensor, Tensor]:
    """The token loop of the delta rules, heads first: q, k ``(B, H, T, D_k)``, v ``(B,
    H, T, D_v)``, beta ``(B, H, T)``, g ``(B, H, T)`` (per head), ``(B, H, T, D_k)`` (per
    key channel) or None (no decay), state s ``(B, H, D_k, D_v)``; returns the outputs
    ``(B, H, T, D_v)`` and the last state."""
    outs = []
    for t in range(q.shape[2]):
        if g is not None:
            # (B, H, 1, 1) or (B, H, D_k, 1): one factor per head or per state row
            decay = g[:, :, t, None, None] if g.ndim == 3 else g[:, :, t, :, None]
            s = s * decay.exp()
        k_t = k[:, :, t]  # (B, H, D_k)
        delta = beta[:, :, t, None] * (
            v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, k_t)
        )
        s = s + k_t[..., :, None] * delta[..., None, :]  # (B, H, D_k, D_v)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outs, dim=2), s


def delta_rule_chunks(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, s: Tensor, c: int
) -> tuple[Tensor, Tensor]:
    """Chunkwise delta rule on ``(B, H, T, D)`` working-dtype tensors; ``g`` as in
    :func:`delta_rule_loop` (None: no decay).

    Within a chunk (positions r, s; γ_r the cumulative log-decay since the chunk start,
    S_0 the state at the start), the corrections ``δ_r = β_r (v_r − P_rᵀ k_r)`` written
    to the state satisfy a unit-lower-triangular system (the UT / WY representation):

        (I + L) δ = β v − diag(β e^γ) K S_0,   L_rs = β_r e^{γ_r − γ_s} k_r·k_s  (s < r)

    so ``δ = u − w S_0`` with ``[u | w] = (I + L)⁻¹ [β v | β e^γ k]``: one batched
    triangular solve for all chunks at once. Across chunks only a short loop remains,
    ``δ = u − w S_0``, ``S_C = e^{γ_C} S_0 + Σ_s e^{γ_C − γ_s} k_s δ_sᵀ``; the outputs
    ``o_r = e^{γ_r} S_0ᵀ q_r + Σ_{s≤r} e^{γ_r−γ_s} (q_r·k_s) δ_s`` are again batched.
    With a per-channel gate γ_r is a vector: ``e^γ`` scales each key channel and the
    pairwise factor moves inside the products, ``Σ_i k_ri e^{γ_ri − γ_si} k_si``.
    """
    t, dk = q.shape[2], q.shape[3]
    q, k, v = (split_chunks(x, c) for x in (q, k, v))  # (B, H, N, C, D)
    beta = split_chunks(beta[..., None], c)  # (B, H, N, C, 1)
    kb = k * beta
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # In-place ops below act on fresh temporaries only (fewer C×C allocations).
    if g is None:
        kk = kb @ k.transpose(-1, -2)  # (B, H, N, C, C): β_r k_r·k_s
        qk = (q @ k.transpose(-1, -2)).masked_fill_(upper, 0)
        w_rhs, k_end, q_decay, chunk_decay = kb, k, None, None
    else:
        per_channel = g.ndim == 4
        gate = g if per_channel else g[..., None]  # (B, H, T, G), G = D_k or 1
        gam = split_chunks(gate, c).cumsum(dim=3)  # (B, H, N, C, G)
        kk, qk = _decayed_products(q, k, kb, gam, upper)
        q_decay = gam.exp()  # (B, H, N, C, G)
        w_rhs = kb * q_decay
        k_end = k * (gam[:, :, :, -1:] - gam).exp()
        chunk_decay = gam[:, :, :, -1:].exp()  # (B, H, N, 1, G)
        if per_channel:  # one factor per state row: (B, H, N, D_k, 1)
            chunk_decay = chunk_decay.transpose(-1, -2)
    # solve_triangular reads only kk's strict lower triangle (L); the unit diagonal
    # is implied.
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
    elif q_decay.shape[-1] == 1:
        o.addcmul_(q_decay, q @ s0)
    else:
        o += (q * q_decay) @ s0
    return o.flatten(2, 3)[:, :, :t], s


def _decayed_products(
    q: Tensor, k: Tensor, kb: Tensor, gam: Tensor, upper: Tensor
) -> tuple[Tensor, Tensor]:
    """``β_r k_r·k_s`` and ``q_r·k_s`` in each chunk, ``(B, H, N, C, C)``, weighted by
    the decay from s to r and zero for s > r; ``gam (B, H, N, C, G)``, G = 1 or D_k."""
    if gam.shape[-1] == 1:
        kt = k.transpose(-1, -2)  # (B, H, N, D_k, C)
        decay = (gam - gam.transpose(-1, -2)).masked_fill_(upper, float("-inf")).exp_()
        return (kb @ kt).mul_(decay), (q @ kt).mul_(decay)
    # per channel the factor depends on i too: e^{γ_ri − γ_si}, (B, H, N, C, C, D_k)
    diff = gam[..., :, None, :] - gam[..., None, :, :]
    decay = diff.masked_fill_(upper[..., None], float("-inf")).exp_()
    kd = decay * k[..., None, :, :]  # row r holds k_s ⊙ e^{γ_r − γ_s}
    return (kd @ kb[..., None]).squeeze(-1), (kd @ q[..., None]).squeeze(-1)


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
    """Reference: ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ
    q_t``."""
    dtype = q.dtype
    q, k, v, (beta,), s = heads_first(
        q, k, v, {"beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = delta_rule_loop(q, k, v, None, beta, s)
    return heads_last(o, s, dtype, output_final_state)


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
    """Chunkwise delta rule (DeltaNet): UT-transform inside chunks, recurrence across
    them."""
    check_chunk_size(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, (beta,), s = heads_first(
        q, k, v, {"beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = delta_rule_chunks(q, k, v, None, beta, s, min(chunk_size, t))
    return heads_last(o, s, dtype, output_final_state)


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
    """Reference: decay ``S`` by ``exp(g_t)``, then one delta-rule step; ``o_t = S_tᵀ
    q_t``."""
    dtype = q.dtype
    q, k, v, (g, beta), s = heads_first(
        q, k, v, {"g": g, "beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = delta_rule_loop(q, k, v, g, beta, s)
    return heads_last(o, s, dtype, output_final_state)


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
    """Chunkwise gated delta rule (Gated DeltaNet, Qwen3-Next); ``g ≤ 0`` is a
    log-decay."""
    check_chunk_size(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, (g, beta), s = heads_first(
        q, k, v, {"g": g, "beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = delta_rule_chunks(q, k, v, g, beta, s, min(chunk_size, t))
    return heads_last(o, s, dtype, output_final_state)


def _channel_gate_first(g: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Check a per-channel log-decay ``g (B, T, H, D_k)`` against heads-first ``k (B, H,
    T, D_k)`` and ``v (B, H, T, D_v)``; return it heads first in their dtype."""
    b, h, t, dk = v.shape[0], v.shape[1], v.shape[2], k.shape[3]
    if g.shape != (b, t, h, dk):
        raise ValueError(
            f"g must have shape (B, T, H, D_k) = {(b, t, h, dk)}, got {tuple(g.shape)}"
        )
    lo, hi = GATE_RANGES["g"]
    if not torch.compiler.is_compiling() and bool(
        (~torch.isfinite(g) | (g < lo) | (g > hi)).any()
    ):
        raise ValueError(
            f"g must be finite and <= {hi:g}, got values in "
            f"[{g.min().item():g}, {g.max().item():g}]"
        )
    return g.to(v.dtype).transpose(1, 2)  # (B, H, T, D_k)


def recurrent_kda(
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
    """Reference KDA: decay each state row by ``exp(g_t)`` (``g (B, T, H, D_k)``), then
    one delta-rule step; ``o_t = S_tᵀ q_t``."""
    dtype = q.dtype
    q, k, v, (beta,), s = heads_first(
        q, k, v, {"beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    o, s = delta_rule_loop(q, k, v, _channel_gate_first(g, k, v), beta, s)
    return heads_last(o, s, dtype, output_final_state)


def chunk_kda(
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
    """Chunkwise KDA (Kimi Linear): per-channel log-decay ``g (B, T, H, D_k) ≤ 0``.
    The pairwise decays take ``C²·D_k`` numbers per chunk and head (a ``C × C`` matrix
    for the per-head gate)."""
    check_chunk_size(chunk_size)
    dtype, t = q.dtype, q.shape[1]
    q, k, v, (beta,), s = heads_first(
        q, k, v, {"beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    g = _channel_gate_first(g, k, v)
    o, s = delta_rule_chunks(q, k, v, g, beta, s, min(chunk_size, t))
    return heads_last(o, s, dtype, output_final_state)
