"""Quantised KV caches (chapter 16): the caches of :mod:`companion.layers.kv_cache`
holding each cached number in one byte, int8 or fp8 (e4m3), with one scale per row.

Shape legend: B batch, H_kv key/value heads, S_max capacity, W window, T new tokens, D
head width, C+R an MLA latent row. A *row* is what one token adds to one head: a key
``(D,)``, a value, or an MLA latent row ``[c | k_rope]`` ``(C+R,)``. Each row keeps one
scale, its absolute maximum over the format's largest value (127 for int8, 448 for
e4m3), stored in fp32 (``SCALE_BYTES``): a row of D = 64 then costs 64 + 4 bytes
instead of 256. fp32 keeps the error bound exact (the scale itself is not rounded); a
half-precision scale would halve the overhead at the price of one more rounding.

Why per token rather than per-channel keys, as KIVI (Liu et al., 2024) and KVQuant
(Hooper et al., 2024) quantise them: a channel's scale needs a group of tokens before it
can be computed, but a decoding cache must serve the token it has just written, so each
row is quantised alone, the moment it arrives. The caches follow the same protocol as the
plain ones (``update`` writes rows at their positions and returns every key and value
with the position each slot holds) and dequantise on read to the compute dtype; a real
kernel would fuse the dequantisation into attention instead of materialising the keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.checks import check_cache_update, check_choice
from companion.layers.kv_cache import KVCache, LatentCache, SlidingWindowCache

__all__ = [
    "FORMATS",
    "SCALE_BYTES",
    "QuantizedKVCache",
    "QuantizedLatentCache",
    "QuantizedSlidingWindowCache",
    "dequantize_rows",
    "quantize_cache",
    "quantize_rows",
    "stored_bytes",
]

# format -> (storage dtype, the largest value a row's absmax maps to)
FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # bytes of the one scale each cached row keeps


def quantize_rows(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """Codes ``(..., D)`` in ``fmt``'s one-byte dtype and one fp32 scale per row
    ``(...)``: the row's absmax maps to the format's largest value (a zero row stays
    zero)."""
    dtype, top = FORMATS[fmt]
    x = x.float()
    scale = x.abs().amax(dim=-1) / top
    y = x / scale.clamp_min(torch.finfo(SCALE_DTYPE).tiny)[..., None]
    if fmt == "int8":
        return y.round().clamp(-top, top).to(dtype), scale
    return y.clamp(-top, top).to(dtype), scale  # e4m3: round to 3 mantissa bits


def dequantize_rows(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows back in ``dtype``: codes times their row's scale."""
    return (codes.float() * scale[..., None]).to(dtype)


def _put(buf: Tensor, dim: int, index: Tensor, codes: Tensor) -> None:
    """``buf.index_copy_`` of one-byte codes, through a uint8 view of both (the CPU has
    no ``index_copy_`` for float8)."""
    buf.view(torch.uint8).index_copy_(dim, index, codes.view(torch.uint8))


