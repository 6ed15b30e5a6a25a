"""KV caches for decoding: a preallocated cache, a sliding-window ring buffer (chapters
08, 09), MLA's latent cache (chapter 08) and, for DeepSeek Sparse Attention, the
lightning indexer's key cache and the pair of them one sparse MLA layer keeps.

Shape legend: B batch, H_kv key/value heads, S_max capacity, W window, T new tokens, D
head width. The caches are modules whose buffers are allocated once and written in
place. They are *position-indexed*, as in gpt-fast: ``update(input_pos, k, v)`` writes
the new tokens at their positions and returns the keys and values attention should read
with, for each key slot, the absolute position it holds (``-1``: still empty), from
which :func:`position_mask` builds the mask. A cache keeps no count of its own; the
positions are the caller's (:class:`companion.models.decoder.DecodeCache` counts for a
whole model), so a decode step has the same shapes at every position and can be compiled
once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.checks import check_cache_update
from companion.ops.masks import combine_masks

__all__ = [
    "IndexKeyCache",
    "KVCache",
    "LatentCache",
    "SlidingWindowCache",
    "SparseLatentCache",
    "attention_mask",
    "position_mask",
    "query_positions",
]


def attention_mask(
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    window: int | None,
    mask: Tensor | None,
    causal: bool,
) -> tuple[Tensor | None, bool]:
    """The mask and causal flag a layer attends with, given its queries' positions.

    With ``k_pos`` (what a cache's slots hold) the positions decide order and window,
    and the causal flag is off. Without, a window adds its band to ``mask`` and
    ``causal`` stays as the layer was built.
    """
    if k_pos is not None:
        return combine_masks(mask, position_mask(q_pos, k_pos, window)), False
    if window is not None:
        return combine_masks(mask, position_mask(q_pos, q_pos, window)), causal
    return mask, causal


def query_positions(
    x: Tensor, positions: Tensor | None, cache: object, *, needed: bool
) -> Tensor | None:
    """``positions (T,)`` of the tokens of ``x (B, T, ·)``: as given, else 0..T-1 where
    the layer needs them (RoPE, a window); decoding with a cache needs them given."""
    if positions is not None:
        return positions
    if cache is not None:
        raise ValueError("decoding with a cache needs the query positions (T,)")
    return torch.arange(x.shape[1], device=x.device) if needed else None


def position_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """``(T, S)`` bool: key j is visible to query i if it exists, is not in the future
    and, with a window W, is one of the W most recent positions (the query's own
    included)."""
    q, k = q_pos[:, None], k_pos[None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask


def _checked(update: Callable[..., tuple[Tensor, ...]]) -> Callable[..., tuple]:
    """``update`` preceded by its cache's :meth:`check_update`, so a bad call raises
    before anything is written (``inspect.getsource`` still shows ``update`` itself)."""

    @functools.wraps(update)
    def checked_update(self: nn.Module, input_pos: Tensor, *new: Tensor) -> tuple:
        self.check_update(input_pos, *new)
        return update(self, input_pos, *new)

    return checked_update


class KVCache(nn.Module):
    """Keys and values of every position so far, in a buffer sized ``max_len`` up front.

    Slot p holds position p; ``update`` returns the whole buffer, so its shapes never
    change.
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
        self.register_buffer(
            "k", torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        )
        self.register_buffer(
            "v", torch.zeros(*shape, value_dim or head_dim, dtype=dtype, device=device)
        )
        self.register_buffer(
            "pos", torch.full((max_len,), -1, device=device), persistent=False
        )

    def check_update(self, input_pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
        """Raise an error naming the argument of :meth:`update` that does not fit."""
        new = {"k_new": (k_new, self.k), "v_new": (v_new, self.v)}
        check_cache_update(
            input_pos, new, axis=2, legend="(B, H_kv, T, D)", max_len=self.max_len
        )

    def update(
        self, input_pos: Tensor, k_new: Tensor, v_new: Tensor
    ) -> tuple[Tensor, ...]:
        """Write ``(B, H_kv, T, D)`` at slots ``input_pos (T,)``; return all keys,
        values and the position each slot holds."""
        self.k.index_copy_(2, input_pos, k_new.to(self.k.dtype))
        self.v.index_copy_(2, input_pos, v_new.to(self.v.dtype))
        self.pos.index_copy_(0, input_pos, input_pos)
        return self.k, self.v, self.pos


class SlidingWindowCache(KVCache):
    """The last ``window`` keys and values in a ring buffer: memory capped at W
    positions.

    The buffers are a :class:`KVCache`'s with W slots; only ``update`` differs.
    """

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
        kw = {"value_dim": value_dim, "dtype": dtype, "device": device}
        super().__init__(batch, n_kv_heads, window, head_dim, **kw)
        self.window = window

    def check_update(self, input_pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
        """As :meth:`KVCache.check_update`, any position >= 0 (the ring wraps)."""
        new = {"k_new": (k_new, self.k), "v_new": (v_new, self.v)}
        check_cache_update(
            input_pos, new, axis=2, legend="(B, H_kv, T, D)", max_len=None
        )

    def update(
        self, input_pos: Tensor, k_new: Tensor, v_new: Tensor
    ) -> tuple[Tensor, ...]:
        """Store the new keys at slots ``position mod W``; return what the new queries
        must read, with positions.

        One new token: write it into its slot, then the ring holds exactly the keys it
        may see. Several (a prefill): the early ones need keys the ring is about to
        overwrite, so attention reads the old ring and the new keys side by side; then
        the ring keeps the last W.
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


# the displayed updates (chapters 08, 09) keep their text; the checks run before them
KVCache.update = _checked(KVCache.update)
SlidingWindowCache.update = _checked(SlidingWindowCache.update)


class LatentCache(nn.Module):
    """The normalised latent and the RoPE'd shared key of every position so far.

    One row per token, ``[c | k_rope]`` (C + R numbers, as FlashMLA and vLLM store it),
    in a buffer preallocated for ``max_len`` positions; ``update`` writes rows at their
    positions and returns the whole buffer with the position each row holds (``-1``:
    empty), like :class:`KVCache`. The absorbed form reads the rows as its keys and
    their first C channels as its values, so a decode step copies nothing.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        width = kv_lora_rank + qk_rope_head_dim
        self.register_buffer(
            "kv", torch.zeros(batch, max_len, width, dtype=dtype, device=device)
        )
        self.register_buffer(
            "pos", torch.full((max_len,), -1, device=device), persistent=False
        )

    def update(self, input_pos: Tensor, kv_new: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``(B, T, C+R)`` at rows ``input_pos (T,)``; return all rows ``(B, S,
        C+R)`` and their positions ``(S,)``."""
        new = {"kv_new": (kv_new, self.kv)}
        check_cache_update(
            input_pos, new, axis=1, legend="(B, T, C+R)", max_len=self.max_len
        )
        self.kv.index_copy_(1, input_pos, kv_new.to(self.kv.dtype))
        self.pos.index_copy_(0, input_pos, input_pos)
        return self.kv, self.pos


class IndexKeyCache(nn.Module):
    """The lightning indexer's key of every position so far: one head of width D_I.

    A buffer ``k (B, S_max, D_I)`` preallocated for ``max_len`` positions; ``update``
    writes rows at their positions and returns all rows with the position each holds
    (``-1``: empty), like :class:`LatentCache`.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.register_buffer(
            "k", torch.zeros(batch, max_len, head_dim, dtype=dtype, device=device)
        )
        self.register_buffer(
            "pos", torch.full((max_len,), -1, device=device), persistent=False
        )

    def update(self, input_pos: Tensor, k_new: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``(B, T, D_I)`` at rows ``input_pos (T,)``; return all rows ``(B, S,
        D_I)`` and their positions ``(S,)``."""
        self.k.index_copy_(1, input_pos, k_new.to(self.k.dtype))
        self.pos.index_copy_(0, input_pos, input_pos)
        return self.k, self.pos


class SparseLatentCache(nn.Module):
    """What one DSA layer (MLA with a lightning indexer) keeps: its :class:`LatentCache`
    and its indexer's :class:`IndexKeyCache`, both indexed by position.

    ``update`` is the latent cache's, so the MLA code reads it as it reads a plain
    :class:`LatentCache`; the indexer reads and writes ``index``.
    """

    def __init__(self, latent: LatentCache, index: IndexKeyCache) -> None:
        super().__init__()
        if latent.max_len != index.max_len:
            raise ValueError(
                f"latent and index must hold the same positions, got max_len "
                f"{latent.max_len} and {index.max_len}"
            )
        self.latent, self.index = latent, index
        self.max_len = latent.max_len

    def update(self, input_pos: Tensor, kv_new: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`LatentCache.update` of the latent rows."""
        return self.latent.update(input_pos, kv_new)
