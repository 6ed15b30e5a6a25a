"""PeakMemory: counts what is allocated inside the block, deterministically, on any device."""

from __future__ import annotations

import pytest
import torch

from companion.analysis.peak_memory import PeakMemory
from companion.ops.attention import naive_attention
from companion.ops.tiled import tiled_attention

MIB = 2**20


def test_one_allocation_is_counted():
    with PeakMemory("cpu") as pm:
        x = torch.empty(1024, 1024)  # 4 MiB of fp32
    assert pm.peak_bytes >= 4 * MIB
    assert pm.peak_mib == pytest.approx(4.0)
    del x


def test_freed_memory_is_given_back():
    with PeakMemory("cpu") as pm:
        for _ in range(5):
            x = torch.ones(256, 1024)  # 1 MiB, freed when x is rebound
            del x
    assert pm.peak_bytes == pytest.approx(1 * MIB)


def test_tensors_from_before_entry_do_not_count():
    x = torch.zeros(1024, 1024)
    with PeakMemory("cpu") as pm:
        x.add_(1)  # in place: same storage
        y = x[:10].view(-1)  # views: same storage
    assert pm.peak_bytes == 0
    del y


def test_same_code_same_number():
    q = torch.randn(1, 2, 128, 32, requires_grad=True)

    def work():
        out = naive_attention(q, q, q, causal=True)
        out.sum().backward()

    peaks = []
    for _ in range(3):
        q.grad = None
        with PeakMemory("cpu") as pm:
            work()
        peaks.append(pm.peak_bytes)
    assert len(set(peaks)) == 1 and peaks[0] > 0


def qkv(t: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(1, 1, t, 64, generator=gen, requires_grad=requires_grad)
        for _ in range(3)
    ]


def test_naive_attention_peaks_well_above_tiled():
    q, k, v = qkv(1024)
    scores_bytes = 1024 * 1024 * 4  # one (T, S) fp32 matrix
    with torch.no_grad(), PeakMemory("cpu") as naive:
        naive_attention(q, k, v, causal=True)
    with torch.no_grad(), PeakMemory("cpu") as tiled:
        tiled_attention(q, k, v, causal=True)
    assert naive.peak_bytes >= 2 * scores_bytes
    assert tiled.peak_bytes < scores_bytes / 4
    assert naive.peak_bytes > 10 * tiled.peak_bytes


def test_tiled_backward_never_builds_the_score_matrix():
    q, k, v = qkv(1024, requires_grad=True)
    with PeakMemory("cpu") as pm:
        out = tiled_attention(q, k, v, causal=True)
        out.sum().backward()
    # out, lse, the fp32 dq/dk/dv accumulators and the grads are all O(T·D): about 1.3 MiB
    assert pm.peak_bytes < 1024 * 1024 * 4 / 2  # under half of one (T, S) fp32 matrix


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocation_is_counted():
    with PeakMemory("cuda") as pm:
        x = torch.empty(1024, 1024, device="cuda")
    assert pm.peak_bytes >= 4 * MIB
    del x
