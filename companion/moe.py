"""Mixture of experts: a router sends each token to k of E expert FFNs (chapter 10).

Shape legend: N tokens (B·T flattened), d model width, E routed experts, k experts per token,
F hidden width of one expert, S = N·k (token, expert) pairs, G router groups.

Parameters, by name (what a parameter count sees; buffers are not parameters):

- :class:`TopKRouter`: ``weight (E, d)``, plus ``bias (E,)`` when ``bias=True`` (gpt-oss).
  ``selection_bias (E,)`` (DeepSeek-V3's balancing bias) is a buffer.
- :class:`GLUExperts`: ``gate_up (E, 2F, d)``, rows ``[gate; up]``, and ``down (E, d, F)``:
  E·3·F·d. Each slice is an ``nn.Linear`` weight, (out, in).
- :class:`GptOssExperts`: ``gate_up (E, 2F, d)`` with interleaved rows (gate = even rows, up =
  odd rows, as gpt-oss stores them), ``gate_up_bias (E, 2F)``, ``down (E, d, F)``,
  ``down_bias (E, d)``: E·(3·F·d + 2F + d).
- :class:`MoEFeedForward`: ``router.*``, ``experts.*``, the shared expert
  ``shared.{gate,up,down}.weight`` (3·d·shared_d_ff) and ``shared_gate.weight (1, d)``.

Experts run in two forms with one signature: :func:`experts_reference`, a loop over experts
with ``index_add``, and :func:`experts_grouped`, the (token, expert) pairs sorted by expert and
multiplied segment by segment in one grouped matmul (:func:`grouped_matmul`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ffn import GatedFeedForward

__all__ = [
    "EXPERT_IMPLS",
    "EXPERT_KINDS",
    "GROUPED_KERNELS",
    "SCORINGS",
    "GLUExperts",
    "GptOssExperts",
    "MoEFeedForward",
    "Routing",
    "TopKRouter",
    "expert_load",
    "experts_grouped",
    "experts_reference",
    "gpt_oss_glu",
    "grouped_matmul",
    "grouped_mm_available",
    "load_balancing_loss",
    "swiglu",
    "update_selection_bias",
]

SCORINGS = ("softmax", "sigmoid")
EXPERT_KINDS = ("glu", "gpt_oss")
GROUPED_KERNELS = ("auto", "grouped_mm", "segments")


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


class Routing(NamedTuple):
    """One routing decision: ``weights (N, k)``, ``indices (N, k)``, ``scores (N, E)``."""

    weights: torch.Tensor
    indices: torch.Tensor
    scores: torch.Tensor


class TopKRouter(nn.Module):
    """Scores E experts per token and keeps the k best: softmax (Mixtral, Qwen) or sigmoid (V3).

    ``selection_bias`` is added to the scores only to choose experts, never to the weights.
    With ``n_groups > 1`` the experts form G groups, a group scores the sum of its two best
    (biased) scores, and only the best ``topk_groups`` groups are searched. The chosen weights
    are renormalised to sum to 1 if ``norm_topk``, then multiplied by ``scale``. In fp32.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        norm_topk: bool = True,
        n_groups: int = 1,
        topk_groups: int = 1,
        scale: float = 1.0,
        bias: bool = False,
        selection_bias: bool = False,
    ) -> None:
        super().__init__()
        _check("scoring", scoring, SCORINGS)
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if n_groups < 1 or n_experts % n_groups != 0:
            raise ValueError(f"n_groups must divide n_experts={n_experts}, got {n_groups}")
        if not 1 <= topk_groups <= n_groups:
            raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
        if n_groups > 1 and (
            n_experts // n_groups < 2 or top_k > topk_groups * n_experts // n_groups
        ):
            raise ValueError(
                f"group-limited routing needs >= 2 experts per group and top_k <= "
                f"topk_groups * n_experts / n_groups, got n_experts={n_experts}, "
                f"n_groups={n_groups}, topk_groups={topk_groups}, top_k={top_k}"
            )
        self.n_experts, self.top_k, self.scoring = n_experts, top_k, scoring
        self.norm_topk, self.scale = norm_topk, scale
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.bias = nn.Parameter(torch.zeros(n_experts)) if bias else None
        self.register_buffer("selection_bias", torch.zeros(n_experts) if selection_bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: uniform in ±1/√d; the bias starts at zero."""
        bound = 1 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (N, d)`` -> ``weights (N, k)``, ``indices (N, k)``, ``scores (N, E)``, in fp32."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 if x is
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype), bias)  # (N, E)
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.selection_bias is None else scores + self.selection_bias
        if self.n_groups > 1:
            choice = self._keep_best_groups(choice)
        indices = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, indices)  # (N, k): unbiased scores of the chosen
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices, scores

    def _keep_best_groups(self, choice: Tensor) -> Tensor:
        n = choice.shape[0]
        grouped = choice.view(n, self.n_groups, -1)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        best = group_scores.topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)  # (N, E)


def expert_load(indices: Tensor, n_experts: int) -> Tensor:
    """How many (token, slot) pairs each expert received: ``indices (N, k)`` -> ``(E,)`` int64."""
    flat = indices.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def load_balancing_loss(probs: Tensor, indices: Tensor, n_experts: int) -> Tensor:
    """Switch/GShard auxiliary loss E·Σ_i f_i·P_i, minimal (= k) when routing is uniform.

    f_i is the number of assignments to expert i per token (Σ f_i = k), P_i the mean routing
    probability of expert i. ``probs (N, E)`` rows are renormalised to sum to 1, so sigmoid
    scores work as well as softmax probabilities (for which this equals transformers').
    """
    f = expert_load(indices, n_experts).to(probs.dtype) / probs.shape[0]  # (E,)
    p = (probs / probs.sum(-1, keepdim=True)).mean(0)  # (E,)
    return n_experts * (f * p).sum()


@torch.no_grad()
def update_selection_bias(bias: Tensor, load: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: b_i += rate·sign(mean − load_i).

    Under-loaded experts become easier to choose and over-loaded ones harder; the routing
    weights never see ``bias``. Returns ``bias``.
    """
    load = load.to(bias.dtype)
    return bias.add_(rate * torch.sign(load.mean() - load))


def swiglu(h: Tensor) -> Tensor:
    """``(S, 2F)`` rows ``[gate; up]`` -> ``silu(gate) · up`` ``(S, F)``."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gpt_oss_glu(h: Tensor, limit: float = 7.0, alpha: float = 1.702) -> Tensor:
    """gpt-oss's clamped SwiGLU on interleaved ``(S, 2F)``: (up + 1)·gate·σ(α·gate)."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def experts_reference(
    x: Tensor,
    weights: Tensor,
    indices: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor],
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """Σ_j weights[n, j]·expert_{indices[n, j]}(x[n]): one plain loop over the E experts.

    ``x (N, d)``, ``weights (N, k)``, ``indices (N, k)``, ``gate_up (E, 2F, d)``,
    ``down (E, d, F)``, biases ``(E, 2F)`` and ``(E, d)``; returns ``(N, d)``.
    """
    assert weights.shape == indices.shape and x.shape[0] == indices.shape[0]
    out = torch.zeros_like(x)  # (N, d)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(indices == e)  # (n_e,) each
        if token.numel() == 0:
            continue
        h = F.linear(x[token], gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        y = F.linear(act(h), down[e], None if down_bias is None else down_bias[e])  # (n_e, d)
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm`` needs it)."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad.contiguous()


@functools.cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Try ``torch._grouped_mm`` forward and backward once on this device and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():  # the caller may be under no_grad
            x = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([1, 3], device=device, dtype=torch.int32)
            out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            _ContiguousGrad.apply(out).sum().backward()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_available(x: Tensor, weight: Tensor) -> bool:
    """True if ``torch._grouped_mm`` runs on this device and dtype and the data are aligned."""
    size = x.element_size()
    aligned = (
        x.dtype == weight.dtype
        and x.is_contiguous()
        and all(t.data_ptr() % 16 == 0 for t in (x, weight))
        and all(n * size % 16 == 0 for n in weight.shape[1:])
    )
    return aligned and _grouped_mm_runs(x.device, x.dtype)


def grouped_matmul(x: Tensor, weight: Tensor, counts: Tensor, kernel: str = "auto") -> Tensor:
    """Rows of ``x (S, in)`` sorted by expert, segment e times ``weight[e].T``: ``(S, out)``.

    ``weight (E, out, in)``, ``counts (E,)`` rows per expert, in order. ``kernel``:
    ``"grouped_mm"`` one ``torch._grouped_mm`` call (raises if unavailable), ``"segments"``
    one matmul per non-empty segment, ``"auto"`` the first if available, else the second.
    """
    _check("kernel", kernel, GROUPED_KERNELS)
    available = kernel != "segments" and grouped_mm_available(x, weight)
    if kernel == "grouped_mm" and not available:
        raise ValueError(
            f"kernel='grouped_mm' is not available for {x.dtype} on {x.device.type} "
            f"(torch {torch.__version__}); use kernel='segments' or 'auto'"
        )
    if available:
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) segment ends
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(out)
    pieces, start = [], 0
    for e, n in enumerate(counts.tolist()):  # one host sync, then E matmuls at most
        if n:
            pieces.append(x[start : start + n] @ weight[e].T)
            start += n
    return torch.cat(pieces)


