"""KV caches for decoding: a preallocated cache and a sliding-window ring buffer (chapters 08, 09).

Shape legend: B batch, H_kv key/value heads, S_max capacity, W window, T new tokens, D head
width. Both caches are modules whose buffers are allocated once and written in place at
the positions of the new tokens; ``update`` returns the keys and values attention should
read and, for each key, its absolute position (``-1`` marks an empty slot), from which
:func:`position_mask` builds the mask.
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
    """Keys and values of every position so far, in a buffer sized ``max_len`` up front."""

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
        self.max_len, self.length = max_len, 0
        shape = (batch, n_kv_heads, max_len)
        self.register_buffer("k", torch.zeros(*shape, head_dim, dtype=dtype, device=device))
        self.register_buffer(
            "v", torch.zeros(*shape, value_dim or head_dim, dtype=dtype, device=device)
        )
        self.register_buffer("pos", torch.arange(max_len, device=device), persistent=False)

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write ``(B, H_kv, T, D)`` at the next T slots; return all keys, values, positions."""
        start, t = self.length, k_new.shape[2]
        if start + t > self.max_len:
            raise ValueError(
                f"KV cache is full: {start} + {t} tokens exceed max_len={self.max_len}; "
                "make the cache with a larger max_len"
            )
        self.k[:, :, start : start + t] = k_new
        self.v[:, :, start : start + t] = v_new
        self.length = start + t
        end = self.length
        return self.k[:, :, :end], self.v[:, :, :end], self.pos[:end]


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
        self.window, self.length = window, 0
        shape = (batch, n_kv_heads, window)
        self.register_buffer("k", torch.zeros(*shape, head_dim, dtype=dtype, device=device))
        self.register_buffer(
            "v", torch.zeros(*shape, value_dim or head_dim, dtype=dtype, device=device)
        )
        self.register_buffer("pos", torch.full((window,), -1, device=device), persistent=False)

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store the new keys; return what the new queries must read, with positions.

        One new token: write it into its slot, then the ring holds exactly the keys it may
        see. Several (a prefill): the early ones need keys the ring is about to overwrite,
        so attention reads the old ring and the new keys side by side; then the ring keeps
        the last W.
        """
        start, t = self.length, k_new.shape[2]
        new_pos = torch.arange(start, start + t, device=self.pos.device)
        if t == 1:
            slot = start % self.window
            self.k[:, :, slot] = k_new[:, :, 0]
            self.v[:, :, slot] = v_new[:, :, 0]
            self.pos[slot] = start
            self.length += 1
            return self.k, self.v, self.pos
        k_all = torch.cat([self.k, k_new], dim=2)
        v_all = torch.cat([self.v, v_new], dim=2)
        pos_all = torch.cat([self.pos, new_pos])
        keep = min(t, self.window)
        slots = new_pos[-keep:] % self.window
        self.k[:, :, slots] = k_new[:, :, -keep:]
        self.v[:, :, slots] = v_new[:, :, -keep:]
        self.pos[slots] = new_pos[-keep:]
        self.length += t
        return k_all, v_all, pos_all
