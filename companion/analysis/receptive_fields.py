"""Sliding windows through depth: masks per layer, receptive fields, input gradients
(chapter 09).

Shape legend: L layers, T positions (queries and keys of one sequence), w window, d
model width. The window convention is :func:`companion.layers.kv_cache.position_mask`'s:
a query at position i of a sliding layer sees keys i − w + 1 … i, its own position
included, so one local layer reaches w − 1 positions back and L of them reach L·(w − 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from companion.checks import check_int
from companion.layers.kv_cache import position_mask

__all__ = [
    "input_gradient_norms",
    "layer_masks",
    "receptive_field_size",
    "receptive_fields",
    "visible_pairs",
]

_KINDS = ("full", "sliding")


def visible_pairs(seq_len: int, window: int | None = None) -> int:
    """(query, key) pairs a causal mask over ``seq_len`` positions allows.

    Full: s(s + 1)/2. With a window w: query i sees min(i + 1, w) keys, which sums to
    s·w − w(w − 1)/2 once s ≥ w: linear in s instead of quadratic.
    """
    check_int("seq_len", seq_len, 1)
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    check_int("window", window, 1)
    return seq_len * window - window * (window - 1) // 2


def layer_masks(
    kinds: Sequence[str],
    window: int | None,
    seq_len: int,
    device: torch.device | str | None = None,
) -> Tensor:
    """``(L, T, T)`` bool: layer l's self-attention mask, causal, and within the last
    ``window`` positions where ``kinds[l] == "sliding"``."""
    check_int("seq_len", seq_len, 1)
    bad = sorted(set(kinds) - set(_KINDS))
    if bad:
        raise ValueError(f"kinds entries must be one of {_KINDS}, got {bad}")
    if "sliding" in kinds:
        if window is None:
            raise ValueError("kinds has 'sliding' layers but window is None")
        check_int("window", window, 1)
    pos = torch.arange(seq_len, device=device)
    masks = [position_mask(pos, pos, window if k == "sliding" else None) for k in kinds]
    if not masks:
        return torch.zeros(0, seq_len, seq_len, dtype=torch.bool, device=device)
    return torch.stack(masks)  # (L, T, T)


def receptive_fields(masks: Tensor) -> Tensor:
    """``(L + 1, T, T)`` bool: ``fields[l, i, j]`` is True if input position j can
    change position i's hidden state after the first l layers (``fields[0]`` is the
    identity).

    Attention moves information along the mask and the residual stream keeps each
    position's own, so the fields compose as a boolean matrix product: F_l = M_l ·
    F_(l−1).
    """
    if masks.ndim != 3 or masks.shape[1] != masks.shape[2] or masks.dtype != torch.bool:
        raise ValueError(
            "masks must be a bool (L, T, T) tensor, "
            f"got {masks.dtype} {tuple(masks.shape)}"
        )
    t = masks.shape[1]
    field = torch.eye(t, dtype=torch.bool, device=masks.device)
    fields = [field]
    for m in masks:  # m: (T, T)
        field = (m.float() @ field.float()) > 0
        fields.append(field)
    return torch.stack(fields)  # (L + 1, T, T)


def receptive_field_size(n_layers: int, window: int) -> int:
    """Input positions that reach a token through ``n_layers`` local layers of window w,
    its own included, when the context is long enough: L·(w − 1) + 1."""
    check_int("n_layers", n_layers, 1)
    check_int("window", window, 1)
    return n_layers * (window - 1) + 1


def input_gradient_norms(
    model: nn.Module,
    ids: Tensor,
    query: int = -1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``(T,)``: for each input position j, ‖∂(r · logits[0, query]) / ∂x_j‖, with x the
    token embeddings (the output of ``model.tok_emb``) and r a random direction over the
    vocabulary.

    Exactly zero where position j cannot reach ``query`` (masked attention weights are
    exact zeros, forward and backward, with ``attn_impl="reference"``).
    """
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape (1, T), got {tuple(ids.shape)}")
    captured: list[Tensor] = []

    def keep(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = (
            out.detach().requires_grad_()
        )  # a leaf: the gradient stops here, weights untouched
        captured.append(x)
        return x

    handle = model.tok_emb.register_forward_hook(keep)
    try:
        logits = model(ids)  # (1, T, V)
    finally:
        handle.remove()
    r = torch.randn(logits.shape[-1], generator=generator).to(logits)
    (grad,) = torch.autograd.grad(logits[0, query] @ r, captured[0])
    return grad[0].norm(dim=-1)  # (T,)