def experts_grouped(
    x: Tensor,
    weights: Tensor,
    indices: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor],
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    kernel: str = "auto",
) -> Tensor:
    """:func:`experts_reference`, fast: sort the S pairs by expert, two grouped matmuls.

    The pairs' outputs are summed back per token with ``index_add`` (atomic, so not bitwise
    reproducible, on GPUs).
    """
    n, k = indices.shape
    flat = indices.reshape(-1)  # (S,)
    order = flat.argsort(stable=True)  # (S,) pair positions, grouped by expert
    expert, token = flat[order], order // k  # (S,) each
    counts = expert_load(flat, gate_up.shape[0])  # (E,)
    h = grouped_matmul(x.index_select(0, token), gate_up, counts, kernel)  # (S, 2F)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, expert)
    y = grouped_matmul(act(h), down, counts, kernel)  # (S, d)
    if down_bias is not None:
        y = y + down_bias.index_select(0, expert)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, token, y)  # (N, d)


_FORMS = {"reference": experts_reference, "grouped": experts_grouped}
EXPERT_IMPLS = tuple(_FORMS)


def _init_stacked(weight: Tensor) -> None:
    bound = 1 / math.sqrt(weight.shape[-1])  # each slice like an nn.Linear (out, in)
    nn.init.uniform_(weight, -bound, bound)


