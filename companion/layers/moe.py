"""Mixture of experts: a router sends each token to k of E expert FFNs (chapter 10).

Shape legend: N tokens (B·T flattened), d model width, E routed experts, k experts per
token, F hidden width of one expert, S = N·k (token, expert) pairs, G router groups.

Parameters, by name (what a parameter count sees; buffers are not parameters):

- :class:`companion.layers.router.TopKRouter`: ``weight (E, d)``, plus ``bias (E,)``
  when ``bias=True`` (gpt-oss). ``selection_bias (E,)`` (DeepSeek-V3's balancing bias)
  is a buffer. :class:`companion.layers.router.HashRouter` (``routing="hash"``,
  DeepSeek-V4): ``weight (E, d)`` and the buffer ``table (V, k)``.
- :class:`GLUExperts`: ``gate_up (E, 2F, d)``, rows ``[gate; up]``, and ``down (E, d,
  F)``: E·3·F·d. Each slice is an ``nn.Linear`` weight, (out, in). With ``limit``
  (DeepSeek-V4) gate and up are clamped before the SwiGLU.
- :class:`GptOssExperts`: ``gate_up (E, 2F, d)`` with interleaved rows (gate = even
  rows, up = odd rows, as gpt-oss stores them), ``gate_up_bias (E, 2F)``, ``down (E, d,
  F)``, ``down_bias (E, d)``: E·(3·F·d + 2F + d).
- :class:`MoEFeedForward`: ``router.*``, ``experts.*``, the shared expert
  ``shared.{gate,up,down}.weight`` (3·d·shared_d_ff) and ``shared_gate.weight (1, d)``.

The router is :mod:`companion.layers.router`; the experts' two forms (a loop over
experts and the grouped matmul) are :mod:`companion.ops.experts`; ``impl`` names the
form the experts run: ``"reference"`` (the loop), ``"grouped"`` (one matmul per expert's
segment) or ``"grouped_mm"`` (one ``torch._grouped_mm`` call; an error where it cannot
run).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from companion.checks import check_choice, check_positive
from companion.layers.ffn import GatedFeedForward
from companion.layers.router import HashRouter, Routing, TopKRouter
from companion.ops.experts import (
    EXPERT_FORMS,
    EXPERT_IMPLS,
    gpt_oss_glu,
    swiglu,
    swiglu_clamped,
)

__all__ = [
    "ClampedGatedFeedForward",
    "EXPERT_KINDS",
    "GLUExperts",
    "GptOssExperts",
    "MoEFeedForward",
    "ROUTINGS",
]

EXPERT_KINDS = ("glu", "gpt_oss")
ROUTINGS = ("topk", "hash")  # TopKRouter, HashRouter


def _init_stacked(weight: Tensor) -> None:
    bound = 1 / math.sqrt(weight.shape[-1])  # each slice like an nn.Linear (out, in)
    nn.init.uniform_(weight, -bound, bound)


class GLUExperts(nn.Module):
    """E SwiGLU experts, stacked: ``gate_up (E, 2F, d)`` rows [gate; up], ``down (E, d,
    F)``; ``limit`` clamps gate and up first (DeepSeek-V4,
    :func:`companion.ops.experts.swiglu_clamped`)."""

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        d_ff: int,
        *,
        limit: float | None = None,
        impl: str = "grouped",
    ) -> None:
        super().__init__()
        check_choice("impl", impl, EXPERT_IMPLS)
        if limit is not None:
            check_positive("limit", limit)
        self.impl, self.limit = impl, limit
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * d_ff, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear`` would start them (biases: none)."""
        _init_stacked(self.gate_up)
        _init_stacked(self.down)

    def act(self, h: Tensor) -> Tensor:
        """SwiGLU on ``(S, 2F)``, clamped at this module's ``limit`` if it has one."""
        return swiglu(h) if self.limit is None else swiglu_clamped(h, self.limit)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """``x (N, d)``, ``weights (N, k)``, ``indices (N, k)`` -> ``(N, d)``."""
        check_choice("impl", self.impl, EXPERT_IMPLS)
        return EXPERT_FORMS[self.impl](
            x, weights, indices, self.gate_up, self.down, self.act
        )


class GptOssExperts(nn.Module):
    """gpt-oss's experts: biased, interleaved gate/up rows, clamped SwiGLU
    (:func:`companion.ops.experts.gpt_oss_glu`)."""

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
        check_choice("impl", impl, EXPERT_IMPLS)
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
        """:func:`companion.ops.experts.gpt_oss_glu` with this module's ``limit`` and
        ``alpha``."""
        return gpt_oss_glu(h, self.limit, self.alpha)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """``x (N, d)``, ``weights (N, k)``, ``indices (N, k)`` -> ``(N, d)``."""
        check_choice("impl", self.impl, EXPERT_IMPLS)
        biases = (self.gate_up_bias, self.down_bias)
        form = EXPERT_FORMS[self.impl]
        return form(x, weights, indices, self.gate_up, self.down, self.act, *biases)


