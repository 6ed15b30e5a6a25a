"""Expert parallelism (chapter 10): the layer split over P gloo processes equals the
single-process MoE forward and backward, and its counted bytes equal the count from the
routing; the all-to-all volume formulas."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from companion.analysis.expert_traffic import (
    all_to_all_bytes,
    rank_load,
    traffic_matrix,
)
from companion.layers.expert_parallel import ExpertParallelMoE
from companion.layers.moe import MoEFeedForward
from companion.models.presets import preset

D, E, K, F, N = 12, 8, 2, 6, 10  # width, experts, top-k, expert width, tokens/rank


def _full(case: str) -> MoEFeedForward:
    """The single-process layer, identical on every rank (same seed), in fp64."""
    torch.manual_seed(0)
    if case == "shared":  # softmax, a gated shared expert
        moe = MoEFeedForward(D, E, K, F, shared_d_ff=8, shared_gate=True)
    else:  # "skewed": sigmoid, every token biased onto rank 0's experts
        moe = MoEFeedForward(D, E, K, F, scoring="sigmoid", selection_bias=True)
        moe.router.selection_bias[:2] = 10.0
    return moe.double()


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def _check(case: str, rank: int, world: int) -> None:
    full = _full(case)
    x = torch.randn(world * N, D, dtype=torch.float64)
    g = torch.randn_like(x)  # the upstream gradient
    mine = slice(rank * N, (rank + 1) * N)
    ep = ExpertParallelMoE(full)
    # the full layer on all the tokens
    xf = x.clone().requires_grad_()
    (full(xf) * g).sum().backward()
    y_full, indices = full(x).detach(), full.last_routing.indices
    # this rank's tokens only, through the all-to-alls
    xr = x[mine].clone().requires_grad_()
    y = ep(xr)
    (y * g[mine]).sum().backward()
    torch.testing.assert_close(y, y_full[mine], rtol=0, atol=1e-12)
    torch.testing.assert_close(xr.grad, xf.grad[mine], rtol=0, atol=1e-12)
    L = E // world
    experts = slice(rank * L, (rank + 1) * L)  # the experts this rank holds
    for name in ("gate_up", "down"):
        got = _grad(getattr(ep.experts, name))
        want = _grad(getattr(full.experts, name))[experts]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # replicated parts: each rank's gradient comes from its own tokens; the sum over
    # the ranks (an all-reduce, as data parallelism does) is the full layer's
    replicated = [n for n, _ in full.named_parameters() if not n.startswith("experts")]
    own = {n: _grad(p).clone() for n, p in ep.named_parameters() if n in replicated}
    full.zero_grad()
    (full(x)[mine] * g[mine]).sum().backward()  # the full layer, this rank's tokens
    for name, p in full.named_parameters():
        if name in replicated:
            torch.testing.assert_close(own[name], _grad(p), rtol=0, atol=1e-12)
            dist.all_reduce(own[name])
    full.zero_grad()
    (full(x) * g).sum().backward()
    for name, p in full.named_parameters():
        if name in replicated:
            torch.testing.assert_close(own[name], _grad(p), rtol=0, atol=1e-12)
    # the bytes: out = my copies bound for other ranks + others' copies sent back
    owner = indices // L  # (world·N, k) the rank of each chosen expert
    source = torch.arange(world * N)[:, None] // N  # the rank of each token
    out_rows = ((source == rank) & (owner != rank)).sum() + (
        (source != rank) & (owner == rank)
    ).sum()
    assert ep.last_traffic.sent_bytes(rank) == int(out_rows) * D * 8
    matrix = traffic_matrix(indices, source[:, 0], E, world)  # (P, P) copies
    assert torch.equal(ep.last_traffic.dispatch, matrix[rank])
    assert torch.equal(ep.last_traffic.combine, matrix[:, rank])
    if case == "skewed":  # nothing reaches the last rank's experts
        assert matrix[:, -1].sum() == 0


def _worker(rank: int, world: int, path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{path}", rank=rank, world_size=world
    )
    try:
        for case in ("shared", "skewed"):
            _check(case, rank, world)
        # bad input: experts that do not split over the ranks, hash routing
        with pytest.raises(ValueError, match="must divide the moe's n_experts=3"):
            ExpertParallelMoE(MoEFeedForward(D, 3, 1, F))
        hashed = MoEFeedForward(D, E, K, F, routing="hash", vocab_size=16)
        with pytest.raises(ValueError, match="top-k"):
            ExpertParallelMoE(hashed)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, str(Path(tmp) / "init")), nprocs=world)


def test_traffic_matrix_counts_pairs() -> None:
    torch.manual_seed(1)
    indices = torch.randint(0, E, (40, K))
    source = torch.randint(0, 4, (40,))
    matrix = traffic_matrix(indices, source, E, 4)
    want = torch.zeros(4, 4, dtype=torch.long)
    for n in range(40):
        for j in range(K):
            want[source[n], indices[n, j] // (E // 4)] += 1
    assert torch.equal(matrix, want)
    load = torch.bincount(indices.reshape(-1), minlength=E)
    assert torch.equal(rank_load(load, 4), matrix.sum(0))


def test_all_to_all_bytes_formula() -> None:
    cfg = preset("deepseek-v3")
    # k·d·(dispatch + combine bytes)·(P - 1)/P per token per MoE layer
    got = all_to_all_bytes(cfg, 8, dispatch_bytes=1, combine_bytes=2)
    assert got == pytest.approx(8 * 7168 * 3 * 7 / 8)
    assert all_to_all_bytes(cfg, 1) == 0
    with pytest.raises(ValueError, match="n_ranks"):
        all_to_all_bytes(cfg, 3)  # 3 does not divide 256 experts
    with pytest.raises(ValueError, match="moe"):
        all_to_all_bytes(preset("llama3-8b"), 2)
    with pytest.raises(ValueError, match="n_ranks"):
        traffic_matrix(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2), 8, 3)
