"""Chunked cross-entropy (chapter 12): the same loss and gradients as the full-logits
reference, and a peak memory that no longer grows with the number of rows."""

from __future__ import annotations

import pytest
import torch

from companion.analysis.peak_memory import PeakMemory
from companion.ops.cross_entropy import (
    chunked_cross_entropy,
    logits_bytes,
    naive_cross_entropy,
)


def _data(n=37, d=16, v=101, seed=0, ignore=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore:
        targets[::5] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 8, 37, 100], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("ignore", [False, True], ids=["all-rows", "ignore-index"])
def test_chunked_matches_reference_loss_and_gradients(chunk, ignore):
    hidden, weight, targets = _data(ignore=ignore)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = naive_cross_entropy(h1, w1, targets)
    out = chunked_cross_entropy(h2, w2, targets, chunk_size=chunk)
    torch.testing.assert_close(out.double(), ref.double(), rtol=1e-6, atol=1e-6)
    (ref * 3.0).backward()
    (out * 3.0).backward()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-6)


def test_chunked_peak_memory_is_bounded_by_the_chunk():
    hidden, weight, targets = (
        t.float() if t.is_floating_point() else t for t in _data(n=512, v=2000)
    )
    peaks = {}
    for name, fn in (
        ("naive", naive_cross_entropy),
        ("chunked", chunked_cross_entropy),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with PeakMemory("cpu") as pm:
            fn(
                h, w, targets, **({"chunk_size": 32} if name == "chunked" else {})
            ).backward()
        peaks[name] = pm.peak_bytes
    assert peaks["naive"] >= logits_bytes(
        1, 512, 2000
    )  # the full fp32 logits, at least once
    assert peaks["chunked"] < logits_bytes(1, 512, 2000) / 4


def test_logits_bytes_and_errors():
    for dtype in (torch.float32, torch.bfloat16):  # against real logits tensors
        real = torch.empty(3, 7, 101, dtype=dtype)
        assert logits_bytes(3, 7, 101, real.element_size()) == real.nbytes
    with pytest.raises(ValueError, match="vocab_size"):
        logits_bytes(1, 1, 0)
    hidden, weight, targets = _data()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(hidden, weight, targets[:-1])
