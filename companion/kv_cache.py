"""KV caches for decoding: a preallocated cache and a sliding-window ring buffer (chapters 08, 09).

Shape legend: B batch, H_kv key/value heads, S_max capacity, W window, T new tokens, D head
width. Both caches are modules whose buffers are allocated once and written in place. They
are *position-indexed*, as in gpt-fast: ``update(input_pos, k, v)`` writes the new tokens at
their positions and returns the keys and values attention should read with, for each key
slot, the absolute position it holds (``-1``: still empty), from which
:func:`position_mask` builds the mask. A cache keeps no count of its own; the positions are
the caller's (:class:`companion.model.DecodeCache` counts for a whole model), so a decode
step has the same shapes at every position and can be compiled once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["KVCache", "SlidingWindowCache", "position_mask"]


def position_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """``(T, S)`` bool: key j is visible to query i if it exists, is not in the future and,
    with a window W, is one of the W most recent positions (the query's own included)."""
    q, k = q_pos[:, None], k_pos[None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask


class KVCache(nn.Module):
    """Keys and values of every position so far, in a buffer sized ``max_len`` up front.

    Slot p holds position p; ``update`` returns the whole buffer, so its shapes never change.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        shape = (batch, n_kv_heads, max_len)
        self.register_buffer("k", torch.zeros(*shape, head_dim, dtype=dtype, device=device))
        self.register_buffer(
            "v", torch.zeros(*shape, value_dim or head_dim, dtype=dtype, device=device)
        )
        self.register_buffer("pos", torch.full((max_len,), -1, device=device), persistent=False)

    def update(self, input_pos: Tensor, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, ...]:
        """Write ``(B, H_kv, T, D)`` at slots ``input_pos (T,)``; return all keys, values and
        the position each slot holds."""
        self.k.index_copy_(2, input_pos, k_new.to(self.k.dtype))
        self.v.index_copy_(2, input_pos, v_new.to(self.v.dtype))
        self.pos.index_copy_(0, input_pos, input_pos)
        return self.k, self.v, self.pos


class SlidingWindowCache(nn.Module):
    """The last ``window`` keys and values in a ring buffer: memory capped at W positions."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        window: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.window = window
        shape = (batch, n_kv_heads, window)
        self.register_buffer("k", torch.zeros(*shape, head_dim, dtype=dtype, device=device))
        self.register_buffer(
            "v", torch.zeros(*shape, value_dim or head_dim, dtype=dtype, device=device)
        )
        self.register_buffer("pos", torch.full((window,), -1, device=device), persistent=False)

    def update(self, input_pos: Tensor, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, ...]:
        """Store the new keys at slots ``position mod W``; return what the new queries must
        read, with positions.

        One new token: write it into its slot, then the ring holds exactly the keys it may
        see. Several (a prefill): the early ones need keys the ring is about to overwrite,
        so attention reads the old ring and the new keys side by side; then the ring keeps
        the last W.
        """
        k_new, v_new = k_new.to(self.k.dtype), v_new.to(self.v.dtype)
        if input_pos.numel() == 1:
            slot = input_pos % self.window
            self.k.index_copy_(2, slot, k_new)
            self.v.index_copy_(2, slot, v_new)
            self.pos.index_copy_(0, slot, input_pos)
            return self.k, self.v, self.pos
        k_all = torch.cat([self.k, k_new], dim=2)
        v_all = torch.cat([self.v, v_new], dim=2)
        pos_all = torch.cat([self.pos, input_pos])
        keep = min(input_pos.numel(), self.window)
        slots = input_pos[-keep:] % self.window
        self.k[:, :, slots] = k_new[:, :, -keep:]
        self.v[:, :, slots] = v_new[:, :, -keep:]
        self.pos[slots] = input_pos[-keep:]
        return k_all, v_all, pos_all
