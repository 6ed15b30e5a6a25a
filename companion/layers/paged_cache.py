"""A paged KV cache (chapter 16): one sequence's page table into a layer's
:class:`~companion.layers.page_pool.PagePool`, behind the caches' position-indexed
protocol, with prefix sharing by copy-on-write.

Shape legend: H_kv key/value heads, D head width, T new tokens, P slots per page, N
pages, S = (live pages)·P slots read. Logical page i of a sequence (positions i·P ..
i·P + P - 1) lives in physical page ``table[i]`` (``-1``: none). A
:class:`PagedKVCache` *is* a :class:`~companion.layers.kv_cache.KVCache` whose slot for
position p is ``table[p // P]·P + p % P`` instead of p, over the pool's ``k (1, H_kv,
N·P, D)``, so the attention layers take it unchanged. ``update`` allocates pages on
demand, writes, and returns the live pages' keys gathered in logical order with their
positions: a copy, the reference form; a paged-attention kernel reads the pages in
place through the table (PagedAttention, Kwon et al., 2023). Keeping the KVCache's
head-major buffer makes a page H_kv strided runs of P slots, where vLLM stores each page
in one block; the bookkeeping is the same. A sliding layer's pages that fall wholly out
of its window go back to the free list. :meth:`PageTable.fork` starts a second sequence
on the same pages (a shared prompt, as in SGLang, Zheng et al., 2024); the
first write into a shared page copies that page.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.checks import check_cache_update, check_int
from companion.layers.kv_cache import KVCache, LatentCache, SlidingWindowCache
from companion.layers.page_pool import PagePool

__all__ = [
    "PageTable",
    "PagedKVCache",
    "PagedLatentCache",
    "fork_cache",
    "paged",
    "release_cache",
]


class PageTable:
    """One sequence's page table into ``pool``; a sliding layer's ``window`` W frees
    pages it can no longer read. Mixed into the paged caches below."""

    pool: PagePool
    window: int | None
    table: list[int]

    @property
    def pages(self) -> list[int]:
        """The physical pages this sequence holds, in logical order."""
        return [p for p in self.table if p >= 0]

    def reserve(self, input_pos: Tensor) -> Tensor:
        """The pool slots ``(T,)`` of positions ``input_pos``: a page is allocated for
        each logical page not yet held, a shared one copied before its first write.
        Raises before any change if the pool is short."""
        size, table = self.pool.page_size, self.table
        pos = input_pos.tolist()
        if not pos:
            return input_pos
        logical = sorted({p // size for p in pos})
        held = [i for i in logical if i < len(table) and table[i] >= 0]
        shared = [i for i in held if self.pool.refs[table[i]] > 1]
        self.pool.need(len(logical) - len(held) + len(shared))
        table += [-1] * (logical[-1] + 1 - len(table))
        for i in logical:
            if table[i] < 0:
                table[i] = self.pool.allocate()
            elif i in shared:
                table[i] = self.pool.copy_on_write(table[i])
        page = torch.tensor([table[p // size] for p in pos], device=input_pos.device)
        return page * size + input_pos % size

    def slide(self, last: int) -> None:
        """Free the pages wholly before the window of the next query, at ``last + 1``:
        it reads positions from ``last + 2 - W`` on."""
        if self.window is None:
            return
        size = self.pool.page_size
        for i, page in enumerate(self.table):
            if page >= 0 and (i + 1) * size <= last + 2 - self.window:
                self.pool.release(page)
                self.table[i] = -1

    def read(self, input_pos: Tensor) -> Tensor:
        """The live slots in logical order ``(S,)``; then pages the next query cannot
        see are freed (the gather that reads them is a copy)."""
        slots = self.pool.slots(self.pages)
        if input_pos.numel():
            self.slide(int(input_pos.max()))
        return slots

    def fork(self) -> PageTable:
        """A second sequence that continues from this one: the same pages, each one
        reference more, nothing copied."""
        other = self.__class__(self.pool, window=self.window)
        other.table = list(self.table)
        for page in other.pages:
            self.pool.share(page)
        return other

    def release(self) -> None:
        """Drop every page this sequence holds (a page goes free at 0 references)."""
        for page in self.pages:
            self.pool.release(page)
        self.table = []


class PagedKVCache(PageTable, KVCache):
    """Keys and values of one sequence in pages of a
    :class:`~companion.layers.page_pool.PagePool` whose tensors are ``k, v (1, H_kv,
    N·P, D)``; ``max_len`` is the pool's N·P slots."""

    def __init__(self, pool: PagePool, *, window: int | None = None) -> None:
        nn.Module.__init__(self)
        self.pool, self.window, self.table = pool, window, []
        self.max_len = pool.n_pages * pool.page_size
        self.register_buffer("k", pool.tensors["k"][0])
        self.register_buffer("v", pool.tensors["v"][0])
        self.register_buffer("pos", pool.pos, persistent=False)

    def check_update(self, input_pos: Tensor, k_new: Tensor, v_new: Tensor) -> None:
        """Raise an error naming the argument of :meth:`update` that does not fit."""
        new = {"k_new": (k_new, self.k), "v_new": (v_new, self.v)}
        check_cache_update(
            input_pos, new, axis=2, legend="(1, H_kv, T, D)", max_len=None
        )

    def update(
        self, input_pos: Tensor, k_new: Tensor, v_new: Tensor
    ) -> tuple[Tensor, ...]:
        """Write ``(1, H_kv, T, D)`` at positions ``input_pos (T,)`` through the page
        table; return the live pages' keys, values ``(1, H_kv, S, D)`` and positions
        ``(S,)``."""
        self.check_update(input_pos, k_new, v_new)
        slots = self.reserve(input_pos)
        self.k.index_copy_(2, slots, k_new.to(self.k.dtype))
        self.v.index_copy_(2, slots, v_new.to(self.v.dtype))
        self.pos.index_copy_(0, slots, input_pos)
        read = self.read(input_pos)
        return self.k[:, :, read], self.v[:, :, read], self.pos[read]


