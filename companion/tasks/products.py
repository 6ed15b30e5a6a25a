"""Products of inputs: a task a gated FFN represents exactly and an MLP only
approximates (chapter 07).

Shape legend: B batch, d width (the task's inputs and outputs have the same width, as an
FFN's do), G points per side of a plotting grid.

The task: ``x ~ N(0, I_d)`` and ``y_k = x_k · x_{k - shift}`` (indices mod d), so every
output is the product of two inputs. A GLU ``down(act(gate(x)) * up(x))`` has a product
built in. For ReLU, GELU and SiLU, ``act(z) = z · F(z)`` with ``F(z) + F(-z) = 1``, so
``act(z) - act(-z) = z`` and two hidden units give one product exactly: ``act(x_k) x_j -
act(-x_k) x_j = x_k x_j``. :func:`exact_product_glu` builds those weights. A two-matrix
MLP ``down(act(up(x)))`` adds up ridge functions ``act(w · x)``; it can only approximate
a product (a ReLU MLP is piecewise linear).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.layers.ffn import GatedFeedForward
from companion.training import cosine_lr, portable_adam

__all__ = [
    "RegressionHistory",
    "exact_product_glu",
    "mse",
    "product_surface",
    "product_task",
    "train_regression",
]


def product_task(
    batch_size: int, d: int, shift: int = 1, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Gaussian inputs ``x (B, d)`` and targets ``y (B, d)`` with ``y_k = x_k ·
    x_{k-shift}``.

    Each target has mean 0 and variance 1, so predicting zero scores a mean squared
    error of 1.
    """
    if d < 2 or batch_size < 1:
        raise ValueError(
            f"need d >= 2 and batch_size >= 1, got d={d}, batch_size={batch_size}"
        )
    if shift % d == 0:
        raise ValueError(
            f"shift must not be a multiple of d={d} (that gives squares), got {shift}"
        )
    x = torch.randn(batch_size, d, generator=generator)  # (B, d)
    return x, x * torch.roll(x, shift, dims=-1)  # roll: column k holds x_{k - shift}


def exact_product_glu(
    d: int, shift: int = 1, activation: str = "silu"
) -> GatedFeedForward:
    """A GLU with ``2d`` hidden units whose weights compute :func:`product_task`
    exactly.

    Unit ``2k`` computes ``act(x_k) · x_{k-shift}``, unit ``2k+1`` ``act(-x_k) ·
    x_{k-shift}``, and output ``k`` is their difference. Parameters: ``3 · d · 2d =
    6d²``, fewer than the ``8d²`` of an MLP with ``4d`` hidden units.
    """
    glu = GatedFeedForward(d, 2 * d, activation, bias=False)
    k = torch.arange(d)
    gate, up, down = (torch.zeros_like(m.weight) for m in (glu.gate, glu.up, glu.down))
    gate[2 * k, k], gate[2 * k + 1, k] = 1.0, -1.0  # (2d, d)
    up[2 * k, (k - shift) % d] = up[2 * k + 1, (k - shift) % d] = 1.0  # (2d, d)
    down[k, 2 * k], down[k, 2 * k + 1] = 1.0, -1.0  # (d, 2d)
    with torch.no_grad():
        glu.gate.weight.copy_(gate)
        glu.up.weight.copy_(up)
        glu.down.weight.copy_(down)
    return glu


@torch.no_grad()
def mse(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Mean squared error of ``model(x)`` against ``y``."""
    return F.mse_loss(model(x), y).item()


@dataclass
class RegressionHistory:
    """Training loss (mean squared error) at every step of :func:`train_regression`."""

    loss: list[float] = field(default_factory=list)


def train_regression(
    model: nn.Module,
    d: int,
    steps: int,
    *,
    batch_size: int = 256,
    lr: float = 3e-2,
    shift: int = 1,
    generator: torch.Generator | None = None,
    on_step: Callable[[int, nn.Module], None] | None = None,
) -> RegressionHistory:
    """Fit ``model`` to fresh :func:`product_task` batches with Adam and a cosine
    schedule.

    The learning rate warms up over the first 5% of the steps, then decays to ``lr /
    100``. ``on_step(step, model)`` runs before each update (step 0 sees the initial
    model) and once more after the last with ``step == steps``: use it to take
    snapshots.
    """
    opt = torch.optim.Adam(
        model.parameters(), lr=lr, **portable_adam(model.parameters())
    )
    hist = RegressionHistory()
    warmup = max(1, steps // 20)
    model.train()
    for step in range(steps):
        if on_step is not None:
            on_step(step, model)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(
                step, lr, warmup=warmup, total=steps, min_lr=lr / 100
            )
        x, y = product_task(batch_size, d, shift, generator)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hist.loss.append(loss.item())
    if on_step is not None:
        on_step(steps, model)
    model.eval()
    return hist


@torch.no_grad()
def product_surface(
    model: nn.Module, d: int, grid: Tensor, k: int = 1, shift: int = 1
) -> Tensor:
    """Output ``k`` of ``model`` over a grid of ``(x_k, x_{k-shift})``, other inputs
    zero.

    ``grid (G,)`` gives the values on both axes; returns ``(G, G)`` with rows indexed by
    ``x_{k-shift}`` and columns by ``x_k`` (the target is the product of the two).
    """
    j = (k - shift) % d
    xk, xj = torch.meshgrid(grid, grid, indexing="xy")  # (G, G): columns vary x_k
    x = torch.zeros(*xk.shape, d)  # (G, G, d)
    x[..., k], x[..., j] = xk, xj
    return model(x)[..., k]  # (G, G)
