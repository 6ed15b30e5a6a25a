"""Kimi Delta Attention, chunked vs recurrent (chapter 11): ``python -m companion.bench
kda``.

Times the forward pass (median of ``--repeats`` after one warm-up) of our
:func:`~companion.ops.delta_rule.chunk_kda`, transformers' pure-PyTorch
``chunk_kimi_delta_attention`` (Kimi Linear's fallback), our token-by-token
:func:`~companion.ops.delta_rule.recurrent_kda` and transformers'
``recurrent_kimi_delta_attention``, at B=1, fp32, with L2-normalised q/k and one
log-decay per key channel, ``g (B, T, H, D_k)``, on CPU unless ``--device`` says
otherwise. transformers' two functions are taken from under their kernel-hub dispatch
(``inspect.unwrap``), so they are the torch code even where flash-linear-attention is
installed; their columns are skipped, with a note, where transformers is absent.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from companion.device import default_device
from companion.ops.delta_rule import chunk_kda, recurrent_kda

from .common import median_seconds, positive_int

__all__ = ["add_parser", "bench_kda", "format_kda"]

FORMS = ("chunk", "hf_chunk", "recurrent", "hf_recurrent")


def _hf_kda() -> tuple[Callable[..., tuple], Callable[..., tuple]] | None:
    """transformers' torch chunked and recurrent KDA, or None where transformers is
    absent."""
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear
    except ImportError:
        return None
    return (
        inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention),
        inspect.unwrap(modeling_kimi_linear.recurrent_kimi_delta_attention),
    )


def bench_kda(
    lengths: Sequence[int],
    heads: int,
    dim: int,
    device: torch.device,
    repeats: int,
    chunk_size: int = 64,
) -> list[dict[str, float]]:
    """One row per length: ``{"T", "chunk_ms", "hf_chunk_ms", "recurrent_ms",
    "hf_recurrent_ms"}``; the ``hf_*`` ones are nan where transformers is not
    installed."""
    hf = _hf_kda()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in lengths:
        q, k, v = (
            torch.randn(1, t, heads, dim, generator=gen).to(device) for _ in range(3)
        )
        g = F.logsigmoid(torch.randn(1, t, heads, dim, generator=gen)).to(device)
        beta = torch.rand(1, t, heads, generator=gen).to(device)
        inputs = (q, k, v, g, beta)
        l2 = {"use_qk_l2norm_in_kernel": True}
        impls: dict[str, Callable[[], object]] = {
            "chunk": functools.partial(chunk_kda, *inputs, chunk_size=chunk_size, **l2),
            "recurrent": functools.partial(recurrent_kda, *inputs, **l2),
        }
        if hf is not None:
            impls["hf_chunk"] = functools.partial(
                hf[0], *inputs, chunk_size=chunk_size, **l2
            )
            # transformers' recurrent form requires initial_state, output_final_state
            impls["hf_recurrent"] = functools.partial(hf[1], *inputs, None, False, **l2)
        row: dict[str, float] = {"T": t} | {f"{f}_ms": math.nan for f in FORMS}
        with torch.no_grad():
            for name, run in impls.items():
                row[f"{name}_ms"] = 1e3 * median_seconds(run, device, repeats)
        rows.append(row)
    return rows


def _cell(x: float, width: int, ratio: bool = False) -> str:
    """``x`` in ``width`` columns (a ratio as ``1.5x``), or a dash where not measured."""
    if math.isnan(x):
        return f"{'—':>{width}}"
    return f"{x:>{width - 1}.1f}x" if ratio else f"{x:>{width}.2f}"


def format_kda(rows: list[dict[str, float]]) -> str:
    """A plain-text table of :func:`bench_kda`'s rows, with the ratios to our chunked
    form, and a note for each column not measured."""
    header = (
        f"{'T':>6} | {'chunk ms':>9} {'HF chunk ms':>11} {'recurrent ms':>12} "
        f"{'HF recurrent ms':>15} | {'HF chunk/chunk':>14} {'recurrent/chunk':>15} "
        f"{'HF recurrent/chunk':>18}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        c = r["chunk_ms"]
        lines.append(
            f"{int(r['T']):>6} | {_cell(c, 9)} {_cell(r['hf_chunk_ms'], 11)} "
            f"{_cell(r['recurrent_ms'], 12)} {_cell(r['hf_recurrent_ms'], 15)} | "
            f"{_cell(r['hf_chunk_ms'] / c, 14, True)} "
            f"{_cell(r['recurrent_ms'] / c, 15, True)} "
            f"{_cell(r['hf_recurrent_ms'] / c, 18, True)}"
        )
    if all(math.isnan(r["hf_chunk_ms"]) for r in rows):
        lines.append("— HF columns: transformers is not installed, skipped")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    device = default_device(args.device or "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"Kimi Delta Attention forward, B=1 H={args.heads} D={args.dim} "
        f"chunk={args.chunk_size}, per-channel decay, fp32 on {device.type}, median of "
        f"{args.repeats} after a warm-up (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)"
    )
    rows = bench_kda(
        args.lengths,
        args.heads,
        args.dim,
        device,
        args.repeats,
        args.chunk_size,
    )
    print(format_kda(rows))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``kda`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "kda", help="Kimi Delta Attention: chunked vs transformers vs recurrent"
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), help="default: cpu")
    p.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="T",
    )
    p.add_argument(
        "--heads", type=positive_int, default=4, help="H (key = value heads)"
    )
    p.add_argument("--dim", type=positive_int, default=64, help="D_k = D_v")
    p.add_argument("--chunk-size", type=positive_int, default=64, help="C")
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed runs per cell"
    )
    p.add_argument(
        "--threads", type=positive_int, help="CPU threads (default: torch's)"
    )
    p.set_defaults(run=_run)
