"""Caches: decoding token by token through a cache equals attention over the whole sequence."""

import pytest
import torch

from companion.layers.kv_cache import KVCache, SlidingWindowCache, position_mask
from companion.models.decoder import DecodeCache
from companion.ops.dispatch import attention


def _full(q, k, v, window):
    t = q.shape[2]
    pos = torch.arange(t)
    return attention(q, k, v, mask=position_mask(pos, pos, window))


@pytest.mark.parametrize("window", [None, 1, 3, 8, 40])
@pytest.mark.parametrize(
    "chunks", [[20], [1] * 20, [7, 1, 1, 5, 6], [3, 10, 1, 6]], ids=str
)
def test_chunked_decoding_equals_full_attention(window, chunks):
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 20, 8),
        torch.randn(2, 2, 20, 8),
        torch.randn(2, 2, 20, 8),
    )
    want = _full(q, k, v, window)
    cache = (
        KVCache(2, 2, 20, 8) if window is None else SlidingWindowCache(2, 2, window, 8)
    )
    outs, start = [], 0
    for t in chunks:
        qpos = torch.arange(start, start + t)
        kk, vv, kpos = cache.update(
            qpos, k[:, :, start : start + t], v[:, :, start : start + t]
        )
        mask = position_mask(qpos, kpos, window)
        outs.append(attention(q[:, :, start : start + t], kk, vv, mask=mask))
        start += t
    torch.testing.assert_close(torch.cat(outs, dim=2), want, atol=1e-6, rtol=1e-5)
    if window is not None:
        assert cache.k.shape[2] == window  # memory capped at the window


def test_full_cache_overflow_is_a_clear_error():
    cache = DecodeCache([KVCache(1, 1, 4, 2)], max_len=4)
    cache.length = 3
    with pytest.raises(ValueError, match=r"3 \+ 2 tokens exceed max_len=4"):
        cache.positions(2)
    assert cache.positions(1).tolist() == [3]


def test_a_slot_holds_its_position_and_empty_slots_are_minus_one():
    cache = KVCache(1, 1, 6, 2)
    k = torch.arange(4.0).view(1, 1, 2, 2)
    kk, _, kpos = cache.update(torch.tensor([2, 3]), k, k)
    assert kpos.tolist() == [-1, -1, 2, 3, -1, -1]
    assert torch.equal(kk[:, :, 2:4], k) and kk.shape == (1, 1, 6, 2)


def test_position_mask_window_counts_the_query_itself():
    m = position_mask(torch.tensor([5]), torch.arange(8), window=3)
    assert m.int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0]]
