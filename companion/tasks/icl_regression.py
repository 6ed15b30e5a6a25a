"""In-context linear regression: prompts of (x, y) examples and a query, one layer of
softmax-free self-attention, and the one step of gradient descent it can compute
(chapter 02).

Shape legend: B prompts, N examples per prompt, d input width. A token is d + 1 wide:
``(x_i, y_i)`` for an example, ``(x_q, 0)`` for the query, which comes last.

Every prompt draws its own task ``w ~ N(0, I_d)``, inputs ``x ~ N(0, I_d)`` and labels
``y = w · x``; from the N examples alone a model must predict ``w · x_q``. One step of
gradient descent on the prompt's least-squares loss ``L(w) = 1/(2N) Σ_i (w · x_i -
y_i)²`` from ``w = 0`` moves to ``w = (η/N) Σ_i y_i x_i`` and so predicts
``(η/N) Σ_i y_i (x_i · x_q)``: a sum over the examples of a value (``y_i``) weighted by a
query-key product (``x_q · x_i``). One layer of self-attention without the softmax
computes sums of that form; :func:`gd_construction` sets its weights so that it computes
this one exactly (von Oswald et al., 2023). Whether *training* finds those weights is an
experiment, not a consequence: :func:`effective_step` reads the step a layer takes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.training import cosine_lr, portable_adam

__all__ = [
    "LinearSelfAttention",
    "best_gd_lr",
    "effective_step",
    "gd_construction",
    "gd_step_prediction",
    "least_squares_prediction",
    "regression_prompts",
    "train_icl_layer",
]


def regression_prompts(
    batch: int, n_examples: int, dim: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """``tokens (B, N + 1, d + 1)`` (the examples, then the query with label 0) and
    the query's true label ``(B,)``, each prompt with its own ``w ~ N(0, I_d)``."""
    if batch < 1 or n_examples < 1 or dim < 1:
        raise ValueError(f"need positive sizes, got {batch=} {n_examples=} {dim=}")
    w = torch.randn(batch, dim, generator=generator)
    x = torch.randn(batch, n_examples + 1, dim, generator=generator)
    y = torch.einsum("bnd,bd->bn", x, w)
    tokens = torch.cat([x, y[..., None]], dim=-1)
    tokens[:, -1, -1] = 0.0  # the query's label is what the model must supply
    return tokens, y[:, -1]


def _split(tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x (B, N, d)``, ``y (B, N)`` of the examples and ``x_q (B, d)``."""
    return tokens[:, :-1, :-1], tokens[:, :-1, -1], tokens[:, -1, :-1]


def gd_step_prediction(tokens: Tensor, lr: float) -> Tensor:
    """``(B,)``: the prediction at ``x_q`` after one gradient step of size ``lr`` on
    the prompt's loss ``1/(2N) Σ_i (w · x_i - y_i)²``, from ``w = 0``."""
    x, y, x_q = _split(tokens)
    grad_at_zero = -(y[..., None] * x).mean(dim=1)  # (B, d): ∇L at w = 0
    w_one_step = -lr * grad_at_zero
    return (w_one_step * x_q).sum(-1)


def best_gd_lr(tokens: Tensor, targets: Tensor) -> float:
    """The step size that minimises the squared error of :func:`gd_step_prediction`
    over these prompts; the prediction is linear in it, so the line search is exact."""
    g = gd_step_prediction(tokens, 1.0)
    return ((g * targets).sum() / g.square().sum()).item()


def least_squares_prediction(tokens: Tensor) -> Tensor:
    """``(B,)``: the prediction of the least-squares solution on the examples (the
    minimum-norm one when they do not determine ``w``)."""
    x, y, x_q = _split(tokens)
    w = (torch.linalg.pinv(x) @ y[..., None])[..., 0]  # (B, d)
    return (w * x_q).sum(-1)


class LinearSelfAttention(nn.Module):
    """One self-attention layer with no softmax, read at the query:
    ``tokens (B, N + 1, d + 1)`` to the prediction ``(B,)``.

    The query scores each example by ``q · k_i`` and adds ``(1/N) Σ_i (q · k_i) v_i``
    to its own token (the residual stream); the prediction is the last coordinate,
    where the query's token held the label 0.
    """

    def __init__(self, dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        width = dim + 1
        self.w_q, self.w_k, self.w_v = (
            nn.Parameter(init_std * torch.randn(width, width)) for _ in range(3)
        )

    def forward(self, tokens: Tensor) -> Tensor:
        examples, query = tokens[:, :-1], tokens[:, -1]
        q = query @ self.w_q  # (B, d + 1)
        k, v = examples @ self.w_k, examples @ self.w_v  # (B, N, d + 1) each
        scores = torch.einsum("bnc,bc->bn", k, q)  # no softmax: used as they are
        update = torch.einsum("bn,bnc->bc", scores, v) / examples.shape[1]
        return (query + update)[:, -1]


@torch.no_grad()
def gd_construction(dim: int, lr: float) -> LinearSelfAttention:
    """The weights under which :class:`LinearSelfAttention` computes
    :func:`gd_step_prediction` exactly: query and key read ``x``, the value reads
    ``lr · y`` into the label's coordinate."""
    layer = LinearSelfAttention(dim)
    reads_x = torch.zeros(dim + 1, dim + 1)
    reads_x[:dim, :dim] = torch.eye(dim)
    layer.w_q.copy_(reads_x)
    layer.w_k.copy_(reads_x)
    layer.w_v.zero_()
    layer.w_v[dim, dim] = lr
    return layer


@torch.no_grad()
def effective_step(layer: LinearSelfAttention) -> Tensor:
    """``(d, d)``: the matrix ``Γ`` of the part of the layer's prediction that has
    gradient descent's form, ``(1/N) Σ_i y_i x_q^T Γ x_i``; one plain step of size
    ``η`` has ``Γ = η I``. It is the value's weight from ``y`` to the label times
    the x-to-x block of ``W_Q W_K^T``."""
    d = layer.w_q.shape[0] - 1
    return layer.w_v[d, d] * (layer.w_q @ layer.w_k.T)[:d, :d]


def train_icl_layer(
    layer: LinearSelfAttention,
    steps: int,
    *,
    batch: int = 256,
    n_examples: int = 16,
    lr: float = 1e-2,
    generator: torch.Generator | None = None,
) -> list[float]:
    """Fit ``layer`` to fresh prompts (a new task every prompt) by the squared error
    at the query, with Adam and a cosine schedule; returns the loss per step."""
    dim = layer.w_q.shape[0] - 1
    opt = torch.optim.Adam(
        layer.parameters(), lr=lr, **portable_adam(layer.parameters())
    )
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(
                step, lr, warmup=max(1, steps // 20), total=steps, min_lr=lr / 100
            )
        tokens, targets = regression_prompts(batch, n_examples, dim, generator)
        loss = (layer(tokens) - targets).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
