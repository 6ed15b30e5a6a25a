"""The decode form of a linear map against ``F.linear``, forward and backward, and the
mode that routes one-row linear maps of the compiled decode step to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import companion.ops.matvec as mv
from companion.models import generation
from companion.ops.matvec import OneRowLinears, matvec


@pytest.mark.parametrize("shape", [(7,), (1, 1, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_matvec_equals_linear_forward_and_backward(shape, bias):
    """Same values and gradients as ``F.linear`` (float64: only the summation order
    differs, so 1e-12 holds)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True) if bias else None
    grad = torch.randn(*shape[:-1], 5, dtype=torch.float64)
    got, want = matvec(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    leaves = [t for t in (x, w, b) if t is not None]
    g_got = torch.autograd.grad(got, leaves, grad)
    g_want = torch.autograd.grad(want, leaves, grad)
    for a, e in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


def _marked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the decode form by a marker: every output entry 7."""
    monkeypatch.setattr(
        mv, "matvec", lambda x, w, b=None: torch.full((*x.shape[:-1], w.shape[0]), 7.0)
    )


def test_one_row_linears_route_single_rows_only(monkeypatch):
    _marked(monkeypatch)
    layer = nn.Linear(6, 4)
    one, many = torch.randn(1, 1, 6), torch.randn(1, 3, 6)
    with OneRowLinears():
        assert (layer(one) == 7).all()
        assert (F.linear(input=one, weight=layer.weight) == 7).all()  # by keyword
        assert not (layer(many) == 7).any()
        assert not (one.sum() == 7).any()  # other functions pass through
    assert not (layer(one) == 7).any()  # outside the mode: F.linear


def test_compiled_decode_step_runs_inside_the_mode(monkeypatch):
    """``generate(..., compile=True)`` calls its compiled step with one-row linear maps
    in the decode form (the compiled step is replaced by one linear map here)."""
    _marked(monkeypatch)
    layer = nn.Linear(6, 4)
    monkeypatch.setattr(generation, "_compiled_step", lambda m, t, p, c: layer(t))
    out = generation._step(True)(None, torch.randn(1, 1, 6), None, None)
    assert (out == 7).all()
    assert generation._step(False) is generation.decode_one_token
