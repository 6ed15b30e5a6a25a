"""The MoE router: top-k expert choice per token, and the balancing signals (chapter
10).

Shape legend: N tokens (B·T flattened), d model width, E routed experts, k experts per
token, G router groups, V vocabulary. :class:`TopKRouter` has ``weight (E, d)``, plus
``bias (E,)`` when ``bias=True`` (gpt-oss); ``selection_bias (E,)`` (DeepSeek-V3's
balancing bias) is a buffer. :class:`HashRouter` (DeepSeek-V4's first MoE layers) has
``weight (E, d)`` and the buffer ``table (V, k)``: the experts of a token are looked up
from its id, only their weights come from the scores.

Scorings: ``softmax`` (Mixtral, Qwen), ``sigmoid`` (DeepSeek-V3), ``sqrtsoftplus``
√softplus(logit) (DeepSeek-V4).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_choice, check_int
from companion.ops.experts import expert_load

__all__ = [
    "HashRouter",
    "check_routing",
    "SCORINGS",
    "Routing",
    "TopKRouter",
    "load_balancing_loss",
    "update_selection_bias",
]


def _sqrt_softplus(logits: Tensor) -> Tensor:
    return F.softplus(logits).sqrt()


# a router's scores from its logits (N, E), by the name ``scoring`` gives
SCORE_FUNCTIONS = {
    "softmax": lambda logits: logits.softmax(-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": _sqrt_softplus,
}
SCORINGS = tuple(SCORE_FUNCTIONS)


class Routing(NamedTuple):
    """One routing decision: ``weights (N, k)``, ``indices (N, k)``, ``scores (N,
    E)``."""

    weights: torch.Tensor
    indices: torch.Tensor
    scores: torch.Tensor


def check_routing(
    n_experts: int,
    top_k: int,
    n_groups: int = 1,
    topk_groups: int = 1,
    *,
    names: dict[str, str] | None = None,
    error: type[ValueError] = ValueError,
) -> None:
    """Raise ``error`` unless top-``top_k`` routing over ``n_experts`` experts in
    ``n_groups`` groups, of which ``topk_groups`` are searched, can choose its experts.
    ``names`` renames the arguments in the message (a config calls ``top_k``
    ``experts_per_token``)."""
    name = {"top_k": "top_k", "n_groups": "n_groups", "topk_groups": "topk_groups"}
    name |= names or {}
    k, g, tg = name["top_k"], name["n_groups"], name["topk_groups"]
    if not 1 <= top_k <= n_experts:
        raise error(f"{k} must be in [1, n_experts={n_experts}], got {top_k}")
    if n_groups < 1 or n_experts % n_groups != 0:
        raise error(f"{g} must divide n_experts={n_experts}, got {n_groups}")
    if not 1 <= topk_groups <= n_groups:
        raise error(f"{tg} must be in [1, {g}={n_groups}], got {topk_groups}")
    if n_groups > 1 and (
        n_experts // n_groups < 2 or top_k > topk_groups * n_experts // n_groups
    ):
        raise error(
            f"group-limited routing needs >= 2 experts per group and {k} <= "
            f"{tg} * n_experts / {g}, got n_experts={n_experts}, "
            f"{g}={n_groups}, {tg}={topk_groups}, {k}={top_k}"
        )


class TopKRouter(nn.Module):
    """Scores E experts per token and keeps the k best: softmax (Mixtral, Qwen), sigmoid
    (V3) or √softplus (V4).

    ``selection_bias`` is added to the scores only to choose experts, never to the
    weights. With ``n_groups > 1`` the experts form G groups, a group scores the sum of
    its two best (biased) scores, and only the best ``topk_groups`` groups are searched.
    The chosen weights are renormalised to sum to 1 if ``norm_topk``, then multiplied by
    ``scale``. In fp32.
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
        check_choice("scoring", scoring, SCORINGS)
        check_routing(n_experts, top_k, n_groups, topk_groups)
        self.n_experts, self.top_k, self.scoring = n_experts, top_k, scoring
        self.norm_topk, self.scale = norm_topk, scale
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.bias = nn.Parameter(torch.zeros(n_experts)) if bias else None
        self.register_buffer(
            "selection_bias", torch.zeros(n_experts) if selection_bias else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: uniform in ±1/√d; the bias starts at zero."""
        bound = 1 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (N, d)`` -> ``weights (N, k)``, ``indices (N, k)``, ``scores (N, E)``, in
        fp32."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 if x is
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype), bias)  # (N, E)
        scores = SCORE_FUNCTIONS[self.scoring](logits)  # (N, E)
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
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(
            n, -1
        )  # (N, E)


class HashRouter(nn.Module):
    """DeepSeek-V4's hash routing: a token's k experts come from its id through a fixed
    table; the learned ``weight`` only weighs them.

    ``table (V, k)`` (transformers: ``tid2eid``) is a buffer, never trained: a
    checkpoint brings its own; a fresh one holds k distinct experts per id drawn with
    ``seed``. The weights are the chosen experts' scores, renormalised to sum to 1 if
    ``norm_topk``, times ``scale``. In fp32.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        vocab_size: int,
        *,
        scoring: str = "sqrtsoftplus",
        norm_topk: bool = True,
        scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_choice("scoring", scoring, SCORINGS)
        check_routing(n_experts, top_k)
        check_int("vocab_size", vocab_size, 1)
        self.n_experts, self.top_k, self.scoring = n_experts, top_k, scoring
        self.norm_topk, self.scale, self.seed = norm_topk, scale, seed
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.register_buffer("table", torch.zeros(vocab_size, top_k, dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` as :class:`TopKRouter`'s; ``table``: k distinct experts per id,
        drawn from ``seed``."""
        bound = 1 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        gen = torch.Generator().manual_seed(self.seed)
        draw = torch.rand(self.table.shape[0], self.n_experts, generator=gen)  # (V, E)
        self.table.copy_(draw.topk(self.top_k, dim=-1).indices)

    def forward(self, x: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (N, d)``, ``token_ids (N,)`` -> ``weights (N, k)``, ``indices (N, k)``,
        ``scores (N, E)``, in fp32."""
        ids = token_ids.reshape(-1)  # (N,)
        if ids.shape[0] != x.shape[0] or ids.dtype.is_floating_point:
            raise ValueError(
                f"token_ids must hold one integer id per token, {x.shape[0]} in all; "
                f"got shape {tuple(token_ids.shape)} and dtype {token_ids.dtype}"
            )
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))  # (N, E)
        scores = SCORE_FUNCTIONS[self.scoring](logits)  # (N, E)
        indices = self.table[ids]  # (N, k): fixed by the ids, not by the scores
        weights = scores.gather(-1, indices)  # (N, k)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices, scores


def load_balancing_loss(probs: Tensor, indices: Tensor, n_experts: int) -> Tensor:
    """Switch/GShard auxiliary loss E·Σ_i f_i·P_i, minimal (= k) when routing is
    uniform.

    f_i is the number of assignments to expert i per token (Σ f_i = k), P_i the mean
    routing probability of expert i. ``probs (N, E)`` rows are renormalised to sum to 1,
    so sigmoid scores work as well as softmax probabilities (for which this equals
    transformers').
    """
    f = expert_load(indices, n_experts).to(probs.dtype) / probs.shape[0]  # (E,)
    p = (probs / probs.sum(-1, keepdim=True)).mean(0)  # (E,)
    return n_experts * (f * p).sum()


@torch.no_grad()
def update_selection_bias(bias: Tensor, load: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: b_i += rate·sign(mean −
    load_i).

    Under-loaded experts become easier to choose and over-loaded ones harder; the
    routing weights never see ``bias``. Returns ``bias``.
    """
    load = load.to(bias.dtype)
    return bias.add_(rate * torch.sign(load.mean() - load))