class GLUExperts(nn.Module):
    """E SwiGLU experts, stacked: ``gate_up (E, 2F, d)`` rows [gate; up], ``down (E, d, F)``."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, *, impl: str = "grouped") -> None:
        super().__init__()
        _check("impl", impl, EXPERT_IMPLS)
        self.impl = impl
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * d_ff, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear`` would start them (biases: none)."""
        _init_stacked(self.gate_up)
        _init_stacked(self.down)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """``x (N, d)``, ``weights (N, k)``, ``indices (N, k)`` -> ``(N, d)``."""
        _check("impl", self.impl, EXPERT_IMPLS)
        return _FORMS[self.impl](x, weights, indices, self.gate_up, self.down, swiglu)


class GptOssExperts(nn.Module):
    """gpt-oss's experts: biased, interleaved gate/up rows, clamped SwiGLU :func:`gpt_oss_glu`."""

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        d_ff: int,
        limit: float = 7.0,
        alpha: float = 1.702,
        *,
        impl: str = "grouped",
    ) -> None:
        super().__init__()
        _check("impl", impl, EXPERT_IMPLS)
        self.impl, self.limit, self.alpha = impl, limit, alpha
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * d_ff, d_model))
        self.gate_up_bias = nn.Parameter(torch.zeros(n_experts, 2 * d_ff))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.down_bias = nn.Parameter(torch.zeros(n_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Matrices as ``nn.Linear`` would start them; biases at zero."""
        _init_stacked(self.gate_up)
        _init_stacked(self.down)
        nn.init.zeros_(self.gate_up_bias)
        nn.init.zeros_(self.down_bias)

    def act(self, h: Tensor) -> Tensor:
        """:func:`gpt_oss_glu` with this module's ``limit`` and ``alpha``."""
        return gpt_oss_glu(h, self.limit, self.alpha)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """``x (N, d)``, ``weights (N, k)``, ``indices (N, k)`` -> ``(N, d)``."""
        _check("impl", self.impl, EXPERT_IMPLS)
        biases = (self.gate_up_bias, self.down_bias)
        return _FORMS[self.impl](x, weights, indices, self.gate_up, self.down, self.act, *biases)


class MoEFeedForward(nn.Module):
    """Router + routed experts + an optional always-on shared expert (DeepSeek, Qwen3-Next).

    ``x (..., d)`` -> ``(..., d)``. The last routing is kept in ``last_routing``
    (:class:`Routing`, with its graph) for :func:`load_balancing_loss` and load statistics.
    ``shared_gate`` scales the shared expert by σ(x·w), w of shape (1, d) (Qwen3-Next).
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        d_ff: int,
        *,
        scoring: str = "softmax",
        norm_topk: bool = True,
        n_groups: int = 1,
        topk_groups: int = 1,
        scale: float = 1.0,
        router_bias: bool = False,
        selection_bias: bool = False,
        kind: str = "glu",
        shared_d_ff: int = 0,
        shared_gate: bool = False,
        impl: str = "grouped",
    ) -> None:
        super().__init__()
        _check("kind", kind, EXPERT_KINDS)
        if shared_gate and shared_d_ff <= 0:
            raise ValueError(
                f"shared_gate needs a shared expert (shared_d_ff > 0), got {shared_d_ff}"
            )
        self.router = TopKRouter(
            d_model,
            n_experts,
            top_k,
            scoring=scoring,
            norm_topk=norm_topk,
            n_groups=n_groups,
            topk_groups=topk_groups,
            scale=scale,
            bias=router_bias,
            selection_bias=selection_bias,
        )
        experts = GLUExperts if kind == "glu" else GptOssExperts
        self.experts = experts(n_experts, d_model, d_ff, impl=impl)
        self.shared = GatedFeedForward(d_model, shared_d_ff) if shared_d_ff > 0 else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None
        self.last_routing: Routing | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        self.last_routing = Routing(*self.router(flat))
        y = self.experts(flat, self.last_routing.weights, self.last_routing.indices)  # (N, d)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, d)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            y = y + shared
        return y.view(x.shape)
