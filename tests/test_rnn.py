"""Recurrent layers: the written-out cells agree with PyTorch's fused kernels (chapter 01)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from companion.layers.rnn import (
    GRU,
    IMPLS,
    LSTM,
    RNN,
    RecurrentLM,
    autograd_depth,
    distant_recall,
    lstm_cell,
)


@dataclass(frozen=True)
class Case:
    id: str
    layer: type
    b: int = 3
    t: int = 7
    e: int = 5
    h: int = 11
    bias: bool = True
    with_state: bool = False


CASES = [
    Case(f"{cls.__name__}-{suffix}", cls, **kw)
    for cls in (RNN, LSTM, GRU)
    for suffix, kw in (
        ("zero-state", {}),
        ("given-state", {"with_state": True}),
        ("no-bias-odd-sizes", {"b": 1, "t": 13, "e": 3, "h": 9, "bias": False}),
        ("one-step", {"t": 1, "with_state": True}),
    )
]


def _state(case: Case, gen: torch.Generator):
    if not case.with_state:
        return None
    if case.layer is LSTM:
        return tuple(torch.randn(case.b, case.h, generator=gen) for _ in range(2))
    return torch.randn(case.b, case.h, generator=gen)


def _flat(state) -> list[torch.Tensor]:
    return list(state) if isinstance(state, tuple) else [state]


def _run(layer, x, state, impl: str):
    """Output, final state and the gradients of a fixed loss w.r.t. x, state and weights."""
    x = x.detach().requires_grad_()
    state = (
        None if state is None else [s.detach().requires_grad_() for s in _flat(state)]
    )
    arg = (
        None
        if state is None
        else (tuple(state) if isinstance(layer, LSTM) else state[0])
    )
    out, final = layer(x, arg, impl=impl)
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen)).sum()
    loss = loss + sum(
        (f * torch.randn(f.shape, generator=gen)).sum() for f in _flat(final)
    )
    inputs = [x, *(state or []), *layer.parameters()]
    grads = torch.autograd.grad(loss, inputs)
    return out.detach(), [f.detach() for f in _flat(final)], grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_matches_torch_forward_and_backward(case: Case):
    torch.manual_seed(0)
    layer = case.layer(case.e, case.h, bias=case.bias)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.b, case.t, case.e, generator=gen)
    state = _state(case, gen)
    out_r, fin_r, g_r = _run(layer, x, state, "reference")
    out_t, fin_t, g_t = _run(layer, x, state, "torch")
    assert out_r.shape == (case.b, case.t, case.h)
    torch.testing.assert_close(out_r, out_t, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_r[:, -1], fin_r[0])  # the last output is the final h
    for a, b in zip(fin_r, fin_t, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert len(g_r) == len(g_t)
    for a, b in zip(g_r, g_t, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_lstm_cell_gate_order_is_i_f_g_o():
    # A huge forget-gate bias with the other gates shut must copy c through unchanged.
    h_size = 4
    w_ih, w_hh = torch.zeros(4 * h_size, 2), torch.zeros(4 * h_size, h_size)
    b = torch.zeros(4 * h_size)
    b[:h_size] = -50.0  # i shut
    b[h_size : 2 * h_size] = 50.0  # f open
    c = torch.randn(2, h_size)
    _, c_next = lstm_cell(
        torch.randn(2, 2), torch.randn(2, h_size), c, w_ih, w_hh, b, None
    )
    torch.testing.assert_close(c_next, c)


@pytest.mark.parametrize("layer_cls", [RNN, LSTM, GRU], ids=lambda c: c.__name__)
def test_errors_name_the_problem(layer_cls):
    layer = layer_cls(4, 6)
    with pytest.raises(ValueError, match="impl must be one of"):
        layer(torch.randn(2, 3, 4), impl="cudnn")
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, 4\)"):
        layer(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="T >= 1"):
        layer(torch.randn(2, 0, 4))
    bad = torch.zeros(2, 7)
    with pytest.raises(ValueError, match=r"state tensors must have shape \(B, H\)"):
        layer(torch.randn(2, 3, 4), (bad, bad) if layer_cls is LSTM else bad)
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        layer_cls(4, 0)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_recurrent_lm_shapes_and_impls_agree(kind):
    torch.manual_seed(0)
    lm = RecurrentLM(10, 6, 8, kind=kind)
    ids = torch.randint(0, 10, (2, 5))
    ref = lm(ids)
    assert ref.shape == (2, 5, 10)
    lm.impl = "torch"
    torch.testing.assert_close(lm(ids), ref, atol=1e-5, rtol=1e-4)
    assert lm.num_params() == sum(p.numel() for p in lm.parameters())
    with pytest.raises(ValueError, match="kind must be one of"):
        RecurrentLM(10, 6, 8, kind="transformer")
    with pytest.raises(ValueError, match="impl must be one of"):
        RecurrentLM(10, 6, 8, impl="fast")
    with pytest.raises(ValueError, match="input_ids must be int token ids"):
        lm(torch.randn(2, 5))


def test_autograd_depth_grows_with_the_reference_loop_only():
    torch.manual_seed(0)
    layer = LSTM(3, 4)
    depths = [autograd_depth(layer(torch.randn(1, t, 3))[0].sum()) for t in (4, 8, 16)]
    assert (
        depths[1] - depths[0] == (depths[2] - depths[1]) // 2 > 0
    )  # exactly linear in T
    fused = [
        autograd_depth(layer(torch.randn(1, t, 3), impl="torch")[0].sum())
        for t in (4, 16)
    ]
    assert fused[0] == fused[1]  # one fused node, whatever T
    assert autograd_depth(torch.ones(2)) == 0
    assert IMPLS == ("reference", "torch")


def test_distant_recall_places_the_signal():
    gen = torch.Generator().manual_seed(0)
    x, y, dist = distant_recall(64, 20, n_signals=4, n_distractors=9, generator=gen)
    assert x.shape == y.shape == (64, 20) and dist.shape == (64,)
    assert (x[:, -1] == 0).all() and (y[:, :-1] == -100).all()
    rows = torch.arange(64)
    assert torch.equal(x[rows, 19 - dist], y[:, -1])
    assert ((y[:, -1] >= 1) & (y[:, -1] <= 4)).all()
    body = x[:, :-1].clone()
    body[rows, 19 - dist] = 100
    assert (
        (body >= 5) & (body <= 13) | (body == 100)
    ).all()  # only distractors elsewhere
    assert dist.min() >= 1 and dist.max() <= 19
    _, _, fixed = distant_recall(8, 20, 4, 9, distance=7, generator=gen)
    assert (fixed == 7).all()
    with pytest.raises(ValueError, match="distance must lie in"):
        distant_recall(8, 20, 4, 9, distance=20)
    with pytest.raises(ValueError, match="need length >= 2"):
        distant_recall(8, 1, 4, 9)
