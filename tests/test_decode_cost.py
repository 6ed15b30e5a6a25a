"""companion.analysis.decode_cost: work counts checked against a model that generates, bytes against
real cache tensors, the intensity and roofline formulas, and the errors they raise."""

from __future__ import annotations

import pytest
import torch

from companion.analysis.decode_cost import (
    arithmetic_intensity,
    attainable_flops,
    attended_pairs,
    decode_attention_bytes,
    decode_attention_flops,
    max_context_tokens,
    projected_tokens,
    ridge_point,
)
from companion.layers.kv_cache import KVCache
from companion.models.decoder import DecoderLM
from companion.models.presets import tiny


def _count_work(model: DecoderLM, prompt: torch.Tensor, new: int, use_cache: bool):
    """Rows through layer 0's attention and the causal pairs it scores, via a pre-hook."""
    seen = {"rows": 0, "pairs": 0}

    def hook(_module, args, kwargs):
        t, pos = (
            args[0].shape[1],
            args[1],
        )  # the block passes the positions, cache or not
        seen["rows"] += t
        seen["pairs"] += int((pos + 1).sum())

    handle = model.blocks[0].attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = model.generate(prompt, new, use_cache=use_cache)
    finally:
        handle.remove()
    return out, seen


@pytest.mark.parametrize("prompt_len,new", [(1, 1), (5, 7), (8, 1), (3, 12)])
def test_counts_match_a_generating_model(prompt_len: int, new: int) -> None:
    torch.manual_seed(0)
    cfg = tiny(
        vocab_size=32, n_layers=1, max_seq_len=32, activation="gelu", ffn="mlp",
    )  # fmt: skip
    model = DecoderLM(cfg).eval()
    prompt = torch.randint(0, 32, (1, prompt_len))
    out_c, cached = _count_work(model, prompt, new, use_cache=True)
    out_r, recomputed = _count_work(model, prompt, new, use_cache=False)
    assert torch.equal(out_c, out_r)
    assert cached["rows"] == projected_tokens(prompt_len, new, cached=True)
    assert recomputed["rows"] == projected_tokens(prompt_len, new, cached=False)
    assert cached["pairs"] == attended_pairs(prompt_len, new, cached=True)
    assert recomputed["pairs"] == attended_pairs(prompt_len, new, cached=False)


def test_counts_closed_forms() -> None:
    p, n = 10, 100
    assert projected_tokens(p, n, cached=True) == p + n - 1
    assert projected_tokens(p, n, cached=False) == n * p + n * (n - 1) // 2
    assert (
        projected_tokens(p, 0, cached=True) == projected_tokens(p, 0, cached=False) == 0
    )
    assert attended_pairs(p, 1, cached=True) == attended_pairs(p, 1, cached=False) == 55


def test_bytes_match_a_cache_tensor() -> None:
    b, h_kv, s, d = 2, 3, 17, 8
    cache = KVCache(b, h_kv, s, d, dtype=torch.bfloat16)
    nbytes = cache.k.nbytes + cache.v.nbytes
    assert (
        decode_attention_bytes(2 * h_kv * d, s, batch=b, bytes_per_element=2) == nbytes
    )


@pytest.mark.parametrize("n_heads,n_kv", [(32, 32), (32, 8), (32, 1), (9, 3)])
@pytest.mark.parametrize("context,batch", [(1, 1), (4096, 1), (131072, 64)])
def test_intensity_is_the_head_ratio_in_bf16(
    n_heads: int, n_kv: int, context: int, batch: int
) -> None:
    d = 128
    flops = decode_attention_flops(n_heads, d, d, context, batch)
    nbytes = decode_attention_bytes(2 * n_kv * d, context, batch, bytes_per_element=2)
    assert arithmetic_intensity(flops, nbytes) == n_heads / n_kv


def test_ridge_and_roofline() -> None:
    ridge = ridge_point(989e12, 3.35e12)  # the roofline's corner: bound by both below
    assert attainable_flops(1.0, 989e12, 3.35e12) == 3.35e12
    assert attainable_flops(1000.0, 989e12, 3.35e12) == 989e12
    assert attainable_flops(ridge, 989e12, 3.35e12) == pytest.approx(989e12)
    assert attainable_flops(0.99 * ridge, 989e12, 3.35e12) < 0.995 * 989e12


def test_max_context_tokens() -> None:
    assert max_context_tokens(100, 20, 8) == 10
    assert max_context_tokens(100, 20, 8, batch=2) == 5
    assert max_context_tokens(100, 100, 8) == 0


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: projected_tokens(0, 3, cached=True), "prompt"),
        (lambda: attended_pairs(2, -1, cached=False), "new_tokens"),
        (lambda: decode_attention_flops(0, 64, 64, 10), "n_heads"),
        (lambda: decode_attention_flops(4, 64, 64, 10, batch=0), "batch"),
        (lambda: decode_attention_bytes(256, -1), "context"),
        (
            lambda: decode_attention_bytes(256, 8, bytes_per_element=0),
            "bytes_per_element",
        ),
        (lambda: arithmetic_intensity(1.0, 0), "nbytes"),
        (lambda: ridge_point(1e12, 0.0), "bandwidth"),
        (lambda: attainable_flops(-1.0, 1e12, 1e9), "intensity"),
        (lambda: max_context_tokens(10, 20, 1), "weight_bytes"),
        (lambda: max_context_tokens(10, 2, 0), "per_token_bytes"),
    ],
)
def test_errors_name_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()
