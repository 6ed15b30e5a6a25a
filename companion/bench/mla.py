"""Latent attention decoding, naive vs absorbed (chapter 08): ``python -m
companion.bench mla``.

One decode step (batch 1, one new token after S - 1 cached ones) of
:class:`companion.layers.mla.MultiHeadLatentAttention` in its two forms, on the same
weights and the same :class:`companion.layers.kv_cache.LatentCache`: ``naive``
re-expands every cached latent into per-head keys and values at each step, ``absorbed``
scores the latents directly. Median of ``--repeats`` after one warm-up, fp32. Beside the
times: the bytes of the latent cache and of the per-head K/V cache the naive form would
need to skip the re-expansion, and the largest difference between the two forms'
outputs.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch

from companion.layers.kv_cache import LatentCache
from companion.layers.mla import MultiHeadLatentAttention
from companion.layers.rotary import RotaryEmbedding

from .common import median_seconds, positive_int

__all__ = ["MLA_SHAPE", "add_parser", "bench_mla", "format_mla"]

# DeepSeek-like proportions at a size a laptop decodes: latent 256 = 4 heads' worth of K/V
MLA_SHAPE = {
    "d_model": 1024,
    "n_heads": 16,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
}


def _decode_step(
    module: MultiHeadLatentAttention,
    cache: LatentCache,
    x: torch.Tensor,
    pos: torch.Tensor,
) -> torch.Tensor:
    """Decode the token ``x`` at position ``pos`` (the cache holds the positions before
    it; the step rewrites the same row each time)."""
    return module(x, pos, cache)


def bench_mla(
    lengths: Sequence[int],
    device: torch.device,
    repeats: int,
    shape: dict[str, int] | None = None,
) -> list[dict[str, float]]:
    """One row per context length S: ``{"S", "naive_ms", "absorbed_ms", "latent_mib",
    "full_mib", "max_diff"}`` for one fp32 decode step at position S - 1."""
    shape = dict(MLA_SHAPE if shape is None else shape)
    d, h = shape.pop("d_model"), shape.pop("n_heads")
    torch.manual_seed(0)
    rope = RotaryEmbedding(shape["qk_rope_head_dim"], max_len=max(lengths))
    fixed = {"causal": True, "rope": rope}
    naive = (
        MultiHeadLatentAttention(d, h, **shape, **fixed, form="naive").to(device).eval()
    )
    absorbed = (
        MultiHeadLatentAttention(d, h, **shape, **fixed, form="absorbed")
        .to(device)
        .eval()
    )
    absorbed.load_state_dict(naive.state_dict())
    c, r = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    per_head = h * (
        shape["qk_nope_head_dim"] + r + shape["v_head_dim"]
    )  # K and V widths
    rows = []
    for s in lengths:
        cache = naive.new_cache(1, s, dtype=torch.float32, device=device)
        with torch.no_grad():
            cache.update(
                torch.arange(s - 1, device=device),
                torch.randn(1, s - 1, c + r, device=device),
            )
        x = torch.randn(1, 1, d, device=device)
        pos = torch.tensor([s - 1], device=device)
        outs = {}
        row: dict[str, float] = {"S": s}
        for name, module in (("naive", naive), ("absorbed", absorbed)):
            step = functools.partial(_decode_step, module, cache, x, pos)
            with torch.no_grad():
                row[f"{name}_ms"] = 1e3 * median_seconds(step, device, repeats)
                outs[name] = step()
        row["latent_mib"] = cache.kv.nbytes / 2**20
        row["full_mib"] = (
            per_head * 4 * s / 2**20
        )  # what a KVCache of the expanded K/V holds
        row["max_diff"] = (outs["naive"] - outs["absorbed"]).abs().max().item()
        rows.append(row)
    return rows


def format_mla(rows: list[dict[str, float]]) -> str:
    """A plain-text table of :func:`bench_mla`'s rows, with the time and memory
    ratios."""
    header = (
        f"{'S':>6} | {'naive ms':>9} {'absorbed ms':>11} {'naive/absorbed':>14} | "
        f"{'latent MiB':>10} {'per-head K/V MiB':>16} {'K/V / latent':>12} | {'max |Δ|':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{int(r['S']):>6} | {r['naive_ms']:>9.2f} {r['absorbed_ms']:>11.2f} "
            f"{r['naive_ms'] / r['absorbed_ms']:>13.1f}x | {r['latent_mib']:>10.2f} "
            f"{r['full_mib']:>16.2f} {r['full_mib'] / r['latent_mib']:>11.1f}x | "
            f"{r['max_diff']:>8.1e}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = " ".join(f"{k}={v}" for k, v in MLA_SHAPE.items())
    print(
        f"MLA decode step, batch 1, fp32 on {device.type}, {dims}; median of {args.repeats} "
        f"after a warm-up (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    print(format_mla(bench_mla(args.lengths, device, args.repeats)))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``mla`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "mla", help="latent attention decode step: naive vs absorbed, cache bytes"
    )
    p.add_argument("--device", choices=("cpu", "cuda", "mps"), default="cpu")
    p.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        default=[512, 2048, 8192],
        help="context S",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="timed steps per cell"
    )
    p.add_argument(
        "--threads", type=positive_int, help="CPU threads (default: torch's)"
    )
    p.set_defaults(run=_run)
