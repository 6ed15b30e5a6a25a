"""A pool of fixed-size cache pages with a free list and reference counts (chapter 16),
and what paging saves over preallocated caches for a ragged batch.

Shape legend: N pages, P slots per page (``page_size``), N·P slots in all. The pool
does not own a layout: it indexes the slot axis of the tensors it is given (a
:class:`~companion.layers.kv_cache.KVCache`'s ``k (1, H_kv, N·P, D)`` and ``v``, or a
:class:`~companion.layers.kv_cache.LatentCache`'s ``kv (1, N·P, C+R)``), so page j is
slots ``j·P .. j·P + P - 1``, and keeps ``pos (N·P,)``, the position each slot holds
(``-1``: empty). Sequences point at pages through page tables
(:mod:`companion.layers.paged_cache`); a page's reference count is how many tables point
at it, and it returns to the free list when that count reaches 0. This is the memory
manager of PagedAttention (Kwon et al., 2023); the bookkeeping is plain Python, as in a
server's scheduler, which runs on the CPU beside the accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from companion.checks import check_int

__all__ = ["CacheFootprint", "PagePool", "cache_footprint", "pages_needed"]


class PagePool:
    """``n_pages`` pages of ``page_size`` slots along each tensor's slot axis, a free
    list and a reference count per page.

    ``tensors`` maps a name to ``(tensor, slot axis)``; every slot axis must hold the
    same N·P slots. Page ids run 0..N-1; :meth:`allocate` hands out the lowest free id
    first.
    """

    def __init__(self, tensors: dict[str, tuple[Tensor, int]], page_size: int) -> None:
        check_int("page_size", page_size, 1)
        sizes = {name: t.shape[axis] for name, (t, axis) in tensors.items()}
        n_slots = next(iter(sizes.values()))
        if len(set(sizes.values())) != 1 or n_slots % page_size:
            raise ValueError(
                f"tensors must share a slot axis of n_pages·page_size slots "
                f"(page_size={page_size}), got slot counts {sizes}"
            )
        self.tensors, self.page_size = tensors, page_size
        self.n_pages = n_slots // page_size
        device = next(iter(tensors.values()))[0].device
        self.pos = torch.full((n_slots,), -1, device=device)
        self.free = list(range(self.n_pages - 1, -1, -1))  # a stack: page 0 on top
        self.refs = [0] * self.n_pages

    @property
    def n_free(self) -> int:
        """Pages on the free list."""
        return len(self.free)

    def need(self, n: int) -> None:
        """Raise a ValueError unless ``n`` pages are free (called before any change)."""
        if n > self.n_free:
            raise ValueError(
                f"the page pool is exhausted: {n} new pages needed, {self.n_free} of "
                f"n_pages={self.n_pages} free; make the pool with more pages or free a "
                "sequence"
            )

    def slots(self, pages: Sequence[int]) -> Tensor:
        """The slot indices ``(len(pages)·P,)`` of ``pages``, in the order given."""
        p = self.page_size
        ids = torch.tensor(list(pages), dtype=torch.long, device=self.pos.device)
        return (ids[:, None] * p + torch.arange(p, device=ids.device)).flatten()

    def allocate(self) -> int:
        """Take a page off the free list, its reference count 1 and its slots empty."""
        self.need(1)
        page = self.free.pop()
        self.refs[page] = 1
        self.pos[page * self.page_size : (page + 1) * self.page_size] = -1
        return page

    def share(self, page: int) -> None:
        """One more page table points at ``page``."""
        self.refs[page] += 1

    def release(self, page: int) -> None:
        """One page table fewer points at ``page``; at 0 it goes back on the free list."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)

    def copy_on_write(self, page: int) -> int:
        """A private copy of a shared ``page`` for the table about to write into it: a
        new page with the same contents, and one reference fewer on the old one."""
        new = self.allocate()
        src, dst = self.slots([page]), self.slots([new])
        for t, axis in self.tensors.values():
            t.index_copy_(axis, dst, t.index_select(axis, src))
        self.pos[dst] = self.pos[src]
        self.release(page)
        return new


def pages_needed(lengths: Sequence[int], page_size: int, shared_prefix: int = 0) -> int:
    """Pages that hold sequences of ``lengths`` tokens whose first ``shared_prefix``
    tokens are one prompt they all share: the prompt's full pages once, and per
    sequence the rest (the prompt's partial last page is copied on first write)."""
    check_int("page_size", page_size, 1)
    check_int("shared_prefix", shared_prefix, 0)
    for i, n in enumerate(lengths):
        check_int(f"lengths[{i}]", n, max(shared_prefix, 1))
    full = shared_prefix // page_size
    own = sum(math.ceil((n - full * page_size) / page_size) for n in lengths)
    return (full if lengths else 0) + own


@dataclass(frozen=True)
class CacheFootprint:
    """Token slots a ragged batch holds under each policy (multiply by bytes per token
    for bytes): ``used`` the tokens themselves; ``contiguous_max_len`` each sequence
    preallocated to ``max_len``; ``contiguous_longest`` padded to the batch's longest;
    ``paged`` whole pages per sequence; ``paged_shared`` pages with the prompt
    shared."""

    used: int
    contiguous_max_len: int
    contiguous_longest: int
    paged: int
    paged_shared: int

    @property
    def internal_waste(self) -> int:
        """Slots reserved but empty in sequences' last pages (paged, no sharing)."""
        return self.paged - self.used


def cache_footprint(
    lengths: Sequence[int], page_size: int, max_len: int, shared_prefix: int = 0
) -> CacheFootprint:
    """The :class:`CacheFootprint` of sequences of ``lengths`` tokens (each at most
    ``max_len``) whose first ``shared_prefix`` tokens are a shared prompt."""
    check_int("max_len", max_len, 1)
    if any(n > max_len for n in lengths):
        raise ValueError(f"lengths must be at most max_len={max_len}, got {lengths}")
    paged = pages_needed(lengths, page_size) * page_size
    shared = pages_needed(lengths, page_size, shared_prefix) * page_size
    return CacheFootprint(
        used=sum(lengths),
        contiguous_max_len=len(lengths) * max_len,
        contiguous_longest=len(lengths) * max(lengths, default=0),
        paged=paged,
        paged_shared=shared,
    )
