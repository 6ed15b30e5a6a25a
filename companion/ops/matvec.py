"""The decode form of a linear map: one input row against a weight matrix, written as a
weighted sum over each weight row (chapters 08, 16).

Shape legend: I input features, O output features. Decoding one token multiplies a
single row by every weight matrix, so each weight is read once and used for two FLOPs:
the step can be no faster than memory delivers the weights. A BLAS ``gemm`` is built
for many rows and blocks its loops for reuse a single row cannot have; for one row its
speed is the library's, and on some CPUs far below the memory's (``python -m
companion.bench decode`` times both forms beside the copy bandwidth). Written as
``(W * x).sum(-1)``, the same product is one multiply-and-reduce loop that
``torch.compile`` turns into vectorised code streaming W row by row. Inductor makes
this rewrite itself on GPUs (with coordinate-descent tuning) and not on CPUs, where
:class:`OneRowLinears` makes it: the compiled decode step of
:mod:`companion.models.generation` runs inside one. In eager mode the form would build
the whole ``(O, I)`` product in memory first: it is for compiled code only.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["OneRowLinears", "matvec"]


def matvec(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` as a weighted sum over each weight row:
    ``x (…, I)``, ``weight (O, I)``, ``bias (O,)`` -> ``(…, O)``."""
    y = (weight * x.unsqueeze(-2)).sum(-1)
    return y if bias is None else y + bias


class OneRowLinears(TorchFunctionMode):
    """While active, every ``F.linear`` (so every ``nn.Linear``) whose input is a
    single row on the CPU runs as :func:`matvec`; other calls are left as they are.
    Meant to surround a compiled function, which it changes when it is traced."""

    def __torch_function__(
        self,
        func: Any,  # noqa: ANN401 - whatever torch function was called
        types: tuple[type, ...],
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:  # noqa: ANN401 - that function's result
        kwargs = kwargs or {}
        if func is F.linear:
            names = ("input", "weight", "bias")[: len(args)]
            named = dict(zip(names, args, strict=True), **kwargs)
            x = named["input"]
            if x.device.type == "cpu" and x.numel() == x.shape[-1]:
                return matvec(x, named["weight"], named.get("bias"))
        return func(*args, **kwargs)
