"""Counting compute and fitting scaling laws (chapter 04).

Shape legend: N parameters (without embeddings unless said), D training tokens, C FLOPs,
L blocks, T context length, d model width, V vocabulary.

- :func:`count_flops` measures the matmul FLOPs of any call with PyTorch's
  ``FlopCounterMode``; :func:`training_flops_per_token` does it for one forward and
  backward pass of a language model.
- :func:`kaplan_flops_per_token` is the ``6N`` rule and :func:`dense_flops_per_token`
  the count with its two corrections (attention scores, output layer).
- :class:`PowerLaw` / :func:`fit_power_law` fit ``y = a · x^b`` by least squares in log
  space.
- :func:`chinchilla_tokens`, :func:`training_compute`, :func:`compute_optimal` are the
  arithmetic of Hoffmann et al. (2022): ``C ≈ 6ND`` and about 20 tokens per parameter.
- :class:`ChinchillaLoss` is their fitted loss ``L(N, D) = E + A/N^α + B/D^β``
  (``CHINCHILLA_FIT``: their Approach 3 constants) and its compute-optimal split;
  :func:`fit_isoflop` fits one IsoFLOP profile, loss against ``log N`` at fixed C, with
  a parabola and reads off its minimum.
- :func:`span_exact_match` scores whole multi-token spans, the "sharp" metric of the
  emergence debate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from companion.plotting import loglog_fit
from companion.training import lm_loss

__all__ = [
    "CHINCHILLA_FIT",
    "CHINCHILLA_TOKENS_PER_PARAM",
    "ChinchillaLoss",
    "IsoFLOPFit",
    "PowerLaw",
    "chinchilla_tokens",
    "compute_optimal",
    "count_flops",
    "dense_flops_per_token",
    "fit_isoflop",
    "fit_power_law",
    "kaplan_flops_per_token",
    "span_exact_match",
    "training_compute",
    "training_flops_per_token",
]

CHINCHILLA_TOKENS_PER_PARAM = 20.0


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the matmul-like ops run by ``fn()`` (one multiply-add counts 2).

    ``FlopCounterMode`` counts ``mm``, ``addmm``, ``bmm``, convolutions and the CUDA
    fused attention kernels; elementwise ops, softmax and norms are not counted, and
    neither is CPU ``scaled_dot_product_attention`` — measure models built with
    ``attn_impl="reference"``.
    """
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def training_flops_per_token(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = lm_loss,
) -> float:
    """Measured FLOPs of one forward and backward pass on ``x (B, T)``, per token."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()

    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return flops / x.numel()


def kaplan_flops_per_token(n_params: float) -> float:
    """The ``6N`` rule: 2N FLOPs forward, 4N backward, per training token."""
    return 6.0 * n_params


def dense_flops_per_token(
    n_params: float, *, n_layers: int, seq_len: int, d_model: int, vocab_size: int
) -> float:
    """6N plus attention scores and the output layer, per training token.

    Per layer the forward pass computes ``q kᵀ`` and ``weights · v``: ``2·T·d`` FLOPs
    each per token over the full T × T square (a causal kernel could skip half). The
    output layer is a ``(d, V)`` matmul. Training is three times the forward pass.
    """
    forward_attention = 4.0 * n_layers * seq_len * d_model
    forward_head = 2.0 * d_model * vocab_size
    return 6.0 * n_params + 3.0 * (forward_attention + forward_head)


@dataclass(frozen=True)
class PowerLaw:
    """``y = coef · x^exponent``."""

    coef: float
    exponent: float

    def __call__(self, x: float | Sequence[float] | Tensor) -> Tensor:
        return self.coef * torch.as_tensor(x, dtype=torch.float64) ** self.exponent


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> PowerLaw:
    """Least-squares fit of ``log y = log a + b · log x``; needs 2+ positive points."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(
            f"x and y must hold the same number (>= 2) of points, got {len(x)}, {len(y)}"
        )
    if min(x) <= 0 or min(y) <= 0:
        raise ValueError("a power law is fitted in log space: x and y must be positive")
    slope, intercept = loglog_fit(x, y)
    return PowerLaw(coef=math.exp(intercept), exponent=slope)


def chinchilla_tokens(
    n_params: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM
) -> float:
    """Compute-optimal training tokens for ``n_params`` parameters (about 20 per
    parameter)."""
    return tokens_per_param * n_params


def training_compute(n_params: float, n_tokens: float) -> float:
    """Training FLOPs by the 6N rule: ``C = 6 · N · D``."""
    return 6.0 * n_params * n_tokens