class PagedLatentCache(PageTable, LatentCache):
    """MLA's latent rows of one sequence in pages of a
    :class:`~companion.layers.page_pool.PagePool` whose tensor is ``kv (1, N·P,
    C+R)``."""

    def __init__(self, pool: PagePool, *, window: int | None = None) -> None:
        nn.Module.__init__(self)
        self.pool, self.window, self.table = pool, window, []
        self.max_len = pool.n_pages * pool.page_size
        self.register_buffer("kv", pool.tensors["kv"][0])
        self.register_buffer("pos", pool.pos, persistent=False)

    def update(self, input_pos: Tensor, kv_new: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``(1, T, C+R)`` at positions ``input_pos (T,)``; return the live
        rows ``(1, S, C+R)`` in logical order and their positions ``(S,)``."""
        new = {"kv_new": (kv_new, self.kv)}
        check_cache_update(input_pos, new, axis=1, legend="(1, T, C+R)", max_len=None)
        slots = self.reserve(input_pos)
        self.kv.index_copy_(1, slots, kv_new.to(self.kv.dtype))
        self.pos.index_copy_(0, slots, input_pos)
        read = self.read(input_pos)
        return self.kv[:, read], self.pos[read]


def paged(page_size: int, n_pages: int) -> Callable[[nn.Module], nn.Module]:
    """The ``convert`` of :meth:`companion.models.decoder.DecoderLM.new_cache` for one
    sequence (batch 1): each layer's plain cache becomes a page table into a pool of
    its own of ``n_pages`` pages of ``page_size`` slots (same dtype and device; also on
    the meta device). A sliding layer's table frees pages that leave its window."""
    check_int("page_size", page_size, 1)
    check_int("n_pages", n_pages, 1)
    kinds = (KVCache, SlidingWindowCache, LatentCache)

    def convert(plain: nn.Module) -> nn.Module:
        if type(plain) not in kinds:
            allowed = ", ".join(k.__name__ for k in kinds)
            raise TypeError(
                f"paged caches replace {allowed}; got {type(plain).__name__}"
            )
        ref = plain.kv if isinstance(plain, LatentCache) else plain.k
        if ref.shape[0] != 1:
            raise ValueError(
                f"a paged cache holds one sequence: make the plain cache with batch 1, "
                f"got batch {ref.shape[0]}; fork_cache adds sequences"
            )
        slots = n_pages * page_size

        def empty(buf: Tensor, axis: int) -> Tensor:
            shape = (*buf.shape[:axis], slots, *buf.shape[axis + 1 :])
            return torch.zeros(shape, dtype=buf.dtype, device=buf.device)

        if isinstance(plain, LatentCache):
            pool = PagePool({"kv": (empty(plain.kv, 1), 1)}, page_size)
            return PagedLatentCache(pool)
        tensors = {"k": (empty(plain.k, 2), 2), "v": (empty(plain.v, 2), 2)}
        window = getattr(plain, "window", None)
        return PagedKVCache(PagePool(tensors, page_size), window=window)

    return convert


def _tables(cache: nn.Module) -> list[PageTable]:
    layers = list(getattr(cache, "layers", []))
    if not layers or not all(isinstance(c, PageTable) for c in layers):
        raise TypeError(
            "cache must be a DecodeCache made with new_cache(1, max_len, "
            f"convert=paged(page_size, n_pages)), got {type(cache).__name__}"
        )
    return layers


def fork_cache(cache: nn.Module) -> nn.Module:
    """A second sequence continuing ``cache`` (a paged ``DecodeCache``): every layer's
    page table copied, its pages shared, nothing copied until a write."""
    forks = [layer.fork() for layer in _tables(cache)]
    other = type(cache)(forks, cache.max_len, cache.convert)
    other.length = cache.length
    return other


def release_cache(cache: nn.Module) -> None:
    """Free a finished sequence: each layer's pages lose a reference, and those at 0
    go back to their pool's free list."""
    for layer in _tables(cache):
        layer.release()
    cache.length = 0
