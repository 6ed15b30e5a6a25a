"""The chunked gated delta rule kernels equal the torch chunk form and the token loop,
outputs and final state, and give the torch form's gradients (interpreted on CPU where
no CUDA GPU is present)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from companion.kernels.gated_delta import kernel_sources  # noqa: E402
from companion.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from companion.layers.kimi_delta import KimiDeltaAttention  # noqa: E402
from companion.ops.delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from companion.ops.delta_rule_triton import chunk_gated_delta_rule_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 inputs: products of fp32 accuracy (tf32x3); bf16 inputs: TF32 on a GPU
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
DECAYS = {"strong": (1.0, 4.0), "weak": (0.0, 0.02)}  # g = −(lo + span·U(0, 1))


def _inputs(b=2, t=37, hk=2, h=2, dk=16, dv=32, decay="weak", seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    # keys of norm about 1 (β ≤ 1): the state stays bounded without the L2 norm too
    q, k = (torch.randn(b, t, hk, dk, generator=gen) * dk**-0.5 for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen)
    lo, span = DECAYS[decay]
    g = -(lo + span * torch.rand(b, t, h, generator=gen))
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen) if state else None
    return [None if x is None else x.to(DEVICE) for x in (q, k, v, g, beta, s0)]


def _close(got, want, dtype=torch.float32):
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


CASES = {  # name: (inputs, chunk_size, l2norm)
    "C16_state": ({}, 16, False),
    "C32_no_state": ({"state": False}, 32, False),
    "C16_strong_decay": ({"decay": "strong"}, 16, False),
    "C32_strong_l2": ({"decay": "strong", "seed": 1}, 32, True),
    "C16_gqa_dk32_dv16": ({"hk": 1, "dk": 32, "dv": 16, "t": 21}, 16, True),
    "C64_one_short_chunk": ({"t": 9, "b": 1}, 64, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_chunk_and_recurrent_forms(case):
    kw, c, l2 = CASES[case]
    q, k, v, g, beta, s0 = _inputs(**kw)
    args = (q, k, v, g, beta, s0, True)
    o, s = chunk_gated_delta_rule_triton(
        *args, chunk_size=c, use_qk_l2norm_in_kernel=l2
    )
    o_c, s_c = chunk_gated_delta_rule(*args, chunk_size=c, use_qk_l2norm_in_kernel=l2)
    o_r, s_r = recurrent_gated_delta_rule(*args, use_qk_l2norm_in_kernel=l2)
    assert o.shape == v.shape and o.dtype == q.dtype and s.shape == s_c.shape
    for got, chunk, loop in ((o, o_c, o_r), (s, s_c, s_r)):
        _close(got, chunk)
        _close(got, loop)


def test_scale_and_no_final_state():
    q, k, v, g, beta, s0 = _inputs(t=20)
    o, s = chunk_gated_delta_rule_triton(q, k, v, g, beta, s0, scale=0.3, chunk_size=16)
    o_c, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0, scale=0.3, chunk_size=16)
    assert s is None
    _close(o, o_c)


def test_bf16_inputs_against_the_fp32_form():
    q, k, v, g, beta, s0 = _inputs(t=24, decay="strong")
    o, s = chunk_gated_delta_rule_triton(
        *(x.bfloat16() for x in (q, k, v, g, beta)), s0, True, chunk_size=16,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    o_c, s_c = chunk_gated_delta_rule(
        q, k, v, g, beta, s0, True, chunk_size=16, use_qk_l2norm_in_kernel=True
    )
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    _close(o, o_c, torch.bfloat16)
    _close(s, s_c, torch.bfloat16)


@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2norm"])
def test_gradients_equal_the_torch_chunk_form(l2):
    leaves = [x.requires_grad_() for x in _inputs(t=21, hk=1, decay="strong", seed=2)]
    leaves_c = [x.detach().clone().requires_grad_() for x in leaves]
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(2, 21, 2, 32, generator=gen).to(DEVICE)
    ds = torch.randn(2, 2, 16, 32, generator=gen).to(DEVICE)
    o, s = chunk_gated_delta_rule_triton(
        *leaves, True, chunk_size=16, use_qk_l2norm_in_kernel=l2
    )
    o_c, s_c = chunk_gated_delta_rule(
        *leaves_c, True, chunk_size=16, use_qk_l2norm_in_kernel=l2
    )
    torch.autograd.backward((o, s), (do, ds))
    torch.autograd.backward((o_c, s_c), (do, ds))
    for name, x, y in zip(
        ("q", "k", "v", "g", "beta", "s0"), leaves, leaves_c, strict=True
    ):
        assert x.grad is not None, name
        _close(x.grad, y.grad)


def test_layer_with_triton_equals_chunk():
    torch.manual_seed(0)
    chunk = GatedDeltaNet(32, 1, 2, 16, 32, impl="chunk", chunk_size=16).to(DEVICE)
    triton_layer = GatedDeltaNet(32, 1, 2, 16, 32, impl="triton", chunk_size=16)
    triton_layer.load_state_dict(chunk.state_dict())
    triton_layer.to(DEVICE)
    x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y, y_c = triton_layer(x), chunk(x)
    _close(y, y_c)
    y.square().sum().backward()
    y_c.square().sum().backward()
    _close(triton_layer.in_proj_qkvz.weight.grad, chunk.in_proj_qkvz.weight.grad)
    _close(triton_layer.A_log.grad, chunk.A_log.grad)


def test_layer_with_triton_prefill_then_steps_equals_full_forward():
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 1, 2, 16, 16, impl="triton", chunk_size=16).to(DEVICE)
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        want = layer(x)
        cache = layer.new_cache(2, 20, device=DEVICE)
        outs = [layer(x[:, :17], cache=cache)]  # a full chunk and one token
        outs += [layer(x[:, i : i + 1], cache=cache) for i in range(17, 20)]
    _close(torch.cat(outs, dim=1), want)


@pytest.mark.parametrize("rule", ["delta", "linear"])
def test_layer_rejects_triton_for_other_rules(rule):
    with pytest.raises(ValueError, match="needs rule='gated_delta'"):
        GatedDeltaNet(32, 1, 2, 16, 32, impl="triton", rule=rule)
    with pytest.raises(
        ValueError, match=r"impl must be one of \('chunk', 'recurrent'\)"
    ):
        KimiDeltaAttention(32, 2, 16, impl="triton")


BAD = {  # name: (change to the inputs, error pattern)
    "chunk_size": ({"chunk_size": 8}, r"chunk_size must be one of \(16, 32, 64\)"),
    "chunk_size_48": ({"chunk_size": 48}, "chunk_size must be one of"),
    "g_shape": ({"g": lambda g: g[:, :, :1]}, r"g must have shape \(B, T, H\)"),
    "beta_shape": ({"beta": lambda b: b[:, :-1]}, r"beta must have shape \(B, T, H\)"),
    "D_k": (
        {"q": lambda q: q[..., :8], "k": lambda k: k[..., :8], "s0": lambda s: s[..., :8, :]},
        "D_k must be one",
    ),
    "k_shape": ({"k": lambda k: k[:, :-1]}, "q and k must have the same shape"),
    "state": ({"s0": lambda s: s[:, :1]}, r"initial_state must have shape"),
    "g_positive": ({"g": lambda g: g + 1}, r"g must be finite and <= 0"),
    "beta_nan": ({"beta": lambda b: b / 0}, r"beta must be finite and in \[0, 2\]"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_names_the_argument(bad):
    change, pattern = BAD[bad]
    x = dict(zip(("q", "k", "v", "g", "beta", "s0"), _inputs(t=5), strict=True))
    c = change.get("chunk_size", 16)
    x.update({n: f(x[n]) for n, f in change.items() if n != "chunk_size"})
    with pytest.raises(ValueError, match=pattern):
        chunk_gated_delta_rule_triton(*x.values(), chunk_size=c)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, g, beta, _ = (x.cpu() if x is not None else x for x in _inputs(t=5))
    with pytest.raises(RuntimeError, match="runs on a CUDA GPU"):
        chunk_gated_delta_rule_triton(q, k, v, g, beta)


def test_kernel_sources_are_the_two_kernels():
    src = kernel_sources()
    assert src.count("@triton.jit") == 2 and "def _wy_kernel" in src
    assert "for n in range(0, tl.cdiv(T, C))" in src  # the one pass over the chunks
