"""The paged cache: decoding through page tables equals the contiguous caches token by
token; forked sequences share their prompt's pages, copy a shared page once on write and
free what they held; the pool's accounting matches the footprint formula."""

import math

import pytest
import torch

from companion.layers.kv_cache import KVCache, SlidingWindowCache
from companion.layers.page_pool import PagePool, cache_footprint, pages_needed
from companion.layers.paged_cache import (
    PagedKVCache,
    fork_cache,
    paged,
    release_cache,
)
from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecodeCache, DecoderLM
from companion.models.presets import tiny

MLA = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
KINDS = {
    "full": {},
    "sliding": {"sliding_window": 5, "layer_types": ("sliding", "full")},
    "latent": {"mla": MLA},
}
P, T, PROMPT = 4, 24, 7


def _model(kind: str, impl: str = "reference") -> DecoderLM:
    torch.manual_seed(0)
    cfg = tiny(vocab_size=40, max_seq_len=32, attn_impl=impl, **KINDS[kind])
    return DecoderLM(cfg).eval()


@torch.no_grad()
def _decode(model, ids, cache, prompt=PROMPT, checked=True):
    """Logits of ``ids (1, T)``: the prompt in one forward, then one token per step."""
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids.shape[1])]
    out = []
    for a, b in steps:
        if checked:
            out.append(model(ids[:, a:b], cache=cache))
        else:
            out.append(model.forward_at(ids[:, a:b], torch.arange(a, b), cache))
    return torch.cat(out, dim=1)


def _ids(seed=1, n=T):
    return torch.randint(0, 40, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(KINDS))
def test_paged_decoding_equals_the_contiguous_cache(kind):
    model, ids = _model(kind), _ids()
    cache = model.new_cache(1, T, convert=paged(P, 8))
    got = _decode(model, ids, cache)
    # contiguous: one slot per position in every layer (sliding layers masked by window)
    plain = model.new_cache(1, T)
    if kind != "latent":
        heads = [(b.attn.n_kv_heads, b.attn.head_dim) for b in model.blocks]
        plain = DecodeCache([KVCache(1, h, T, d) for h, d in heads], T)
    want = _decode(model, ids, plain, checked=False)
    # the same keys in the same order; the masked slots' count differs (S live slots
    # against T), which moves the vectorised sums' lanes: float rounding at most
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if kind == "sliding":  # the model's own ring buffer: the same keys in ring order
        ring = model.new_cache(1, T)
        assert isinstance(ring.layers[0], SlidingWindowCache)
        torch.testing.assert_close(got, _decode(model, ids, ring), atol=1e-6, rtol=0)
        # the sliding layer keeps the pages the next query (at T) can see, the full
        # layer all; T = 24 puts that query's window start on a page boundary
        last, w = T - 1, 5
        live = last // P - (last + 2 - w) // P + 1
        held = [8 - layer.pool.n_free for layer in cache.layers]
        assert held == [live, math.ceil(T / P)]
        gone = last // P + 1 - live
        table = cache.layers[0].table
        assert table[:gone] == [-1] * gone and min(table[gone:]) >= 0
        assert max(table) < live + 1  # freed pages were taken again from the free list


def test_sdpa_differs_only_by_float_rounding():
    """SDPA's CPU kernel blocks the keys by their count, so reading S live slots instead
    of max_len changes its summation order (not what is summed)."""
    model, ids = _model("full", impl="sdpa"), _ids()
    got = _decode(model, ids, model.new_cache(1, T, convert=paged(P, 8)))
    want = _decode(model, ids, model.new_cache(1, T))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["full", "latent"])
def test_forked_sequences_share_the_prompt_pages(kind):
    model = _model(kind)
    prompt, a, b = _ids(2, 6), _ids(3, 5), _ids(4, 3)
    n_pages = 8
    first = model.new_cache(1, 16, convert=paged(P, n_pages))
    with torch.no_grad():
        model(prompt, cache=first)
    pool = first.layers[0].pool
    assert first.layers[0].table == [0, 1] and pool.n_free == n_pages - 2
    second = fork_cache(first)
    # the same physical pages, one reference more each, nothing allocated or copied
    assert second.layers[0].table == [0, 1] and pool.refs[:2] == [2, 2]
    assert pool.n_free == n_pages - 2 and second.length == 6
    store = next(iter(pool.tensors.values()))[0]
    name = "kv" if kind == "latent" else "k"
    views = [getattr(c.layers[0], name).data_ptr() for c in (first, second)]
    assert views == [store.data_ptr()] * 2  # both tables index one pool tensor
    outs = {}
    with torch.no_grad():
        outs["a"] = torch.cat(
            [model(a[:, i : i + 1], cache=first) for i in range(5)], 1
        )
        # the first write into the shared partial page (1) copied it: once, for `first`
        assert first.layers[0].table[:2] == [0, 2] and pool.refs[:3] == [2, 1, 1]
        outs["b"] = torch.cat(
            [model(b[:, i : i + 1], cache=second) for i in range(3)], 1
        )
    # `second` wrote into page 1 in place (no longer shared); page 0 still shared
    assert second.layers[0].table[:2] == [0, 1] and pool.refs[:2] == [2, 1]
    used = pages_needed([6 + 5, 6 + 3], P, shared_prefix=6)
    assert n_pages - pool.n_free == used == 5
    for name, cont in (("a", a), ("b", b)):  # each equals its own text decoded alone
        full = torch.cat([prompt, cont], dim=1)
        alone = _decode(model, full, model.new_cache(1, 16), prompt=6)
        torch.testing.assert_close(outs[name], alone[:, 6:], atol=1e-6, rtol=0)
    release_cache(first)
    assert pool.refs[:4] == [1, 1, 0, 0] and pool.n_free == n_pages - 3
    release_cache(second)
    assert pool.n_free == n_pages and set(pool.refs) == {0}