class ClampedGatedFeedForward(GatedFeedForward):
    """DeepSeek-V4's shared expert: a SwiGLU whose gate is clamped above at ``limit``
    and whose up projection to ±``limit``, with
    :class:`~companion.layers.ffn.GatedFeedForward`'s parameters."""

    def __init__(self, d: int, d_ff: int, limit: float) -> None:
        super().__init__(d, d_ff)
        check_positive("limit", limit)
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x).clamp(max=self.limit)  # (..., d_ff)
        up = self.up(x).clamp(-self.limit, self.limit)  # (..., d_ff)
        return self.down(self.dropout(self.act(gate) * up))  # (..., d)


class MoEFeedForward(nn.Module):
    """Router + routed experts + an optional always-on shared expert (DeepSeek,
    Qwen3-Next).

    ``x (..., d)`` -> ``(..., d)``. The last routing is kept in ``last_routing``
    (:class:`companion.layers.router.Routing`, with its graph) for
    :func:`companion.layers.router.load_balancing_loss` and load statistics.
    ``shared_gate`` scales the shared expert by σ(x·w), w of shape (1, d) (Qwen3-Next).
    ``routing="hash"`` chooses each token's experts from its id
    (:class:`companion.layers.router.HashRouter` over ``vocab_size`` ids, DeepSeek-V4):
    ``forward`` then needs ``token_ids``. ``swiglu_limit`` clamps the routed and the
    shared experts' gate and up (DeepSeek-V4; for ``kind="gpt_oss"`` it is the experts'
    ``limit``, 7 if None).
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
        routing: str = "topk",
        vocab_size: int = 0,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        check_choice("kind", kind, EXPERT_KINDS)
        check_choice("routing", routing, ROUTINGS)
        if shared_gate and shared_d_ff <= 0:
            raise ValueError(
                f"shared_gate needs a shared expert (shared_d_ff > 0), got {shared_d_ff}"
            )
        if routing == "hash":
            _check_hash_routing(n_groups, router_bias, selection_bias)
            self.router = HashRouter(
                d_model,
                n_experts,
                top_k,
                vocab_size,
                scoring=scoring,
                norm_topk=norm_topk,
                scale=scale,
            )
        else:
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
        self.routing = routing
        limit = {} if swiglu_limit is None else {"limit": swiglu_limit}
        experts = GLUExperts if kind == "glu" else GptOssExperts
        self.experts = experts(n_experts, d_model, d_ff, impl=impl, **limit)
        self.shared = None
        if shared_d_ff > 0 and swiglu_limit is None:
            self.shared = GatedFeedForward(d_model, shared_d_ff)
        elif shared_d_ff > 0:
            self.shared = ClampedGatedFeedForward(d_model, shared_d_ff, swiglu_limit)
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None
        self.last_routing: Routing | None = None

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """``x (..., d)`` -> ``(..., d)``; ``token_ids (...)``: the tokens' ids, for
        hash routing only."""
        _check_token_ids(x, token_ids, self.routing)
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        self.last_routing = self.route(flat, token_ids)
        y = self.experts(
            flat, self.last_routing.weights, self.last_routing.indices
        )  # (N, d)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, d)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            y = y + shared
        return y.view(x.shape)

    def route(self, flat: Tensor, token_ids: Tensor | None = None) -> Routing:
        """The routing of the tokens ``flat (N, d)``: by score (top-k), or by id (hash
        routing, ``token_ids`` given)."""
        if token_ids is None:
            return Routing(*self.router(flat))
        return Routing(*self.router(flat, token_ids.reshape(-1)))


def _check_token_ids(x: Tensor, token_ids: Tensor | None, routing: str) -> None:
    """Raise unless ``token_ids`` come with hash routing only, shaped like the tokens of
    ``x (..., d)``."""
    if (token_ids is None) != (routing == "topk"):
        raise ValueError(
            f"token_ids must be given with routing='hash' and only then; this MoE "
            f"has routing={routing!r}"
        )
    if token_ids is not None and token_ids.shape != x.shape[:-1]:
        raise ValueError(
            f"token_ids must have the tokens' shape {tuple(x.shape[:-1])}, got "
            f"{tuple(token_ids.shape)}"
        )


def _check_hash_routing(n_groups: int, router_bias: bool, selection_bias: bool) -> None:
    """Hash routing fixes the experts by token id: nothing may bias or group the
    choice."""
    if n_groups != 1 or router_bias or selection_bias:
        raise ValueError(
            "routing='hash' takes its experts from a table: it needs n_groups=1, "
            f"router_bias=False, selection_bias=False; got n_groups={n_groups}, "
            f"router_bias={router_bias}, selection_bias={selection_bias}"
        )
