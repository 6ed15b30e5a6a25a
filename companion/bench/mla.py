"""Latent attention decoding, naive vs absorbed (chapters 08, 16): ``python -m
companion.bench mla``.

One decode step (batch 1, one new token after S - 1 cached ones) of
:class:`companion.layers.mla.MultiHeadLatentAttention` in its two forms, on the same
weights and the same :class:`companion.layers.kv_cache.LatentCache`: ``naive``
re-expands every cached latent into per-head keys and values at each step, ``absorbed``
scores the latents directly. Median of ``--repeats`` after one warm-up, fp32. Beside the
times: the bytes of the latent cache and of the per-head K/V cache the naive form would
need to skip the re-expansion, and the largest difference between the two forms'
outputs.

Then both phases of serving (:func:`bench_mla_phases`, chapter 16), at
``PHASE_SHAPE``: DeepSeek-V3's latent, query-latent and per-head widths with 16 of its
128 heads and a model width of 2,048 instead of 7,168. For each length L, a prefill of L
tokens (every key used by up to L queries) and a decode step at context L (every key
used by one query), each form timed on the same weights, beside the FLOPs
:func:`~companion.analysis.phases.latent_attention_flops` counts for it.
:func:`matmul_rate` is this machine's compute roof, a large matmul's FLOP/s.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch

from companion.analysis.phases import latent_attention_flops
from companion.layers.kv_cache import LatentCache
from companion.layers.mla import MultiHeadLatentAttention
from companion.layers.rotary import RotaryEmbedding

from .common import median_seconds, positive_int

__all__ = [
    "MLA_SHAPE",
    "PHASE_SHAPE",
    "add_parser",
    "bench_mla",
    "bench_mla_phases",
    "format_mla",
    "format_mla_phases",
    "matmul_rate",
]

# DeepSeek-like proportions at a size a laptop decodes: latent 256 = 4 heads' worth of K/V
MLA_SHAPE = {
    "d_model": 1024,
    "n_heads": 16,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
}

# DeepSeek-V3's widths (config.json) with 16 of its 128 heads, d_model 2048 of 7168
PHASE_SHAPE = {
    "d_model": 2048,
    "n_heads": 16,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
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


def _forms(
    shape: dict[str, int], max_len: int, device: torch.device
) -> tuple[MultiHeadLatentAttention, MultiHeadLatentAttention]:
    """A causal MLA layer of ``shape`` in the naive form and one with the same weights
    in the absorbed form (seeded: the same weights every call)."""
    widths = dict(shape)
    d, h = widths.pop("d_model"), widths.pop("n_heads")
    torch.manual_seed(0)
    rope = RotaryEmbedding(widths["qk_rope_head_dim"], max_len=max_len)
    naive, absorbed = (
        MultiHeadLatentAttention(d, h, **widths, causal=True, rope=rope, form=form)
        .to(device)
        .eval()
        for form in ("naive", "absorbed")
    )
    absorbed.load_state_dict(naive.state_dict())
    return naive, absorbed


def _filled_cache(
    module: MultiHeadLatentAttention, s: int, device: torch.device
) -> LatentCache:
    """A cache of ``s`` rows whose first s - 1 hold random latents."""
    cache = module.new_cache(1, s, dtype=torch.float32, device=device)
    width = module.kv_lora_rank + module.qk_rope_head_dim
    with torch.no_grad():
        cache.update(
            torch.arange(s - 1, device=device),
            torch.randn(1, s - 1, width, device=device),
        )
    return cache


def bench_mla(
    lengths: Sequence[int],
    device: torch.device,
    repeats: int,
    shape: dict[str, int] | None = None,
) -> list[dict[str, float]]:
    """One row per context length S: ``{"S", "naive_ms", "absorbed_ms", "latent_mib",
    "full_mib", "max_diff"}`` for one fp32 decode step at position S - 1."""
    shape = MLA_SHAPE if shape is None else shape
    naive, absorbed = _forms(shape, max(lengths), device)
    widths = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"]
    per_head = shape["n_heads"] * widths  # K and V widths
    rows = []
    for s in lengths:
        cache = _filled_cache(naive, s, device)
        x = torch.randn(1, 1, shape["d_model"], device=device)
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


def matmul_rate(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of one fp32 ``(n, n) @ (n, n)`` matmul on the CPU, 2n³ FLOPs (median of
    ``repeats``): the compute roof of this machine's roofline."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_seconds(lambda: a @ b, torch.device("cpu"), repeats)


def bench_mla_phases(
    lengths: Sequence[int],
    device: torch.device,
    repeats: int,
    shape: dict[str, int] | None = None,
) -> list[dict[str, float | str]]:
    """Two rows per length L, ``{"phase", "L", "naive_gflop", "absorbed_gflop",
    "naive_ms", "absorbed_ms", "max_diff"}``: a prefill of L tokens (cache written) and
    one decode step at context L, fp32, each form on the same weights and inputs."""
    shape = PHASE_SHAPE if shape is None else shape
    naive, absorbed = _forms(shape, max(lengths), device)
    forms = (("naive", naive), ("absorbed", absorbed))
    rows: list[dict[str, float | str]] = []
    for n in lengths:
        for phase, tokens in (("prefill", n), ("decode", 1)):
            x = torch.randn(1, tokens, shape["d_model"], device=device)
            pos = torch.arange(n - tokens, n, device=device)
            cache = _filled_cache(naive, n, device)  # prefill rewrites every row
            row: dict[str, float | str] = {"phase": phase, "L": n}
            outs = {}
            for name, module in forms:
                step = functools.partial(_decode_step, module, cache, x, pos)
                with torch.no_grad():
                    row[f"{name}_ms"] = 1e3 * median_seconds(step, device, repeats)
                    outs[name] = step()
                flops = latent_attention_flops(shape, name, tokens, n)
                row[f"{name}_gflop"] = flops / 1e9
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


def format_mla_phases(rows: list[dict[str, float | str]]) -> str:
    """A plain-text table of :func:`bench_mla_phases`'s rows: counted GFLOP and
    milliseconds of each form, and the time ratio naive / absorbed."""
    header = (
        f"{'phase':<8}{'L':>5} | {'naive':>8} {'absorbed':>8} GFLOP | "
        f"{'naive':>7} {'absorbed':>8} ms {'ratio':>6} | {'max |Δ|':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['phase']:<8}{int(r['L']):>5} | {r['naive_gflop']:>8.3f} "
            f"{r['absorbed_gflop']:>8.3f}       | {r['naive_ms']:>7.1f} "
            f"{r['absorbed_ms']:>8.2f}    {r['naive_ms'] / r['absorbed_ms']:>5.2f}x | "
            f"{r['max_diff']:>7.1e}"
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
    if not args.phase_lengths:
        return
    dims = " ".join(f"{k}={v}" for k, v in PHASE_SHAPE.items())
    print(f"\nMLA prefill of L tokens and decode step at context L, fp32, {dims}")
    print(format_mla_phases(bench_mla_phases(args.phase_lengths, device, args.repeats)))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``mla`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "mla",
        help="latent attention, naive vs absorbed: decode step, cache bytes, phases",
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
        "--phase-lengths",
        type=positive_int,
        nargs="*",
        default=[256, 1024],
        help="L for the prefill/decode table (none: skip it)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="timed steps per cell"
    )
    p.add_argument(
        "--threads", type=positive_int, help="CPU threads (default: torch's)"
    )
    p.set_defaults(run=_run)
