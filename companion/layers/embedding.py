"""What every model does at its input: token embeddings, the √d scale, absolute
positions; and GPT-2's initialisation (chapters 02-04)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["embed_tokens", "embedding_params", "normal_init"]


def embed_tokens(
    tok_emb: nn.Embedding,
    pos_emb: nn.Module | None,
    ids: Tensor,
    positions: Tensor | None = None,
    *,
    scale: float | None = None,
) -> Tensor:
    """``tok_emb(ids)`` times ``scale`` (in the embeddings' dtype, as Gemma does; None:
    no scale) plus ``pos_emb(positions)`` (default 0..T-1; None: no absolute positions):
    ``(B, T, d)``."""
    x = tok_emb(ids)
    if scale is not None:
        x = x * torch.tensor(scale, dtype=x.dtype, device=x.device)
    if pos_emb is not None:
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        x = x + pos_emb(positions)
    return x


def embedding_params(*tables: nn.Module | None) -> int:
    """The learned numbers in the given embedding tables (None, or a fixed table, is
    0)."""
    return sum(p.numel() for t in tables if t is not None for p in t.parameters())


def normal_init(m: nn.Module, std: float) -> None:
    """GPT-2's initialisation of one module: N(0, std) weights for linear layers and
    embeddings, zero biases. Use as ``model.apply(partial(normal_init, std=...))``."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=std)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
