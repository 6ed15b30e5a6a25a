"""DeepSeek-V4 attention's decoding state: buffers allocated once, indexed by position.

Shape legend: B batch, T new tokens, D head width, W window, S_w = min(W, max_len) ring
slots, m compression ratio, S_src source slots (m, or 2m with overlap), R_w source row
width (D, or 2D with overlap), N = max_len // m compressed entries.

Like the KV caches of :mod:`companion.layers.kv_cache` these keep no count: the caller
passes the positions of the new tokens, and what each slot holds follows from them.
A layer's :class:`CompressedAttentionCache` holds its window ring and, for CSA and HCA,
one :class:`CompressorState` per compressor (the layer's and, for CSA, the indexer's).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["CompressedAttentionCache", "CompressorState"]


class CompressorState(nn.Module):
    """What a compressor keeps while decoding.

    ``kv, gate (B, S_src, R_w)``: the source rows of the latest S_src positions, position
    p in slot ``p mod S_src`` (with overlap S_src = 2m, so the block before the open one
    is still there); ``entries (B, N, D)``: entry w in row w, written when block w
    completes.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        ratio: int,
        row_width: int,
        entry_width: int,
        *,
        overlap: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.slots = (2 if overlap else 1) * ratio
        kw = {"dtype": dtype, "device": device}
        self.register_buffer("kv", torch.zeros(batch, self.slots, row_width, **kw))
        self.register_buffer("gate", torch.zeros(batch, self.slots, row_width, **kw))
        self.register_buffer(
            "entries", torch.zeros(batch, max_len // ratio, entry_width, **kw)
        )


class CompressedAttentionCache(nn.Module):
    """A V4 layer's decoding state, allocated once: ``kv (B, S_w, D)`` the last S_w =
    min(W, max_len) keys in a ring (position p in slot p mod S_w), ``pos (S_w,)`` the
    position each slot holds (−1: empty), and the states of the compressor and the
    indexer (None where the layer has none)."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        window: int,
        head_dim: int,
        *,
        compressor: CompressorState | None = None,
        indexer: CompressorState | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.max_len, self.slots = max_len, min(window, max_len)
        self.register_buffer(
            "kv", torch.zeros(batch, self.slots, head_dim, dtype=dtype, device=device)
        )
        self.register_buffer(
            "pos", torch.full((self.slots,), -1, device=device), persistent=False
        )
        self.compressor, self.indexer = compressor, indexer

    def update(self, positions: Tensor, kv_new: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``kv_new (B, T, D)`` at slots ``positions mod S_w``; return the keys the
        new queries read and their positions: the old ring beside the new keys (the
        ring after the write, for one token)."""
        kv_new = kv_new.to(self.kv.dtype)
        if positions.numel() == 1:
            slot = positions % self.slots
            self.kv.index_copy_(1, slot, kv_new)
            self.pos.index_copy_(0, slot, positions)
            return self.kv, self.pos
        kv_all = torch.cat([self.kv, kv_new], dim=1)
        pos_all = torch.cat([self.pos, positions])
        keep = min(positions.numel(), self.slots)
        slots = positions[-keep:] % self.slots
        self.kv[:, slots] = kv_new[:, -keep:]
        self.pos[slots] = positions[-keep:]
        return kv_all, pos_all
