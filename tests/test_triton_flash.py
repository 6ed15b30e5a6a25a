"""The Triton FlashAttention kernels against the reference, forward and backward.

Interpreted on CPU tensors where no CUDA GPU is present (tests/conftest.py), compiled on
CUDA (there also in bf16 and fp16, against an fp32 reference)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from companion.kernels.flash_attention import (  # noqa: E402
    _FlashAttention,
    flash_attention,
    flash_forward,
    forward_kernel_source,
)
from companion.layers.kv_cache import position_mask  # noqa: E402
from companion.ops.attention import masked_scores, naive_attention  # noqa: E402
from companion.ops.dispatch import attention  # noqa: E402
from companion.ops.grouped import expand_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (H, H_kv, T, S, causal, window): T and S span several 16-wide tiles, not a multiple
CASES = {
    "full": (2, 2, 24, 40, False, None),
    "causal-T=S": (2, 2, 37, 37, True, None),
    "causal-T<S": (2, 2, 19, 45, True, None),
    "gqa-4:2-causal": (4, 2, 21, 21, True, None),
    "gqa-4:1": (4, 1, 17, 30, False, None),
    "window-7": (2, 1, 35, 35, True, 7),
    "window-5-T<S": (2, 2, 13, 40, True, 5),
    "window-2": (2, 2, 33, 33, True, 2),  # a key's last query opens a new query tile
}
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
# fp32 on CUDA multiplies in TF32; bf16/fp16 are compared with an fp32 reference
TOL = {torch.float32: 2e-2 if DEVICE == "cuda" else 1e-5, torch.float16: 1e-2,
       torch.bfloat16: 5e-2}  # fmt: skip


def _inputs(h, h_kv, t, s, d=16, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, t, d), (b, h_kv, s, d), (b, h_kv, s, d), (b, h, t, d)]
    return [torch.randn(*x, generator=g).to(DEVICE) for x in shapes]


def _mask(t, s, window):
    if window is None:
        return None
    return position_mask(torch.arange(t) + s - t, torch.arange(s), window).to(DEVICE)


def _reference(q, k, v, causal, window, mask=None):
    """Outputs and (dq, dk, dv) of the reference with K/V repeated per query head."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    h = q.shape[1]
    mask = mask if mask is not None else _mask(q.shape[2], k.shape[2], window)
    out = naive_attention(q, expand_kv(k, h), expand_kv(v, h), mask=mask, causal=causal)
    return out, q, k, v


def _check(q, k, v, d_out, causal, window, dtype, mask=None):
    want, *leaves = _reference(q, k, v, causal, window, mask)
    want_grads = torch.autograd.grad(want, leaves, d_out.double())
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = flash_attention(q, k, v, causal=causal, window=window)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(dtype))
    tol = TOL[dtype]
    for name, got, ref in zip(
        "o q k v".split(), (out, *grads), (want, *want_grads), strict=True
    ):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_backward_match_the_reference(case, dtype):
    h, h_kv, t, s, causal, window = case
    q, k, v, d_out = _inputs(h, h_kv, t, s)
    _check(q, k, v, d_out, causal, window, dtype)


def test_a_query_with_no_visible_key_outputs_zeros_and_no_gradient():
    # causal and window never leave a row empty; a band past the keys' end does: query
    # i sees key i + 5 only, so the last 5 of 16 rows see nothing
    q, k, v, d_out = _inputs(2, 1, 16, 16)
    i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
    want, *leaves = _reference(q, k, v, False, None, mask=(j - i == 5).to(DEVICE))
    want_grads = torch.autograd.grad(want, leaves, d_out.double())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = _FlashAttention.apply(q, k, v, (5, 5), 0.25)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert (out[:, :, 11:] == 0).all() and (grads[0][:, :, 11:] == 0).all()
    for name, got, ref in zip(
        "o q k v".split(), (out, *grads), (want, *want_grads), strict=True
    ):
        torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2, msg=name)


def test_the_lse_is_the_logsumexp_of_the_scores():
    q, k, v, _ = _inputs(4, 2, 19, 45)
    mask = _mask(19, 45, 9)
    out, lse = flash_forward(q, k, v, causal=True, window=9)
    scores, _ = masked_scores(q, expand_kv(k, 4), mask=mask, causal=True)
    tol = TOL[torch.float32]
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=tol, rtol=tol)
    assert lse.dtype == torch.float32 and out.shape == q.shape


