"""The gated delta rule, chunked vs recurrent (chapter 11): ``python -m companion.bench
deltanet``.

Times the forward pass (median of ``--repeats`` rounds after a warm-up round, each
round running every form in turn) of our
:func:`~companion.ops.delta_rule.chunk_gated_delta_rule`, transformers' pure-PyTorch
``torch_chunk_gated_delta_rule`` (Qwen3-Next's fallback; skipped when transformers is
absent) and our token-by-token
:func:`~companion.ops.delta_rule.recurrent_gated_delta_rule`, at B=1, fp32, with
L2-normalised q/k, on CPU unless ``--device`` says otherwise.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from companion.device import default_device
from companion.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

from .common import interleaved_medians, positive_int

__all__ = ["add_parser", "bench_deltanet", "format_deltanet"]


def _hf_chunk() -> Callable[..., tuple] | None:
    """transformers' torch chunked gated delta rule, or None where transformers is
    absent."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next
    except ImportError:
        return None
    return modeling_qwen3_next.torch_chunk_gated_delta_rule


def bench_deltanet(
    lengths: Sequence[int],
    heads: int,
    dim: int,
    device: torch.device,
    repeats: int,
    chunk_size: int = 64,
) -> list[dict[str, float]]:
    """One row per length: ``{"T", "chunk_ms", "hf_chunk_ms", "recurrent_ms"}``.

    ``hf_chunk_ms`` is nan where transformers is not installed.
    """
    hf = _hf_chunk()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in lengths:
        q, k, v = (
            torch.randn(1, t, heads, dim, generator=gen).to(device) for _ in range(3)
        )
        g = F.logsigmoid(torch.randn(1, t, heads, generator=gen)).to(device)
        beta = torch.rand(1, t, heads, generator=gen).to(device)
        impls: dict[str, Callable[[], object]] = {
            "chunk": functools.partial(
                chunk_gated_delta_rule,
                q,
                k,
                v,
                g,
                beta,
                chunk_size=chunk_size,
                use_qk_l2norm_in_kernel=True,
            ),
            "recurrent": functools.partial(
                recurrent_gated_delta_rule,
                q,
                k,
                v,
                g,
                beta,
                use_qk_l2norm_in_kernel=True,
            ),
        }
        if hf is not None:
            impls["hf_chunk"] = functools.partial(
                hf,
                q,
                k,
                v,
                g,
                beta,
                chunk_size=chunk_size,
                use_qk_l2norm_in_kernel=True,
            )
        row: dict[str, float] = {"T": t, "hf_chunk_ms": float("nan")}
        with torch.no_grad():
            times = interleaved_medians(impls, device, repeats)
        row |= {f"{name}_ms": 1e3 * s for name, s in times.items()}
        rows.append(row)
    return rows


def format_deltanet(rows: list[dict[str, float]]) -> str:
    """A plain-text table of :func:`bench_deltanet`'s rows, with the two ratios."""
    header = (
        f"{'T':>6} | {'chunk ms':>9} {'HF chunk ms':>11} {'recurrent ms':>12} | "
        f"{'HF chunk/chunk':>14} {'recurrent/chunk':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{int(r['T']):>6} | {r['chunk_ms']:>9.2f} {r['hf_chunk_ms']:>11.2f} "
            f"{r['recurrent_ms']:>12.2f} | {r['hf_chunk_ms'] / r['chunk_ms']:>13.1f}x "
            f"{r['recurrent_ms'] / r['chunk_ms']:>14.1f}x"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    device = default_device(args.device or "cpu")
    print(
        f"gated delta rule forward, B=1 H={args.heads} D={args.dim} chunk={args.chunk_size}, "
        f"fp32 on {device.type}, median of {args.repeats} rounds after a warm-up round "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    rows = bench_deltanet(
        args.lengths, args.heads, args.dim, device, args.repeats, args.chunk_size
    )
    print(format_deltanet(rows))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``deltanet`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "deltanet", help="gated delta rule: chunked vs transformers vs recurrent"
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), help="default: cpu")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[4096], help="T")
    p.add_argument(
        "--heads", type=positive_int, default=4, help="H (key = value heads)"
    )
    p.add_argument("--dim", type=positive_int, default=64, help="D_k = D_v")
    p.add_argument("--chunk-size", type=positive_int, default=64, help="C")
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per cell"
    )
    p.set_defaults(run=_run)
