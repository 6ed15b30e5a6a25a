"""Who sends what to whom under expert parallelism (chapter 10).

Shape legend: N tokens, k experts per token, E routed experts, P ranks, L = E/P experts
per rank, placed contiguously (rank r holds experts ``r·L .. (r+1)·L - 1``, as
:class:`~companion.layers.expert_parallel.ExpertParallelMoE` places them).

* :func:`traffic_matrix` counts, from a routing, the (token, expert) copies each rank
  sends each rank: row = the token's rank, column = the expert's. Off the diagonal they
  cross the interconnect, twice (dispatch there, combine back).
* :func:`rank_load` sums the experts' loads over each rank's experts: the busiest rank
  sets the pace of both all-to-alls and of the expert matmuls.
* :func:`all_to_all_bytes` is the volume per token per MoE layer, one rank's view:
  k copies × d values × (dispatch + combine bytes) × the share of copies that leave
  the rank, (P - 1)/P when routing is uniform.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.checks import check_int, check_number
from companion.models.config import ModelConfig

__all__ = ["all_to_all_bytes", "moe_layers", "rank_load", "traffic_matrix"]


def _check_ranks(n_experts: int, n_ranks: int) -> None:
    check_int("n_ranks", n_ranks, 1)
    if n_experts % n_ranks:
        raise ValueError(
            f"n_ranks must divide n_experts={n_experts} (contiguous placement), "
            f"got {n_ranks}"
        )


def traffic_matrix(
    indices: Tensor, source: Tensor, n_experts: int, n_ranks: int
) -> Tensor:
    """``indices (N, k)`` chosen experts, ``source (N,)`` each token's rank -> ``(P,
    P)`` int64: entry [i, j] the copies rank i sends rank j."""
    _check_ranks(n_experts, n_ranks)
    owner = indices // (n_experts // n_ranks)  # (N, k) rank holding each expert
    pair = source.long()[:, None] * n_ranks + owner  # (N, k) flat (from, to)
    counts = torch.bincount(pair.reshape(-1).cpu(), minlength=n_ranks * n_ranks)
    return counts.view(n_ranks, n_ranks)


def rank_load(load: Tensor, n_ranks: int) -> Tensor:
    """Per-expert ``load (..., E)`` -> per-rank ``(..., P)``: the copies each rank's
    experts receive."""
    _check_ranks(load.shape[-1], n_ranks)
    return load.unflatten(-1, (n_ranks, -1)).sum(-1)


def moe_layers(cfg: ModelConfig) -> int:
    """The layers of ``cfg`` whose FFN is routed experts (the first ``dense_layers``
    are dense)."""
    if cfg.moe is None:
        raise ValueError("cfg has no moe part: a dense model sends no tokens")
    return cfg.n_layers - cfg.moe.dense_layers


def all_to_all_bytes(
    cfg: ModelConfig,
    n_ranks: int,
    *,
    dispatch_bytes: float = 2,
    combine_bytes: float = 2,
    off_rank: float | None = None,
) -> float:
    """Bytes one token's copies cross the interconnect in one MoE layer of ``cfg``:
    k·d·(``dispatch_bytes`` + ``combine_bytes``)·``off_rank``, ``off_rank`` the share
    of copies whose expert is on another rank ((P - 1)/P, uniform routing, if None).
    Bytes are per value: 2 for bf16, 1 for fp8."""
    if cfg.moe is None:
        raise ValueError("cfg has no moe part: a dense model sends no tokens")
    _check_ranks(cfg.moe.n_experts, n_ranks)
    check_number("dispatch_bytes", dispatch_bytes)
    check_number("combine_bytes", combine_bytes)
    share = (n_ranks - 1) / n_ranks if off_rank is None else off_rank
    check_number("off_rank", share)
    if share > 1:
        raise ValueError(f"off_rank must be a share in [0, 1], got {share}")
    copies = cfg.moe.experts_per_token * cfg.d_model
    return copies * (dispatch_bytes + combine_bytes) * share
