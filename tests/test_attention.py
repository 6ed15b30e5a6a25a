"""Attention three ways (naive, SDPA, tiled): same forward, same gradients, same errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from companion.kernels import interpreting, triton_available
from companion.ops.attention import naive_attention, sdpa_attention
from companion.ops.dispatch import IMPLS, attention
from companion.ops.masks import padding_mask
from companion.ops.tiled import (
    online_softmax_trace,
    tiled_attention,
    tiled_attention_forward,
)


@dataclass(frozen=True)
class Case:
    id: str
    t: int
    s: int
    b: int = 2
    h: int = 2
    d: int = 16
    dv: int = 16
    causal: bool = False
    mask: str = (
        "none"  # "none", "padding" (batch row 1 fully masked) or "random" (B, H, T, S)
    )
    block: int = 16


CASES = [
    Case("T37-S37-block16", 37, 37),
    Case("T37-S37-causal", 37, 37, causal=True),
    Case("T5-S29-causal-end-aligned", 5, 29, causal=True),
    Case("T1-S50-decode", 1, 50, causal=True, block=8),
    Case("T20-S33-D8-Dv12", 20, 33, d=8, dv=12),
    Case("padding-with-empty-batch-row", 24, 24, mask="padding"),
    Case("padding-and-causal", 24, 40, causal=True, mask="padding", block=7),
    Case("random-BHTS-mask", 19, 23, mask="random", block=5),
    Case("one-big-tile", 9, 11, causal=True, mask="random", block=64),
]


def make_inputs(case: Case, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(case.b, case.h, case.t, case.d, generator=gen)
    k = torch.randn(case.b, case.h, case.s, case.d, generator=gen)
    v = torch.randn(case.b, case.h, case.s, case.dv, generator=gen)
    grad_out = torch.randn(case.b, case.h, case.t, case.dv, generator=gen)
    mask = None
    if case.mask == "padding":
        keep = torch.ones(case.b, case.s, dtype=torch.bool)
        keep[0, case.s - 3 :] = False  # row 0: the last 3 keys are padding
        keep[1] = False  # row 1: nothing to attend to, so it must output zeros
        mask = padding_mask(keep)  # (B, 1, 1, S)
    elif case.mask == "random":
        mask = torch.rand(case.b, case.h, case.t, case.s, generator=gen) > 0.4
        mask[0, 0, 0] = False  # at least one fully masked query row
    qkv = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    return qkv, mask, grad_out.to(dtype)


def run(impl: str, case: Case, qkv, mask, grad_out):
    """Output and (dq, dk, dv) of one implementation, with fresh grads."""
    q, k, v = (x.detach().requires_grad_() for x in qkv)
    if impl == "naive":
        out = naive_attention(q, k, v, mask=mask, causal=case.causal)
    elif impl == "sdpa":
        out = sdpa_attention(q, k, v, mask=mask, causal=case.causal)
    else:
        out = tiled_attention(
            q,
            k,
            v,
            mask=mask,
            causal=case.causal,
            block_q=case.block,
            block_k=case.block,
        )
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def assert_all_close(got, want, atol: float, rtol: float) -> None:
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", ["sdpa", "tiled"])
def test_forward_and_backward_match_naive_fp32(case, impl):
    qkv, mask, grad_out = make_inputs(case)
    want = run("naive", case, qkv, mask, grad_out)
    assert_all_close(run(impl, case, qkv, mask, grad_out), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.mask != "none"], ids=lambda c: c.id
)
@pytest.mark.parametrize("impl", ["naive", "sdpa", "tiled"])
def test_fully_masked_rows_output_zeros_with_zero_grads(case, impl):
    qkv, mask, grad_out = make_inputs(case)
    out, dq, _, _ = run(impl, case, qkv, mask, grad_out)
    empty = ~mask.expand(case.b, case.h, case.t, case.s).any(dim=-1)  # (B, H, T)
    assert empty.any()
    assert (out[empty] == 0).all()
    assert (dq[empty] == 0).all()


# bf16 has an 8-bit significand: one rounding costs up to 2**-8 ≈ 0.4% relative. Tiled
# accumulates in fp32 and rounds once at the end; naive and SDPA also round the scores and
# weights, and gradients pass through a few more roundings. So: 3e-2 absolute + 3e-2 relative,
# against the fp32 reference computed on the very same (bf16-representable) inputs.
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.parametrize("case", [CASES[1], CASES[6], CASES[7]], ids=lambda c: c.id)
@pytest.mark.parametrize("impl", ["naive", "sdpa", "tiled"])
def test_bf16_matches_fp32_reference(case, impl):
    qkv, mask, grad_out = make_inputs(case, dtype=torch.bfloat16)
    want = run("naive", case, [x.float() for x in qkv], mask, grad_out.float())
    got = run(impl, case, qkv, mask, grad_out)
    assert all(x.dtype == torch.bfloat16 for x in got)
    assert_all_close(got, want, **BF16_TOL)


def test_tiled_forward_returns_the_log_sum_exp():
    case = CASES[7]
    (q, k, v), mask, _ = make_inputs(case)
    out, lse = tiled_attention_forward(q, k, v, mask=mask, block_q=4, block_k=6)
    scores = (q @ k.transpose(-2, -1)) / case.d**0.5
    want = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    has_key = mask.any(dim=-1)
    torch.testing.assert_close(lse[has_key], want[has_key])
    assert (lse[~has_key] == float("inf")).all()
    torch.testing.assert_close(out, naive_attention(q, k, v, mask=mask))


def test_tiled_respects_scale_and_broadcast_2d_mask():
    case = Case("2d-mask", 12, 12, block=5)
    (q, k, v), _, _ = make_inputs(case)
    mask = (
        torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) > 0.3
    )  # (T, S)
    want = naive_attention(q, k, v, mask=mask, scale=0.3)
    torch.testing.assert_close(
        tiled_attention(q, k, v, mask=mask, scale=0.3, block_q=5), want
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_dispatches_by_name(impl):
    if impl == "triton" and not (triton_available() and interpreting()):
        pytest.skip(
            "triton on CPU tensors needs the interpreter (tests/test_triton_flash)"
        )
    case = CASES[0] if impl == "triton" else CASES[4]  # the kernel needs D = Dv >= 16
    (q, k, v), _, _ = make_inputs(case)
    want = naive_attention(q, k, v, causal=False)
    with (
        torch.no_grad()
    ):  # flex has no CPU backward; the others are tested with gradients
        got = attention(q, k, v, impl=impl)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _bad(**changes):
    """Valid (q, k, v, mask) with one argument replaced."""
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    args = {"q": q, "k": k, "v": v, "mask": None, **changes}
    return args.pop("q"), args.pop("k"), args.pop("v"), args


BAD_INPUTS = {
    "q-wrong-ndim": (_bad(q=torch.randn(2, 4, 8)), r"^q must have shape"),
    "k-D-mismatch": (_bad(k=torch.randn(1, 2, 6, 5)), r"q and k must share D"),
    "v-S-mismatch": (_bad(v=torch.randn(1, 2, 7, 8)), r"k and v must share S"),
    "mask-not-bool": (_bad(mask=torch.ones(4, 6)), r"^mask must be a bool"),
    "mask-wrong-shape": (
        _bad(mask=torch.ones(3, 6, dtype=torch.bool)),
        r"^mask of shape",
    ),
    "mask-5d": (
        _bad(mask=torch.ones(1, 1, 2, 4, 6, dtype=torch.bool)),
        r"^mask of shape",
    ),
}


def test_masks_that_broadcast_are_accepted():
    q, k, v, _ = _bad()
    want = naive_attention(q, k, v)
    for shape in [(6,), (4, 6), (1, 4, 1), (2, 1, 6), (1, 2, 4, 6)]:
        mask = torch.ones(shape, dtype=torch.bool)
        torch.testing.assert_close(naive_attention(q, k, v, mask=mask), want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_name_the_argument(impl, bad):
    (q, k, v, kwargs), match = bad
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, impl=impl, **kwargs)


def test_unknown_impl_is_rejected():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match=r"^impl must be one of"):
        attention(q, q, q, impl="flash3")


def test_tiled_rejects_dropout():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="tiled_attention has no attention dropout"):
        attention(q, q, q, impl="tiled", dropout_p=0.1)


@pytest.mark.parametrize("value", [0, True, 2.0], ids=["zero", "bool", "float"])
@pytest.mark.parametrize("block", ["block_q", "block_k"])
def test_tiled_rejects_bad_block_size(block, value):
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match=rf"^{block} must be a positive integer"):
        tiled_attention(q, q, q, **{block: value})


def test_tiled_causal_needs_keys_for_every_query():
    q, k = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"^causal=True needs S >= T"):
        tiled_attention(q, k, k, causal=True)


@pytest.mark.parametrize("block", [1, 3, 4, 16, 40], ids=lambda b: f"block{b}")
def test_online_softmax_trace_ends_at_the_softmax(block):
    x = torch.randn(16, generator=torch.Generator().manual_seed(0)) * 3
    trace = online_softmax_trace(x, block)
    assert len(trace) == -(-16 // block)
    m, denom = trace[-1]
    torch.testing.assert_close(
        torch.exp(x.double() - m) / denom, torch.softmax(x.double(), 0)
    )
    assert [t[0] for t in trace] == sorted(
        t[0] for t in trace
    )  # the running max never drops
    with pytest.raises(ValueError, match="block >= 1"):
        online_softmax_trace(x, 0)


@pytest.mark.parametrize(
    "impl", ["reference", "sdpa", "tiled"]
)  # flex: tests/test_flex.py
@pytest.mark.parametrize("kv_heads", [1, 2, 6], ids=["mqa", "gqa", "mha"])
def test_grouped_kv_heads_equal_repeated_heads(impl, kv_heads):
    from companion.ops.grouped import expand_kv

    torch.manual_seed(0)
    q = torch.randn(2, 6, 9, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, 13, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, 13, 8, requires_grad=True)
    out = attention(q, k, v, impl=impl, causal=True)
    want = naive_attention(q, expand_kv(k, 6), expand_kv(v, 6), causal=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref = torch.autograd.grad((want * g).sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        attention(q, torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8), impl=impl)


@pytest.mark.parametrize("kv_heads", [1, 2, 6], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("t", [1, 4], ids=["decode", "T4"])
def test_grouped_attention_equals_the_reference_without_repeating_kv(kv_heads, t):
    from companion.ops.grouped import expand_kv, grouped_attention
    from companion.ops.masks import causal_mask

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, t, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, 11, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, 11, 5, generator=gen, requires_grad=True)
    mask = causal_mask(t, 11) & (torch.rand(2, 1, 1, 11, generator=gen) > 0.3)
    mask[..., 0] = True  # every query keeps a key
    out = grouped_attention(q, k, v, mask=mask, scale=0.4)
    want = naive_attention(q, expand_kv(k, 6), expand_kv(v, 6), mask=mask, scale=0.4)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref = torch.autograd.grad((want * g).sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        grouped_attention(q, torch.randn(2, 4, 11, 8), torch.randn(2, 4, 11, 5))
