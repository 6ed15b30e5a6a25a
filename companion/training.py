"""Training utilities shared by every chapter that trains a model (chapters 02-07).

The pieces are small on purpose: an AdamW builder, two learning-rate schedules as plain
functions of the step (so a chapter can plot them), label smoothing, a training loop
with gradient clipping, an evaluation loop, seeding, and a progress bar that tests
silence.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from companion.checks import (
    check_finite_lr,
    check_int,
    check_number,
    check_positive,
    check_targets,
)

__all__ = [
    "History",
    "cosine_lr",
    "evaluate",
    "inverse_sqrt_lr",
    "label_smoothed_cross_entropy",
    "lm_loss",
    "make_adamw",
    "progress",
    "portable_adam",
    "seed_everything",
    "train",
]

T = TypeVar("T")
Batch = tuple[Tensor, Tensor]


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a torch Generator seeded the same way.

    The seed is checked before anything is seeded: an integer in [0, 2**32), NumPy's
    range."""
    check_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"seed must be < 2**32 (NumPy's range), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def progress(iterable: Iterable[T], **kwargs: object) -> Iterator[T]:
    """A ``tqdm.auto`` bar, silenced when ``COMPANION_PROGRESS=0`` (tests, stored
    outputs)."""
    disable = os.environ.get("COMPANION_PROGRESS", "1") == "0"
    return iter(tqdm(iterable, disable=disable, **kwargs))  # type: ignore[call-overload]


def make_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW that decays matrices and embeddings but not biases or norm gains."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=lr, betas=betas, eps=eps, **portable_adam(decay + no_decay)
    )


def portable_adam(params: Iterable[Tensor]) -> dict[str, bool]:
    """Keyword arguments for ``torch.optim.Adam``/``AdamW`` that make one step give the
    same bits on every x86-64 CPU: ``fused=True`` where every parameter is on a CPU or a
    CUDA device, else nothing.

    Why: the per-tensor update takes ``exp_avg_sq.sqrt()``, which on a CPU torch hands
    to MKL's vector library; its square roots are not correctly rounded, and their last
    bits depend on the CPU kind whatever ``MKL_CBWR`` says (measured: 1,650 of 12,288
    differ between an AVX-512 Xeon and the same binary under an emulated EPYC). The
    fused kernel is ATen's own, pinned by ``ATEN_CPU_CAPABILITY``, with the hardware's
    exact square root (see :mod:`companion.numerics`).
    """
    devices = {p.device.type for p in params}
    return {"fused": True} if devices and devices <= {"cpu", "cuda"} else {}


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The 2017 schedule: factor · d^-½ · min(s^-½, s · warmup^-1.5), with s = step +
    1."""
    check_int("warmup", warmup, 1)  # the schedule divides by it
    check_int("step", step, 0)
    check_int("d_model", d_model, 1)
    s = step + 1
    lr = factor * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)
    return check_finite_lr("inverse_sqrt_lr", step, lr)


def cosine_lr(
    step: int, max_lr: float, warmup: int, total: int, min_lr: float = 0.0
) -> float:
    """Linear warmup to ``max_lr``, then a half cosine down to ``min_lr`` at
    ``total``."""
    for name, value in (("step", step), ("warmup", warmup), ("total", total)):
        check_int(name, value, 0)
    check_number("max_lr", max_lr)
    check_number("min_lr", min_lr)
    if step < warmup:
        return check_finite_lr("cosine_lr", step, max_lr * (step + 1) / warmup)
    progress_frac = min(1.0, (step - warmup) / max(1, total - warmup))
    lr = min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress_frac))
    return check_finite_lr("cosine_lr", step, lr)


def label_smoothed_cross_entropy(
    logits: Tensor, targets: Tensor, smoothing: float = 0.1, ignore_index: int = -100
) -> Tensor:
    """Cross-entropy against (1 − ε) on the target and ε / (V − 1) on every other class.

    ``logits (N, V)``, ``targets (N,)``; rows whose target is ``ignore_index`` are
    skipped.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    v = logits.shape[-1]
    check_targets(targets, v, ignore_index)
    keep = targets != ignore_index
    logp = F.log_softmax(logits[keep].float(), dim=-1)  # (N', V)
    tgt = targets[keep]
    nll = -logp.gather(-1, tgt[:, None]).squeeze(-1)
    others = -logp.sum(-1) - nll  # Σ_{j≠y} −log p_j
    return ((1.0 - smoothing) * nll + smoothing / max(1, v - 1) * others).mean()


def lm_loss(model: nn.Module, x: Tensor, y: Tensor, smoothing: float = 0.0) -> Tensor:
    """Next-token loss of a model mapping ``x (B, T)`` to logits ``(B, T, V)``; ``y (B,
    T)`` holds the targets (``-100``: ignored; not all of them)."""
    logits = model(x)
    if not isinstance(y, Tensor):
        raise TypeError(f"targets y must be a torch.Tensor, got {type(y).__name__}")
    if y.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets y must have the shape of the logits without V, "
            f"{tuple(logits.shape[:-1])}, got {tuple(y.shape)}"
        )
    flat, tgt = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    if smoothing:
        return label_smoothed_cross_entropy(flat, tgt, smoothing)
    check_targets(tgt, flat.shape[-1])
    return F.cross_entropy(flat.float(), tgt)


@dataclass
class History:
    """What :func:`train` records: training loss and lr per step, eval loss at eval
    steps."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)


def train(
    model: nn.Module,
    get_batch: Callable[[int], Batch],
    steps: int,
    optimizer: torch.optim.Optimizer,
    lr_at: Callable[[int], float] | None = None,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = lm_loss,
    clip: float | None = 1.0,
    eval_fn: Callable[[], float] | None = None,
    eval_every: int = 0,
    desc: str = "train",
) -> History:
    """Run ``steps`` optimizer steps on ``get_batch(step)``; returns the
    :class:`History`.

    ``lr_at(step)`` sets the learning rate before each step; ``clip`` bounds the global
    gradient norm; ``eval_fn`` runs every ``eval_every`` steps and after the last. The
    model is left in eval mode; if a step raises, in the mode it came in.
    """
    check_int("steps", steps, 0)
    check_int("eval_every", eval_every, 0)
    if clip is not None:  # None: no clipping
        check_positive("clip", clip)
    was_training = model.training
    hist = History()
    try:
        model.train()
        for step in progress(range(steps), desc=desc):
            if lr_at is not None:
                name = getattr(lr_at, "__name__", type(lr_at).__name__)
                lr = check_finite_lr(name, step, lr_at(step))
                for group in optimizer.param_groups:
                    group["lr"] = lr
            x, y = get_batch(step)
            loss = loss_fn(model, x, y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss became {loss.item()} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            hist.step.append(step)
            hist.loss.append(loss.item())
            hist.lr.append(optimizer.param_groups[0]["lr"])
            last = step == steps - 1
            if eval_fn is not None and (
                last or (eval_every and (step + 1) % eval_every == 0)
            ):
                hist.eval_step.append(step)
                hist.eval_loss.append(eval_fn())
                model.train()
    except BaseException:
        model.train(was_training)
        raise
    model.eval()
    return hist


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = lm_loss,
) -> float:
    """Mean loss over ``batches`` with the model in eval mode (dropout off)."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    try:
        for x, y in batches:
            total += loss_fn(model, x, y).item()
            n += 1
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("evaluate got no batches")
    return total / n
