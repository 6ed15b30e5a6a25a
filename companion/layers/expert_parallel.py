"""Expert parallelism: one MoE layer split over the P ranks of a process group
(chapter 10).

Shape legend: N tokens of this rank (B·T flattened), d model width, E routed experts,
L = E/P experts per rank, k experts per token, S = N·k (token, expert) pairs this rank
sends, R pairs it receives, P ranks.

:class:`ExpertParallelMoE` takes a single-process
:class:`~companion.layers.moe.MoEFeedForward` and keeps, on rank r, the experts
``r·L .. (r+1)·L - 1`` (contiguous placement), the router and the shared expert
(replicated). Each rank routes its own tokens, sends each (token, expert) copy to the
rank that holds the expert (:func:`all_to_all`, counts exchanged first), runs its local
experts on what it received, sends the outputs back with a second all-to-all and adds
them up with the routing weights. :func:`all_to_all` is differentiable: its backward is
the same exchange with the split sizes swapped. Any backend: gloo on a CPU, NCCL on GPUs.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from companion.layers.moe import GLUExperts, MoEFeedForward
from companion.layers.router import Routing

__all__ = ["AllToAll", "ExpertParallelMoE", "Traffic", "all_to_all", "exchange_counts"]


def _exchange(
    x: Tensor, send: list[int], recv: list[int], group: ProcessGroup | None
) -> Tensor:
    """Rows ``send[j]`` of ``x`` go to rank j; ``recv[j]`` rows arrive from rank j."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` with a gradient: the backward sends each row's gradient back
    to the rank it came from (the same exchange, ``send`` and ``recv`` swapped)."""

    @staticmethod
    def forward(
        ctx: object,
        x: Tensor,
        send: list[int],
        recv: list[int],
        group: ProcessGroup | None,
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(
    x: Tensor, send: list[int], recv: list[int], group: ProcessGroup | None = None
) -> Tensor:
    """``x (Σ send, ...)`` -> ``(Σ recv, ...)``: the first ``send[0]`` rows go to rank
    0, the next ``send[1]`` to rank 1, ...; what arrives is stacked in rank order."""
    return AllToAll.apply(x, send, recv, group)


def exchange_counts(send: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Each rank's ``send (P,)`` counts -> ``recv (P,)``: how many rows every rank will
    send to this one (the exchange that sizes the all-to-all)."""
    return _exchange(send, [1] * len(send), [1] * len(send), group)


class Traffic(NamedTuple):
    """One layer call's rows, per peer rank ``(P,)``: (token, expert) copies this rank
    sent out (``dispatch``) and expert outputs it sent back (``combine``), and the
    bytes of one row in each direction. The rank's own entry stays on the rank."""

    dispatch: torch.Tensor
    combine: torch.Tensor
    row_bytes: int

    def sent_bytes(self, rank: int) -> int:
        """Bytes this rank put on the wire, both exchanges, its own entry left out."""
        rows = self.dispatch.sum() + self.combine.sum()
        return int(rows - self.dispatch[rank] - self.combine[rank]) * self.row_bytes


class ExpertParallelMoE(nn.Module):
    """``moe``'s layer as rank ``group.rank()`` of P holds it: experts ``r·L ..
    (r+1)·L - 1``, the router and the shared expert replicated. ``x (..., d)`` ->
    ``(..., d)``, this rank's tokens only. ``last_traffic`` (:class:`Traffic`) counts
    the last call's exchanges; ``last_routing`` is the routing of this rank's tokens."""

    def __init__(self, moe: MoEFeedForward, group: ProcessGroup | None = None) -> None:
        super().__init__()
        if moe.routing != "topk" or not isinstance(moe.experts, GLUExperts):
            raise ValueError("moe must route by score (top-k) with GLUExperts")
        self.group = group
        self.rank, self.n_ranks = dist.get_rank(group), dist.get_world_size(group)
        n_experts, d_ff2, d_model = moe.experts.gate_up.shape
        if n_experts % self.n_ranks:
            raise ValueError(
                f"group has {self.n_ranks} ranks, which must divide the moe's "
                f"n_experts={n_experts}"
            )
        self.n_local = n_experts // self.n_ranks
        self.first = self.rank * self.n_local  # first expert this rank holds
        self.router = copy.deepcopy(moe.router)
        self.shared = copy.deepcopy(moe.shared)
        self.shared_gate = copy.deepcopy(moe.shared_gate)
        src = moe.experts
        limit = {} if src.limit is None else {"limit": src.limit}
        self.experts = GLUExperts(
            self.n_local, d_model, d_ff2 // 2, impl=src.impl, **limit
        )
        mine = slice(self.first, self.first + self.n_local)
        with torch.no_grad():
            self.experts.gate_up.copy_(src.gate_up[mine])
            self.experts.down.copy_(src.down[mine])
        self.experts.to(src.gate_up)  # its dtype and device
        self.last_routing: Routing | None = None
        self.last_traffic: Traffic | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        self.last_routing = Routing(*self.router(flat))
        y = self.dispatch_combine(flat, *self.last_routing[:2])  # (N, d)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, d)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            y = y + shared
        return y.view(x.shape)

    def dispatch_combine(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """``x (N, d)``, ``weights (N, k)``, ``indices (N, k)`` -> ``(N, d)``: each
        (token, expert) copy to the expert's rank and back, weighted and summed."""
        k, group = indices.shape[1], self.group
        expert = indices.reshape(-1)  # (S,) pair n·k + j -> its expert
        order = expert.argsort(stable=True)  # (S,) pairs by expert, so by rank
        token = order // k  # (S,) the token of each sorted pair
        owner = expert[order] // self.n_local  # (S,) the rank that holds its expert
        send_t = torch.bincount(owner, minlength=self.n_ranks)  # (P,)
        recv_t = exchange_counts(send_t, group)  # (P,)
        send, recv = send_t.tolist(), recv_t.tolist()
        # dispatch: the copies and the local id of their expert, R of each here
        got = all_to_all(x[token], send, recv, group)  # (R, d)
        local = _exchange(expert[order] - owner * self.n_local, send, recv, group)
        ones = torch.ones(len(local), 1, dtype=weights.dtype, device=x.device)
        out = self.experts(got, ones, local[:, None]) if len(local) else got.clone()
        # (R, d), one expert each; with R = 0 still on the graph, for the backward
        # combine: every output back to its token's rank, in the order it left
        back = all_to_all(out, recv, send, group)  # (S, d)
        w = weights.reshape(-1)[order, None].to(back.dtype)  # (S, 1)
        self.last_traffic = Traffic(send_t, recv_t, x.shape[1] * x.element_size())
        return torch.zeros_like(x).index_add(0, token, back * w)
