"""What a decode step cannot beat on this machine (chapters 08, 16): the memory's copy
bandwidth, and the time of the step's matrix-vector products alone, as ``F.linear``
calls (the floor of an eager loop) and compiled in the decode form the compiled step
uses (its floor). ``python -m companion.bench decode`` and ``weights`` report their
tokens per second against these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.layers.weight_quant import BlockLinear, Int8Linear
from companion.ops.matvec import OneRowLinears

from .common import median_seconds

__all__ = [
    "copy_bandwidth",
    "decode_form_products",
    "matmul_floor",
    "products_seconds",
    "widest_isa_options",
]


def copy_bandwidth(
    nbytes: int = 256 * 2**20,
    repeats: int = 5,
    device: torch.device | str = "cpu",
) -> float:
    """Memory traffic per second of one large tensor copy on ``device`` (median of
    ``repeats``, synchronised on an accelerator).

    A copy reads ``nbytes`` and writes ``nbytes``: both count, as in STREAM's "copy".
    """
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, repeats)


def matmul_floor(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds per token of the model's matrix-vector products alone: one ``(1, in)``
    row through every ``nn.Linear`` weight in turn, nothing else. No decoder built from
    these weights can be faster on this machine, whatever its framework."""
    weights = [
        m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    rows = [torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]

    def products() -> None:
        for w, x in zip(weights, rows, strict=True):
            torch.nn.functional.linear(x, w)

    return median_seconds(products, weights[0].device, repeats)


LINEARS = (nn.Linear, Int8Linear, BlockLinear)


def widest_isa_options() -> dict[str, int]:
    """Inductor options for the widest vector ISA this CPU has, whatever
    ``ATEN_CPU_CAPABILITY`` pins: a speed measurement, its outputs discarded. The width
    enters the code cache's key, so code for one width never runs built for another."""
    from torch._inductor import cpu_vec_isa

    widths = [isa.bit_width() for isa in cpu_vec_isa.valid_vec_isa_list()]
    return {"cpp.simdlen": max(widths)} if widths else {}


def decode_form_products(model: nn.Module) -> Callable[[], object]:
    """A function that runs the model's matrix-vector products alone once: one row
    through every linear layer (fp32, int8 or blocks) in turn, nothing else, each in the
    decode form the compiled step uses (:mod:`companion.ops.matvec` for fp32), compiled
    here for the CPU's widest vector ISA. Its guards are checked on this first call
    only, as the step's are."""
    layers = [m for m in model.modules() if isinstance(m, LINEARS)]
    rows = [torch.randn(1, 1, m.in_features) for m in layers]

    def products(xs: list[Tensor]) -> list[Tensor]:
        return [m(x) for m, x in zip(layers, xs, strict=True)]

    run = torch.compile(products, dynamic=False, options=widest_isa_options())
    with torch.no_grad(), OneRowLinears():
        run(rows)

    def once() -> None:
        with torch.no_grad(), OneRowLinears():
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                run(rows)

    return once


def products_seconds(model: nn.Module, repeats: int = 5) -> float:
    """Seconds per token of :func:`decode_form_products` (median of ``repeats``)."""
    return median_seconds(decode_form_products(model), torch.device("cpu"), repeats)