def test_dispatch_by_name_equals_the_reference():
    q, k, v, _ = _inputs(4, 2, 21, 29)
    for causal in (False, True):
        want = attention(q, k, v, impl="reference", causal=causal)
        got = attention(q, k, v, impl="triton", causal=causal)
        torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=1e-3)


def test_a_causal_layer_runs_on_the_kernel():
    from companion.layers.mha import MultiHeadAttention

    torch.manual_seed(0)
    ref = MultiHeadAttention(64, 4, n_kv_heads=2, causal=True, impl="reference")
    tri = MultiHeadAttention(64, 4, n_kv_heads=2, causal=True, impl="triton")
    tri.load_state_dict(ref.state_dict())
    ref, tri = ref.to(DEVICE), tri.to(DEVICE)
    x = torch.randn(2, 21, 64, device=DEVICE, requires_grad=True)
    (want,), (got,) = (torch.autograd.grad(m(x).square().sum(), x) for m in (ref, tri))
    torch.testing.assert_close(tri(x), ref(x), atol=TOL[torch.float32], rtol=1e-3)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=1e-3)
    # a window reaches the form as a bool mask, which the kernel does not take
    windowed = MultiHeadAttention(64, 4, causal=True, window=4, impl="triton")
    with pytest.raises(ValueError, match="impl='triton' takes causal=True or False"):
        windowed.to(DEVICE)(x)


def test_dispatch_names_the_masks_the_triton_impl_takes():
    q, k, v, _ = _inputs(2, 2, 8, 8)
    mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="impl='triton' takes causal=True or False"):
        attention(q, k, v, impl="triton", mask=mask)
    with pytest.raises(ValueError, match="impl='triton' has no attention dropout"):
        attention(q, k, v, impl="triton", dropout_p=0.1)


BAD = {
    "q-3d": ({"q": (2, 8, 16)}, ValueError, r"^q must have shape \(B, H, T, D\)"),
    "k-other-D": ({"k": (1, 2, 8, 32)}, ValueError, r"^k must have shape \(1, H_kv"),
    "v-other-S": ({"v": (1, 2, 9, 16)}, ValueError, r"^v must have shape \(1, 2, 8"),
    "heads": ({"k": (1, 3, 8, 16), "v": (1, 3, 8, 16)}, ValueError, "multiple of k's"),
    "D-24": ({"q": (1, 2, 8, 24), "k": (1, 2, 8, 24), "v": (1, 2, 8, 24)},
             ValueError, r"needs D in \(16, 32, 64, 128, 256\), got D=24"),
    "int-q": ({"dtype": torch.int64}, TypeError, r"^q must have dtype in"),
}  # fmt: skip


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_bad_inputs_name_the_argument(bad):
    shapes, error, match = bad
    dtype = shapes.get("dtype", torch.float32)
    x = {n: torch.zeros(shapes.get(n, (1, 2, 8, 16)), device=DEVICE) for n in "qkv"}
    x["q"] = x["q"].to(dtype)
    with pytest.raises(error, match=match):
        flash_attention(x["q"], x["k"], x["v"])


@pytest.mark.parametrize(
    "kw, match",
    [({"window": 4}, "window must be a positive int with causal=True"),
     ({"causal": True, "window": 0}, "window must be a positive int"),
     ({"causal": True, "s": 4}, r"causal=True needs S >= T, got T=8, S=4")],
)  # fmt: skip
def test_bad_masks_are_named(kw, match):
    kw = dict(kw)
    s = kw.pop("s", 8)
    q, k, v = (
        torch.zeros(1, 1, 8, 16),
        torch.zeros(1, 1, s, 16),
        torch.zeros(1, 1, s, 16),
    )
    with pytest.raises(ValueError, match=match):
        flash_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), **kw)


def test_cpu_tensors_without_the_interpreter_get_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match="runs on a CUDA GPU, or on CPU tensors"):
        flash_attention(q, q, q)


def test_the_forward_kernel_source_is_the_triton_function():
    src = forward_kernel_source()
    assert src.startswith("@triton.jit\ndef _flash_forward_kernel(")
    assert "tl.exp2" in src and "tl.dot" in src