class _QuantizedRows:
    """Buffers ``k_q, v_q (B, H_kv, S, D)`` of codes and ``k_scale, v_scale (B, H_kv,
    S)``, read back as ``k`` and ``v`` in the compute dtype."""

    def _allocate(self, shape: tuple[int, ...], d: int, dv: int, **kw) -> None:
        fmt, device = kw["fmt"], kw["device"]
        check_choice("fmt", fmt, tuple(FORMATS))
        self.fmt, self.dtype = fmt, kw["dtype"]
        for name, width in (("k", d), ("v", dv)):
            codes = torch.zeros(*shape, width, dtype=FORMATS[fmt][0], device=device)
            scale = torch.zeros(shape, dtype=SCALE_DTYPE, device=device)
            self.register_buffer(f"{name}_q", codes)
            self.register_buffer(f"{name}_scale", scale)
        pos = torch.full((shape[-1],), -1, device=device)
        self.register_buffer("pos", pos, persistent=False)

    def layout(self, name: str) -> Tensor:
        """What buffer ``name`` (``k`` or ``v``) reads as: its shape, compute dtype and
        device, with nothing dequantised or allocated (the layers' cache checks)."""
        codes = getattr(self, f"{name}_q")
        one = torch.empty((), dtype=self.dtype, device=codes.device)
        return one.expand(codes.shape)

    @property
    def k(self) -> Tensor:
        """Every slot's key ``(B, H_kv, S, D)``, dequantised to the compute dtype."""
        return dequantize_rows(self.k_q, self.k_scale, self.dtype)

    @property
    def v(self) -> Tensor:
        """Every slot's value, dequantised to the compute dtype."""
        return dequantize_rows(self.v_q, self.v_scale, self.dtype)

    def check_update(self, input_pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
        """Raise an error naming the argument of ``update`` that does not fit."""
        new = {"k_new": (k_new, self.k_q), "v_new": (v_new, self.v_q)}
        ring = isinstance(self, SlidingWindowCache)
        max_len = None if ring else self.max_len
        check_cache_update(
            input_pos, new, axis=2, legend="(B, H_kv, T, D)", max_len=max_len
        )

    def _store(self, slots: Tensor, rows: tuple[Tensor, Tensor], keep: int) -> None:
        """Write the last ``keep`` new rows (codes, scale) of k then v at ``slots``."""
        for name, (codes, scale) in zip(("k", "v"), rows, strict=True):
            _put(getattr(self, f"{name}_q"), 2, slots, codes[:, :, -keep:])
            getattr(self, f"{name}_scale").index_copy_(2, slots, scale[:, :, -keep:])


class QuantizedKVCache(_QuantizedRows, KVCache):
    """A :class:`~companion.layers.kv_cache.KVCache` whose keys and values are stored
    as one-byte codes (``fmt`` "int8" or "fp8") with one fp32 scale per row."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        fmt: str = "int8",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.max_len = max_len
        shape, dv = (batch, n_kv_heads, max_len), value_dim or head_dim
        self._allocate(shape, head_dim, dv, fmt=fmt, dtype=dtype, device=device)

    def update(
        self, input_pos: Tensor, k_new: Tensor, v_new: Tensor
    ) -> tuple[Tensor, ...]:
        """Quantise ``(B, H_kv, T, D)`` into slots ``input_pos (T,)``; return all keys
        and values, dequantised, and the position each slot holds."""
        self.check_update(input_pos, k_new, v_new)
        k_codes, k_scale = quantize_rows(k_new, self.fmt)
        v_codes, v_scale = quantize_rows(v_new, self.fmt)
        _put(self.k_q, 2, input_pos, k_codes)
        _put(self.v_q, 2, input_pos, v_codes)
        self.k_scale.index_copy_(2, input_pos, k_scale)
        self.v_scale.index_copy_(2, input_pos, v_scale)
        self.pos.index_copy_(0, input_pos, input_pos)
        return self.k, self.v, self.pos  # k, v: dequantize_rows of codes and scales


class QuantizedSlidingWindowCache(_QuantizedRows, SlidingWindowCache):
    """A :class:`~companion.layers.kv_cache.SlidingWindowCache` (a ring of W slots)
    stored as :class:`QuantizedKVCache` stores its rows."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        window: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        fmt: str = "int8",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.max_len = self.window = window
        shape, dv = (batch, n_kv_heads, window), value_dim or head_dim
        self._allocate(shape, head_dim, dv, fmt=fmt, dtype=dtype, device=device)

    def update(
        self, input_pos: Tensor, k_new: Tensor, v_new: Tensor
    ) -> tuple[Tensor, ...]:
        """As the plain ring's ``update``: a prefill reads the old ring and the new rows
        (quantised and back) side by side, then the ring keeps the last W."""
        self.check_update(input_pos, k_new, v_new)
        rows = quantize_rows(k_new, self.fmt), quantize_rows(v_new, self.fmt)
        t, seen = input_pos.numel(), None
        if t > 1:
            new = [dequantize_rows(c, s, self.dtype) for c, s in rows]
            seen = (torch.cat([self.k, new[0]], dim=2),
                    torch.cat([self.v, new[1]], dim=2),
                    torch.cat([self.pos, input_pos]))  # fmt: skip
        keep = min(t, self.window)
        slots = input_pos[-keep:] % self.window
        self._store(slots, rows, keep)
        self.pos.index_copy_(0, slots, input_pos[-keep:])
        return seen or (self.k, self.v, self.pos)


class QuantizedLatentCache(LatentCache):
    """A :class:`~companion.layers.kv_cache.LatentCache` whose rows ``[c | k_rope]``
    are stored as one-byte codes with one fp32 scale per token."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        *,
        fmt: str = "int8",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        nn.Module.__init__(self)
        check_choice("fmt", fmt, tuple(FORMATS))
        self.max_len, self.fmt, self.dtype = max_len, fmt, dtype
        width = kv_lora_rank + qk_rope_head_dim
        codes = torch.zeros(batch, max_len, width, dtype=FORMATS[fmt][0], device=device)
        self.register_buffer("kv_q", codes)
        scale = torch.zeros(batch, max_len, dtype=SCALE_DTYPE, device=device)
        self.register_buffer("kv_scale", scale)
        pos = torch.full((max_len,), -1, device=device)
        self.register_buffer("pos", pos, persistent=False)

    @property
    def kv(self) -> Tensor:
        """Every row ``(B, S_max, C+R)``, dequantised to the compute dtype."""
        return dequantize_rows(self.kv_q, self.kv_scale, self.dtype)

    def update(self, input_pos: Tensor, kv_new: Tensor) -> tuple[Tensor, Tensor]:
        """Quantise ``(B, T, C+R)`` into rows ``input_pos (T,)``; return all rows,
        dequantised, and their positions."""
        new = {"kv_new": (kv_new, self.kv_q)}
        check_cache_update(
            input_pos, new, axis=1, legend="(B, T, C+R)", max_len=self.max_len
        )
        codes, scale = quantize_rows(kv_new, self.fmt)
        _put(self.kv_q, 1, input_pos, codes)
        self.kv_scale.index_copy_(1, input_pos, scale)
        self.pos.index_copy_(0, input_pos, input_pos)
        return self.kv, self.pos


def _convert(cache: nn.Module, fmt: str) -> nn.Module:
    """The quantised cache of ``cache``'s kind and shape, holding its rows quantised."""
    kind = type(cache)
    if kind is LatentCache:
        b, s, w = cache.kv.shape
        kw = {"fmt": fmt, "dtype": cache.kv.dtype, "device": cache.kv.device}
        new = QuantizedLatentCache(b, s, w, 0, **kw)
        new.kv_q.copy_(quantize_rows(cache.kv, fmt)[0])
        new.kv_scale.copy_(quantize_rows(cache.kv, fmt)[1])
    elif kind in (KVCache, SlidingWindowCache):
        b, h, s, d = cache.k.shape
        make = QuantizedKVCache if kind is KVCache else QuantizedSlidingWindowCache
        kw = {"fmt": fmt, "dtype": cache.k.dtype, "device": cache.k.device}
        new = make(b, h, s, d, value_dim=cache.v.shape[-1], **kw)
        for name in ("k", "v"):
            codes, scale = quantize_rows(getattr(cache, name), fmt)
            getattr(new, f"{name}_q").copy_(codes)
            getattr(new, f"{name}_scale").copy_(scale)
    else:
        raise TypeError(
            "quantize_cache converts a KVCache, SlidingWindowCache or LatentCache, got "
            f"a {kind.__name__} (a layer whose cache has no quantised form here)"
        )
    new.pos.copy_(cache.pos)
    return new


def quantize_cache(fmt: str) -> Callable[[nn.Module], nn.Module]:
    """The converter for ``model.new_cache(batch, max_len, convert=...)``: each plain
    layer cache (also on the meta device) becomes its quantised kind in ``fmt``
    ("int8" or "fp8"); other kinds raise a TypeError naming them."""
    check_choice("fmt", fmt, tuple(FORMATS))

    def convert(cache: nn.Module) -> nn.Module:
        return _convert(cache, fmt)

    convert.__qualname__ = f"quantize_cache({fmt!r})"
    return convert


def stored_bytes(cache: nn.Module) -> int:
    """Bytes of a layer cache's rows and scales: every buffer but ``pos``, the slots'
    positions (one per slot, shared by the batch; the cache formulas leave it out)."""
    return sum(
        b.numel() * b.element_size()
        for n, b in cache.named_buffers()
        if n.rsplit(".", 1)[-1] != "pos"
    )