def test_a_recycled_page_starts_empty():
    kv = {name: (torch.zeros(1, 1, 8, 2), 2) for name in "kv"}
    pool = PagePool(kv, page_size=4)
    cache = PagedKVCache(pool)
    x = torch.ones(1, 1, 3, 2)
    cache.update(torch.tensor([0, 1, 2]), x, x)
    cache.release()
    other = PagedKVCache(pool)
    _, _, pos = other.update(torch.tensor([0]), x[:, :, :1], x[:, :, :1])
    assert pos.tolist() == [0, -1, -1, -1]  # not the old sequence's 1, 2


def test_pool_exhausted_is_a_clear_error_and_changes_nothing():
    model = _model("full")
    cache = model.new_cache(1, 16, convert=paged(P, 2))
    with torch.no_grad():
        model(_ids(5, 8), cache=cache)
    layer = cache.layers[0]
    before = (list(layer.table), list(layer.pool.free), layer.k.clone(), cache.length)
    with pytest.raises(
        ValueError, match=r"pool is exhausted: 1 new pages needed, 0 of"
    ):
        model(_ids(6, 1), cache=cache)
    after = (list(layer.table), list(layer.pool.free), layer.k, cache.length)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])
    assert before[3] == after[3]
    # a prefill longer than the pool is refused before anything is written
    with pytest.raises(ValueError, match="pool is exhausted"):
        kv = {name: (torch.zeros(1, 1, 4, 2), 2) for name in "kv"}
        PagedKVCache(PagePool(kv, 4)).update(
            torch.arange(5), torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2)
        )


def test_bad_input_names_the_argument():
    model = _model("full")
    cache = model.new_cache(1, 16, convert=paged(P, 4))
    layer = cache.layers[0]
    ok = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match=r"k_new must have shape \(1, 2, 1, 8\)"):
        layer.update(torch.tensor([0]), torch.zeros(1, 3, 1, 8), ok)
    with pytest.raises(ValueError, match="input_pos must hold positions >= 0"):
        layer.update(torch.tensor([-1]), ok, ok)
    assert layer.table == [] and layer.pool.n_free == 4
    with pytest.raises(
        ValueError, match="one sequence: make the plain cache with batch 1"
    ):
        model.new_cache(2, 16, convert=paged(P, 4))
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        paged(0, 4)
    with pytest.raises(TypeError, match="paged caches replace KVCache"):
        paged(P, 4)(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="convert=paged"):
        fork_cache(model.new_cache(1, 16))


def test_footprint_of_a_ragged_batch():
    fp = cache_footprint([5, 17, 32], page_size=16, max_len=64, shared_prefix=5)
    assert (fp.used, fp.contiguous_max_len, fp.contiguous_longest) == (54, 192, 96)
    assert fp.paged == (1 + 2 + 2) * 16 and fp.internal_waste == 80 - 54
    assert fp.paged_shared == fp.paged  # a 5-token prompt fills no page: nothing shared
    fp = cache_footprint([40, 40, 40], page_size=16, max_len=64, shared_prefix=32)
    assert fp.paged == 9 * 16 and fp.paged_shared == (2 + 3) * 16
    with pytest.raises(ValueError, match="lengths must be at most max_len=64"):
        cache_footprint([65], 16, 64)
    with pytest.raises(ValueError, match=r"lengths\[0\] must be an integer >= 8"):
        pages_needed([5], 4, shared_prefix=8)


def test_forked_sliding_sequences_free_shared_pages_by_reference():
    """A sliding layer drops pages that both forks share: one reference each, so the
    page is free only once neither sequence can read it."""
    model = _model("sliding")
    prompt, a, b = _ids(2, 6), _ids(3, 9), _ids(4, 9)
    first = model.new_cache(1, 16, convert=paged(P, 8))
    with torch.no_grad():
        model(prompt, cache=first)
        second = fork_cache(first)
        outs = [
            torch.cat([model(x[:, i : i + 1], cache=c) for i in range(9)], 1)
            for c, x in ((first, a), (second, b))
        ]
    pool = first.layers[0].pool
    assert first.layers[0].table[0] == second.layers[0].table[0] == -1
    # every page's count is the number of tables holding it; the rest are free
    held = first.layers[0].pages + second.layers[0].pages
    assert [pool.refs[p] for p in range(8)] == [held.count(p) for p in range(8)]
    assert pool.n_free == 8 - len(set(held))
    for out, cont in zip(outs, (a, b), strict=True):
        full = torch.cat([prompt, cont], dim=1)
        alone = _decode(model, full, model.new_cache(1, 16), prompt=6)
        torch.testing.assert_close(out, alone[:, 6:], atol=1e-6, rtol=0)
    release_cache(first)
    release_cache(second)
    assert pool.n_free == 8 and set(pool.refs) == {0}
