"""Top-k sparse attention: every query reads only the K keys chosen for it (DeepSeek
Sparse Attention, DeepSeek-V3.2 and GLM-5).

Shape legend: B batch, H query heads, H_kv key/value heads (H a multiple of H_kv; 1 in
MLA's absorbed form, where one latent head serves every query head), G = H / H_kv, T
queries, S keys, K keys selected per query, D query/key width, Dv value width.

``indices (B, T, K)`` (int64 or int32) name the keys query t may read, one selection
per token shared by all heads, as DSA's lightning indexer makes it; ``-1`` marks an
empty slot (a query with fewer than K visible keys). Within a row the indices must be
distinct and lie in ``[-1, S)``. The selection is the whole mask: causality, padding
and windows are whatever the selector already obeyed.

* :func:`masked_sparse_attention`, the reference: the full ``(T, S)`` score matrix in
  fp32 with the keys not selected set to -inf, then the usual softmax. O(T·S) work and
  memory, as transformers' eager DSA computes it.
* :func:`gather_sparse_attention`, the fast form: gathers the K selected key and value
  rows of each query and attends over those alone, O(T·K). Scores of one query are
  never compared with keys it did not select.

Both return ``(B, H, T, Dv)``; a query with no selected key outputs zeros.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from companion.ops.grouped import expand_kv

__all__ = [
    "SPARSE_IMPLS",
    "gather_sparse_attention",
    "masked_sparse_attention",
    "selection_mask",
    "sparse_attention",
]

SPARSE_IMPLS = ("masked", "gather")


def check_sparse(q: Tensor, k: Tensor, v: Tensor, indices: Tensor) -> None:
    """Raise a ValueError naming the argument whose shape or dtype does not fit."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape (B, H, T, D), got {tuple(x.shape)}"
            )
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[:3] != v.shape[:3] or h % k.shape[1]:
        raise ValueError(
            f"k and v must be (B, H_kv, S, ·) with H a multiple of H_kv; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[-1] != d:
        raise ValueError(f"q and k must share D; got q D={d}, k D={k.shape[-1]}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices must be int64 or int32, got dtype {indices.dtype}")
    if indices.ndim != 3 or tuple(indices.shape[:2]) != (b, t):
        raise ValueError(
            f"indices must have shape (B, T, K) = ({b}, {t}, K), got {tuple(indices.shape)}"
        )


def selection_mask(indices: Tensor, n_keys: int) -> Tensor:
    """``(B, T, S)`` bool, True at the selected keys (``-1`` slots select nothing)."""
    slot = torch.where(indices >= 0, indices.long(), n_keys)  # -1 -> an extra column
    hit = torch.zeros(
        *indices.shape[:2], n_keys + 1, dtype=torch.bool, device=indices.device
    )
    return hit.scatter_(-1, slot, True)[..., :n_keys]


def masked_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, scale: float | None = None
) -> Tensor:
    """softmax over the selected keys of the full score matrix, in fp32: ``(B, H, T,
    Dv)``."""
    check_sparse(q, k, v, indices)
    b, h, t, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = expand_kv(k, h).float(), expand_kv(v, h).float()  # (B, H, S, ·)
    chosen = selection_mask(indices, k.shape[2])[:, None]  # (B, 1, T, S)
    scores = (q.float() @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    scores = scores.masked_fill(~chosen, float("-inf"))
    has_key = chosen.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key
    out = weights @ v  # (B, H, T, Dv)
    assert out.shape == (b, h, t, v.shape[-1])
    return out.to(q.dtype)


def gather_rows(x: Tensor, indices: Tensor) -> Tensor:
    """The rows ``x[b, :, indices[b, t, j]]`` of ``x (B, H_kv, S, D)``: ``(B, H_kv, T,
    K, D)``; ``-1`` gathers row 0 (the caller masks it)."""
    b, hk, _, d = x.shape
    _, t, kk = indices.shape
    flat = indices.clamp(min=0).long().reshape(b, 1, t * kk, 1).expand(b, hk, t * kk, d)
    return x.gather(2, flat).view(b, hk, t, kk, d)


def gather_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, scale: float | None = None
) -> Tensor:
    """The same attention over only the gathered K keys per query: ``(B, H, T,
    Dv)``."""
    check_sparse(q, k, v, indices)
    b, h, t, d = q.shape
    hk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    valid = (indices >= 0)[:, None, None]  # (B, 1, 1, T, K)
    k_sel, v_sel = (
        gather_rows(k, indices),
        gather_rows(v, indices),
    )  # (B, H_kv, T, K, ·)
    rows = q.view(b, hk, h // hk, t, d)  # head h = kv·G + g, as expand_kv repeats
    scores = (
        torch.einsum("bzgtd,bztkd->bzgtk", rows, k_sel) * scale
    )  # (B, H_kv, G, T, K)
    has_key = valid.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~(valid | ~has_key), float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)
    weights = (torch.softmax(scores.to(acc), dim=-1) * has_key).to(v.dtype)
    out = torch.einsum("bzgtk,bztkv->bzgtv", weights, v_sel)  # (B, H_kv, G, T, Dv)
    return out.reshape(b, h, t, v.shape[-1])


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    *,
    scale: float | None = None,
    impl: str = "masked",
) -> Tensor:
    """``(B, H, T, Dv)`` from the form ``impl`` names: ``"masked"`` (the reference) or
    ``"gather"``."""
    if impl == "masked":
        return masked_sparse_attention(q, k, v, indices, scale=scale)
    if impl == "gather":
        return gather_sparse_attention(q, k, v, indices, scale=scale)
    raise ValueError(f"impl must be one of {SPARSE_IMPLS}, got {impl!r}")
