"""Quantised KV caches: each row within its format's error bound, decoding through them
equals an fp32 cache fed the same rows quantised and back, and the model's cache checks
know them."""

from __future__ import annotations

import pytest
import torch

from companion.layers.kv_cache import (
    IndexKeyCache,
    KVCache,
    LatentCache,
    SlidingWindowCache,
    SparseLatentCache,
)
from companion.layers.kv_quant import (
    FORMATS,
    SCALE_BYTES,
    QuantizedKVCache,
    QuantizedLatentCache,
    QuantizedSlidingWindowCache,
    dequantize_rows,
    quantize_cache,
    quantize_rows,
    stored_bytes,
)
from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecodeCache, DecoderLM
from companion.models.presets import tiny


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows ``(4, 6, 64)`` whose absmax spans four decades, and one zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, 64, generator=g)
    x = x * 10 ** (4 * torch.rand(4, 6, 1, generator=g) - 3)
    x[0, 0] = 0
    return x


def _round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return dequantize_rows(*quantize_rows(x, fmt), x.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_error_is_at_most_half_a_step_of_the_rows_absmax(seed):
    x = _rows(seed)
    codes, scale = quantize_rows(x, "int8")
    absmax = x.abs().amax(-1, keepdim=True)
    assert codes.dtype == torch.int8 and scale.shape == x.shape[:-1]
    err = (dequantize_rows(codes, scale, x.dtype) - x).abs()
    assert (err <= absmax / 254 * (1 + 1e-5)).all()  # round to nearest of absmax/127
    # the row's largest number maps to 127: the whole code range is used
    assert (codes.abs().amax(-1)[absmax[..., 0] > 0] == 127).all()
    assert (codes[0, 0] == 0).all() and scale[0, 0] == 0  # a zero row stays zero


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_error_is_within_three_mantissa_bits(seed):
    x = _rows(seed)
    codes, scale = quantize_rows(x, "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    err = (dequantize_rows(codes, scale, x.dtype) - x).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value for normal numbers;
    # below 2^-6 the subnormal step is 2^-9, half of it 2^-10 (in units of the scale)
    bound = torch.maximum(x.abs() / 16, scale[..., None] / 1024)
    assert (err <= bound * (1 + 1e-5)).all()
    top = codes.float().abs().amax(-1)[x.abs().amax(-1) > 0]
    assert (top == 448).all()


def _plain_round_trip(fmt: str):
    """A converter to plain caches fed every new row quantised and back: the reference
    the quantised caches must equal (their storage is then the only difference)."""

    class RoundTripKV(KVCache):
        def update(self, input_pos, k_new, v_new):
            rt = (_round_trip(k_new, fmt), _round_trip(v_new, fmt))
            return KVCache.update(self, input_pos, *rt)

    class RoundTripRing(SlidingWindowCache):
        def update(self, input_pos, k_new, v_new):
            rt = (_round_trip(k_new, fmt), _round_trip(v_new, fmt))
            return SlidingWindowCache.update(self, input_pos, *rt)

    class RoundTripLatent(LatentCache):
        def update(self, input_pos, kv_new):
            return LatentCache.update(self, input_pos, _round_trip(kv_new, fmt))

    kinds = {
        KVCache: RoundTripKV,
        SlidingWindowCache: RoundTripRing,
        LatentCache: RoundTripLatent,
    }

    def convert(cache):
        kw = {"device": cache.pos.device}
        if isinstance(cache, LatentCache):
            b, s, width = cache.kv.shape
            return RoundTripLatent(b, s, width, 0, **kw)
        b, h, s, d = cache.k.shape
        return kinds[type(cache)](b, h, s, d, value_dim=cache.v.shape[-1], **kw)

    return convert


CONFIGS = {
    "gqa": tiny(attn_impl="reference", vocab_size=50),
    "mla": tiny(attn_impl="reference", vocab_size=50, mla=MLAConfig(16, 8, 4, 8)),
    "sliding": tiny(
        attn_impl="reference",
        vocab_size=50,
        sliding_window=4,
        layer_types=("sliding", "full"),
    ),
}


def _decode(model, ids, cache, prefill=5):
    """Logits of every position: a prefill of ``prefill`` tokens, then one at a time."""
    out = [model(ids[:, :prefill], cache=cache)]
    out += [model(ids[:, t : t + 1], cache=cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_equals_an_fp32_cache_of_the_same_rows(name, fmt):
    torch.manual_seed(0)
    model = DecoderLM(CONFIGS[name]).eval()
    ids = torch.randint(0, 50, (2, 14))
    with torch.no_grad():
        plain = _decode(model, ids, model.new_cache(2, 20))
        cache = model.new_cache(2, 20, convert=quantize_cache(fmt))
        got = _decode(model, ids, cache)
        want = _decode(
            model, ids, model.new_cache(2, 20, convert=_plain_round_trip(fmt))
        )
    kinds = {QuantizedKVCache, QuantizedLatentCache, QuantizedSlidingWindowCache}
    assert {type(c) for c in cache.layers} <= kinds
    if name == "sliding":  # prefill 5 > W = 4: the ring wrapped during the prefill
        assert isinstance(cache.layers[0], QuantizedSlidingWindowCache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and close to the fp32 cache, but not equal to it (the rows were quantised)
    tol = {"int8": 0.01, "fp8": 0.04}[fmt]
    gap = (got - plain).abs().max()
    assert 0 < gap <= tol * plain.abs().max()


def test_each_row_keeps_one_scale_and_bytes_are_codes_plus_scales():
    b, h, s, d = 2, 3, 10, 8
    cache = QuantizedKVCache(b, h, s, d, fmt="fp8")
    assert cache.k_scale.shape == cache.v_scale.shape == (b, h, s)
    assert cache.k_q.element_size() == 1 and cache.k_scale.dtype == torch.float32
    assert stored_bytes(cache) == 2 * b * h * s * (d + SCALE_BYTES)
    latent = QuantizedLatentCache(b, s, 16, 4)
    assert latent.kv_scale.shape == (b, s)
    assert stored_bytes(latent) == b * s * (16 + 4 + SCALE_BYTES)


def test_model_cache_bytes_match_the_formula():
    from inspect import signature

    from companion.analysis.cache_size import kv_cache_bytes

    if "scale_bytes" not in signature(kv_cache_bytes).parameters:
        pytest.skip("the cache formula has no scale_bytes yet")
    for cfg in (CONFIGS["gqa"], CONFIGS["mla"]):
        cache = DecoderLM(cfg).new_cache(3, 40, convert=quantize_cache("int8"))
        have = sum(stored_bytes(c) for c in cache.layers)
        assert have == kv_cache_bytes(cfg, 40, 1, batch=3, scale_bytes=SCALE_BYTES)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quantised_ring_holds_the_last_window(fmt):
    torch.manual_seed(0)
    ring = QuantizedSlidingWindowCache(1, 2, 3, 4, fmt=fmt)
    k = torch.randn(1, 2, 7, 4)
    kk, _, pos = ring.update(torch.arange(5), k[:, :, :5], k[:, :, :5])
    assert pos.tolist() == [-1, -1, -1, 0, 1, 2, 3, 4]  # old ring beside the new rows
    kk, _, pos = ring.update(torch.tensor([5]), k[:, :, 5:6], k[:, :, 5:6])
    assert sorted(pos.tolist()) == [3, 4, 5]
    order = pos.argsort()
    want = _round_trip(k[:, :, 3:6], fmt)
    torch.testing.assert_close(kk[:, :, order], want)


def test_check_cache_accepts_the_converted_cache_and_names_a_mismatch():
    model = DecoderLM(CONFIGS["gqa"]).eval()
    ids = torch.randint(0, 50, (1, 4))
    cache = model.new_cache(1, 8, convert=quantize_cache("int8"))
    model(ids, cache=cache)  # accepted
    assert cache.length == 4
    for wrong in (KVCache(1, 2, 8, 8), QuantizedKVCache(1, 2, 8, 8, fmt="fp8")):
        bad = model.new_cache(1, 8, convert=quantize_cache("int8"))
        bad.layers[1] = wrong
        with pytest.raises(ValueError, match="cache layer 1 is a"):
            model(ids, cache=bad)
        assert bad.length == 0
    # a plain cache whose layers were swapped for quantised ones, without the converter
    plain = model.new_cache(1, 8)
    swapped = DecodeCache([quantize_cache("int8")(c) for c in plain.layers], 8)
    with pytest.raises(ValueError, match="QuantizedKVCache"):
        model(ids, cache=swapped)


def test_the_converter_keeps_what_a_cache_holds_and_works_on_meta():
    torch.manual_seed(0)
    plain = KVCache(1, 2, 6, 4)
    k = torch.randn(1, 2, 3, 4)
    plain.update(torch.tensor([1, 2, 3]), k, 2 * k)
    q = quantize_cache("int8")(plain)
    assert torch.equal(q.pos, plain.pos)
    torch.testing.assert_close(q.k, _round_trip(plain.k, "int8"))
    torch.testing.assert_close(q.v, _round_trip(plain.v, "int8"))
    meta = quantize_cache("fp8")(LatentCache(2, 5, 6, 2, device="meta"))
    assert isinstance(meta, QuantizedLatentCache) and meta.kv_q.device.type == "meta"
    assert meta.kv_q.shape == (2, 5, 8) and meta.kv_q.dtype == torch.float8_e4m3fn


def test_bad_format_and_unsupported_kinds_are_named():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_cache("int4")
    with pytest.raises(ValueError, match="fmt must be one of"):
        QuantizedKVCache(1, 1, 4, 2, fmt="nf4")
    sparse = SparseLatentCache(LatentCache(1, 4, 8, 2), IndexKeyCache(1, 4, 4))
    with pytest.raises(TypeError, match="got a SparseLatentCache"):
        quantize_cache("int8")(sparse)
    with pytest.raises(TypeError, match="KVCache, SlidingWindowCache or LatentCache"):
        quantize_cache("int8")(QuantizedKVCache(1, 1, 4, 2))


def test_a_failed_update_leaves_the_cache_as_it_was():
    cache = QuantizedKVCache(1, 2, 6, 4)
    cache.update(torch.tensor([0, 1]), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    before = {n: b.clone() for n, b in cache.named_buffers()}
    with pytest.raises(ValueError, match="v_new"):
        cache.update(
            torch.tensor([2]), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 5)
        )
    with pytest.raises(ValueError, match="input_pos"):
        cache.update(
            torch.tensor([6]), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
        )
    latent = QuantizedLatentCache(1, 4, 6, 2)
    with pytest.raises(ValueError, match="kv_new"):
        latent.update(torch.tensor([0]), torch.randn(1, 1, 7))
    assert (latent.pos == -1).all()
    for n, b in cache.named_buffers():
        assert torch.equal(_bits(b), _bits(before[n])), n


def _bits(b: torch.Tensor) -> torch.Tensor:
    """One-byte codes as uint8 (float8 has no equality on the CPU)."""
    return b.view(torch.uint8) if b.element_size() == 1 else b


def test_cached_nll_reads_the_cache_as_a_token_by_token_decode():
    from companion.bench.kvquant import cached_nll

    torch.manual_seed(0)
    model = DecoderLM(CONFIGS["gqa"]).eval()
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full = model(ids)[:, 3:-1]
        want = torch.nn.functional.cross_entropy(
            full.transpose(1, 2), ids[:, 4:], reduction="none"
        )
        torch.testing.assert_close(cached_nll(model, ids, 4), want)
        # quantised: the one-pass score equals scoring one token at a time
        convert = quantize_cache("fp8")
        step = _decode(model, ids[:, :-1], model.new_cache(2, 11, convert=convert), 4)
        want = torch.nn.functional.cross_entropy(
            step[:, 3:].transpose(1, 2), ids[:, 4:], reduction="none"
        )
        torch.testing.assert_close(cached_nll(model, ids, 4, convert), want)
    with pytest.raises(ValueError, match="prompt must be in"):
        cached_nll(model, ids, 11)


def test_kvquant_bench_on_a_tiny_model():
    from companion.bench.kvquant import bench_kvquant, format_kvquant

    torch.manual_seed(0)
    model = DecoderLM(CONFIGS["gqa"]).eval()
    rows = bench_kvquant(model, torch.randint(0, 50, (1, 5)), 6, repeats=1)
    assert list(rows) == ["fp32", "int8", "fp8"]
    assert rows["fp32"]["ratio"] == 1 and rows["fp32"]["agreeing"] == 6
    assert all(r["tps"] > 0 and 0 <= r["agreeing"] <= 6 for r in rows.values())
    # one byte per number plus 4 per row of D = 8: 12 bytes where fp32 keeps 32
    for fmt in FORMATS:
        assert rows[fmt]["cache_mb"] * 32 == pytest.approx(
            rows["fp32"]["cache_mb"] * 12
        )
    table = format_kvquant(rows, 6)
    assert "greedy = fp32" in table and "6 of 6" in table