def compute_optimal(
    compute: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM
) -> tuple[float, float]:
    """``(N, D)`` that spend ``compute`` FLOPs with D = r·N: N = √(C / 6r)."""
    if compute <= 0 or tokens_per_param <= 0:
        raise ValueError(
            f"compute and tokens_per_param must be positive, got {compute}, {tokens_per_param}"
        )
    n = math.sqrt(compute / (6.0 * tokens_per_param))
    return n, tokens_per_param * n


@dataclass(frozen=True)
class ChinchillaLoss:
    """``L(N, D) = E + A / N^alpha + B / D^beta``: loss of N parameters trained on D
    tokens.

    ``E`` is the irreducible loss (the text's own entropy, which no model removes); the
    two other terms are what a finite model and a finite dataset add to it.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def __call__(self, n_params: float, n_tokens: float) -> float:
        return self.E + self.A / n_params**self.alpha + self.B / n_tokens**self.beta

    @property
    def n_exponent(self) -> float:
        """``a`` in ``N_opt ∝ C^a``: ``beta / (alpha + beta)``."""
        return self.beta / (self.alpha + self.beta)

    def optimal(self, compute: float) -> tuple[float, float]:
        """``(N, D)`` of least loss with ``6ND = compute`` (Hoffmann et al., eq. 4).

        Setting the derivative along ``D = C / 6N`` to zero gives ``N = G (C/6)^a`` and
        ``D = (C/6)^(1-a) / G`` with ``G = (alpha A / (beta B))^(1 / (alpha + beta))``.
        """
        if compute <= 0:
            raise ValueError(f"compute must be positive, got {compute}")
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        n = g * (compute / 6.0) ** self.n_exponent
        return n, compute / (6.0 * n)


# Hoffmann et al. (2022), Approach 3: one fit to all their runs (loss in nats)
CHINCHILLA_FIT = ChinchillaLoss(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


@dataclass(frozen=True)
class IsoFLOPFit:
    """A parabola ``loss = a·x² + b·x + c`` in ``x = ln N`` at one compute budget."""

    a: float
    b: float
    c: float

    @property
    def n_opt(self) -> float:
        """The N at the parabola's minimum, ``exp(−b / 2a)``."""
        return math.exp(-self.b / (2.0 * self.a))

    @property
    def min_loss(self) -> float:
        return self.c - self.b**2 / (4.0 * self.a)

    def __call__(self, n_params: float | Sequence[float]) -> Tensor:
        x = torch.as_tensor(n_params, dtype=torch.float64).log()
        return self.a * x**2 + self.b * x + self.c


def fit_isoflop(n_params: Sequence[float], losses: Sequence[float]) -> IsoFLOPFit:
    """Least-squares parabola of loss against ``ln N`` over one budget's runs
    (Hoffmann et al.'s Approach 2); needs 3+ sizes and a curve that opens upward."""
    if len(n_params) != len(losses) or len(n_params) < 3:
        raise ValueError(
            f"need the same number (>= 3) of sizes and losses, got {len(n_params)}, "
            f"{len(losses)}"
        )
    x = torch.as_tensor(n_params, dtype=torch.float64).log()
    design = torch.stack([x**2, x, torch.ones_like(x)], dim=1)  # (n, 3)
    y = torch.as_tensor(losses, dtype=torch.float64)[:, None]
    a, b, c = torch.linalg.lstsq(design, y).solution[:, 0].tolist()
    if a <= 0:
        raise ValueError("the losses do not curve upward: this profile has no minimum")
    return IsoFLOPFit(a, b, c)


def span_exact_match(
    correct: Tensor, span: int, start: int = 0, stride: int | None = None
) -> Tensor:
    """Whether each whole span of ``span`` tokens is right: ``(B, T) bool -> (B,
    n_spans)``.

    ``correct[b, t]`` says whether the greedy prediction of token t (given the true
    prefix) is right. Spans begin at ``start`` and every ``stride`` tokens after it
    (default ``span``: back to back; 1: every position). All teacher-forced predictions
    of a span being right is the same as greedy decoding reproducing the span exactly.
    """
    if correct.ndim != 2:
        raise ValueError(f"correct must have shape (B, T), got {tuple(correct.shape)}")
    stride = span if stride is None else stride
    if span < 1 or stride < 1 or start < 0 or start + span > correct.shape[1]:
        raise ValueError(
            f"need span >= 1, stride >= 1, start >= 0 and at least one span in "
            f"T={correct.shape[1]}; got span={span}, stride={stride}, start={start}"
        )
    windows = correct[:, start:].unfold(1, span, stride)  # (B, n_spans, span)
    return windows.all(dim=-1)  # (B, n_spans)
