"""DeepSeek Sparse Attention against dense attention: ``python -m companion.bench
sparse``.

Shape legend: B = 1, H query heads, T queries, S keys, K = min(top-k, S) keys read per
query, C latent width, R rotated width, D = C + R, H_I and D_I the indexer's heads and
head width, d model width, C_q query latent width.

Times (median of ``--repeats`` after one warm-up) attention over the selected keys in
its two forms, :func:`~companion.ops.sparse_attention.gather_sparse_attention` (O(T·K))
and :func:`~companion.ops.sparse_attention.masked_sparse_attention` (the reference,
O(T·S)), against dense causal SDPA, in MLA's absorbed shape: H query heads of width D
against one shared latent key head whose first C channels are the values. Decode is
T = 1 query against S cached keys (the serving case), prefill T = S. Beside them
:class:`~companion.layers.lightning_indexer.LightningIndexer`'s forward (scores over all
S keys, then top-k): DSA pays it, O(S) per query, so indexer + gather is the honest
rival of dense. Each query's K keys are spread evenly over its visible prefix (the cost
does not depend on which). A cell whose estimated allocation exceeds ``--max-gib`` is
skipped with a note: in prefill the gather form, which copies the (T, K) selected rows,
meets that cap first.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.device import default_device, default_dtype
from companion.layers.lightning_indexer import LightningIndexer
from companion.ops.sparse_attention import (
    gather_sparse_attention,
    masked_sparse_attention,
)

from .common import median_seconds, positive_int

__all__ = ["SPARSE_SHAPE", "add_parser", "bench_sparse", "crossover"]
__all__ += ["dense_attention", "format_sparse", "spread_selection"]

# DeepSeek-V3.2 (128 heads of 512 + 64, an indexer of 64 heads of 128, d = 7168, C_q =
# 1536) with heads / 8 and head widths / 2, as the mla bench scales it down
SPARSE_SHAPE = {
    "n_heads": 16,
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "d_model": 1024,
    "q_lora_rank": 256,
}
FORMS = ("dense", "masked", "gather", "indexer")


def spread_selection(first: int, t: int, k: int, device: torch.device) -> Tensor:
    """``(1, T, k)`` int64 selection for the queries at positions ``first ..
    first + T - 1``: query p reads min(k, p + 1) distinct keys spread evenly over
    ``0 .. p``, ``-1`` in the slots left over."""
    visible = torch.arange(first + 1, first + t + 1, device=device)[:, None]  # (T, 1)
    j = torch.arange(k, device=device)[None]  # (1, k)
    spread = j * visible // k  # distinct where visible >= k
    return torch.where(visible >= k, spread, j.masked_fill(j >= visible, -1))[None]


def dense_attention(q: Tensor, latent: Tensor, c: int) -> Tensor:
    """Causal SDPA of ``q (B, H, T, D)`` over one shared latent head ``latent (B, 1, S,
    D)``, keys all of it and values its first ``c`` channels: ``(B, H, T, C)``. The T
    queries are the last T positions of S: T = 1 in decode, all S in prefill.

    The values are passed as the whole latent and the output cut to C channels, as
    latent-attention kernels read them: with equal key and value widths SDPA takes its
    fused kernel (on CPU the math path, which holds the (H, T, S) scores, is the one it
    takes for a C-wide value, about twice as slow)."""
    if q.shape[2] == 1:  # one query per head sees every key: heads as query rows
        o = F.scaled_dot_product_attention(q.transpose(1, 2), latent, latent)
        return o.transpose(1, 2)[..., :c]
    kv = latent.expand(-1, q.shape[1], -1, -1)  # (B, H, S, D), a view
    return F.scaled_dot_product_attention(q, kv, kv, is_causal=True)[..., :c]


def _footprint(
    t: int, s: int, k: int, shape: dict[str, int], elem: int
) -> dict[str, int]:
    """Estimated bytes each form allocates for one call (the largest temporaries)."""
    h, c = shape["n_heads"], shape["kv_lora_rank"]
    dd = 2 * c + shape["qk_rope_head_dim"]  # key + value widths
    return {
        "dense": elem * (2 * h * t + s) * (c + shape["qk_rope_head_dim"]),
        # expanded K/V and about three (H, T, S) score-sized tensors, in fp32
        "masked": 4 * (h * s * dd + 3 * h * t * s) + 2 * t * s,
        # the gathered (T, K) keys and values, and the (H, T, K) scores
        "gather": elem * t * k * dd + 4 * 3 * h * t * k + 8 * t * k,
        # (H_I, T, S) logits and their ReLU, then (T, S) scores and mask, in fp32
        "indexer": 4 * (2 * shape["index_n_heads"] * t * s + 3 * t * s) + t * s,
    }


def _time_ms(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``run()``, nan where the accelerator runs out of memory."""
    try:
        with torch.no_grad():
            return 1e3 * median_seconds(run, device, repeats)
    except torch.OutOfMemoryError:
        return math.nan


def bench_sparse(
    lengths: Sequence[int],
    prefill_lengths: Sequence[int],
    topks: Sequence[int],
    device: torch.device,
    repeats: int,
    shape: dict[str, int] | None = None,
    max_gib: float = 2.0,
) -> dict[str, list[dict[str, float]]]:
    """``{"decode": rows, "prefill": rows}``, one row per (S, top-k): ``{"T", "S",
    "K", "<form>_ms", "<form>_gib"}`` for dense, masked, gather and indexer; a form's
    ``_ms`` is nan where its estimated ``_gib`` exceeds ``max_gib``."""
    shape = dict(SPARSE_SHAPE if shape is None else shape)
    dtype = default_dtype(device)
    elem = torch.finfo(dtype).bits // 8
    h, c, r = shape["n_heads"], shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    d, cq = shape["d_model"], shape["q_lora_rank"]
    torch.manual_seed(0)
    indexers = {
        kk: LightningIndexer(
            d,
            cq,
            n_heads=shape["index_n_heads"],
            head_dim=shape["index_head_dim"],
            topk=kk,
        )
        .to(device, dtype)
        .eval()
        for kk in topks
    }
    gen = torch.Generator().manual_seed(0)

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, generator=gen).to(device, dtype)

    out: dict[str, list[dict[str, float]]] = {"decode": [], "prefill": []}
    for setting, ss in (("decode", lengths), ("prefill", prefill_lengths)):
        for s in ss:
            t = 1 if setting == "decode" else s
            latent = randn(1, 1, s, c + r)  # (B, 1, S, D): the keys
            v = latent[..., :c]  # (B, 1, S, C): the values, a view
            q, x, q_latent = randn(1, h, t, c + r), randn(1, t, d), randn(1, t, cq)
            positions = torch.arange(s - t, s, device=device)  # (T,)
            for kk in topks:
                k_eff = min(kk, s)
                sel = spread_selection(s - t, t, k_eff, device)  # (1, T, K)
                indexer, cache = indexers[kk], None
                if setting == "decode":  # S - 1 keys cached; each call writes row S - 1
                    cache = indexer.new_cache(1, s, dtype=dtype, device=device)
                    past = torch.arange(s - 1, device=device)
                    cache.update(past, randn(1, s - 1, indexer.head_dim))
                runs = {
                    "dense": partial(dense_attention, q, latent, c),
                    "masked": partial(masked_sparse_attention, q, latent, v, sel),
                    "gather": partial(gather_sparse_attention, q, latent, v, sel),
                    "indexer": partial(indexer, x, q_latent, positions, cache),
                }
                row: dict[str, float] = {"T": t, "S": s, "K": kk}
                for form, nbytes in _footprint(t, s, k_eff, shape, elem).items():
                    row[f"{form}_gib"] = gib = nbytes / 2**30
                    if form == "dense" and kk != topks[0]:  # one call for every top-k
                        row["dense_ms"] = out[setting][-1]["dense_ms"]
                    elif gib > max_gib:
                        row[f"{form}_ms"] = math.nan
                    else:
                        row[f"{form}_ms"] = _time_ms(runs[form], device, repeats)
                out[setting].append(row)
    return out


def crossover(rows: list[dict[str, float]], top_k: int, forms: Sequence[str]) -> str:
    """Where the summed ``forms`` (e.g. indexer + gather) at ``top_k`` beat dense in
    ``rows``: ``"from S = ..."`` when they stay faster from there to the longest length
    measured, else a plain "not within" sentence."""
    pairs = sorted(
        (int(r["S"]), sum(r[f"{f}_ms"] for f in forms) < r["dense_ms"])
        for r in rows
        if r["K"] == top_k
        and not any(math.isnan(r[f"{f}_ms"]) for f in (*forms, "dense"))
    )
    if not pairs:
        return "not measured (over the memory cap)"
    span = f"S = {pairs[0][0]} .. {pairs[-1][0]}"
    if not pairs[-1][1]:
        return f"does not beat dense within {span}"
    first = len(pairs)
    while first and pairs[first - 1][1]:
        first -= 1
    return f"beats dense from S = {pairs[first][0]} (measured {span})"


def _cell(x: float, width: int, ratio: bool = False) -> str:
    """``x`` in ``width`` columns (a ratio as ``1.5x``), or ``skip`` where not measured."""
    if math.isnan(x):
        return f"{'skip':>{width}}"
    return f"{x:>{width - 1}.2f}x" if ratio else f"{x:>{width}.2f}"


def format_sparse(results: dict[str, list[dict[str, float]]], max_gib: float) -> str:
    """Plain-text tables of :func:`bench_sparse`'s two settings: times, ratios to
    dense, the crossover per top-k and a note for every skipped cell."""
    titles = {
        "decode": "decode: T = 1 query against S cached keys",
        "prefill": "prefill: T = S queries, causal",
    }
    header = (
        f"{'S':>6} {'top-k':>5} | {'dense ms':>9} {'masked ms':>9} {'gather ms':>9} "
        f"{'indexer ms':>10} | {'masked/dense':>12} {'gather/dense':>12} "
        f"{'(indexer+gather)/dense':>22}"
    )
    blocks = []
    for setting, rows in results.items():
        if not rows:
            continue
        lines = [titles[setting], header, "-" * len(header)]
        for r in rows:
            d = r["dense_ms"]
            lines.append(
                f"{int(r['S']):>6} {int(r['K']):>5} | {_cell(d, 9)} "
                f"{_cell(r['masked_ms'], 9)} {_cell(r['gather_ms'], 9)} "
                f"{_cell(r['indexer_ms'], 10)} | {_cell(r['masked_ms'] / d, 12, True)} "
                f"{_cell(r['gather_ms'] / d, 12, True)} "
                f"{_cell((r['indexer_ms'] + r['gather_ms']) / d, 22, True)}"
            )
        for kk in dict.fromkeys(int(r["K"]) for r in rows):
            lines.append(
                f"top-k {kk}: gather alone {crossover(rows, kk, ['gather'])}; "
                f"indexer + gather {crossover(rows, kk, ['indexer', 'gather'])}"
            )
        skipped = [
            f"{f} at S={int(r['S'])} top-k={int(r['K'])} "
            + (
                f"(~{r[f'{f}_gib']:.1f} GiB)"
                if r[f"{f}_gib"] > max_gib
                else "(out of memory)"
            )
            for r in rows
            for f in FORMS
            if math.isnan(r[f"{f}_ms"])
        ]
        if skipped:
            lines.append(
                f"skipped (estimate over --max-gib {max_gib:g}, or out of memory): "
                + ", ".join(skipped)
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _run(args: argparse.Namespace) -> None:
    device = default_device(args.device or "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    sh = SPARSE_SHAPE
    print(
        f"DeepSeek Sparse Attention vs dense causal SDPA, batch 1, "
        f"{default_dtype(device)} on {device.type}, median of {args.repeats} after a "
        f"warm-up (torch {torch.__version__}, {torch.get_num_threads()} threads)\n"
        f"MLA's absorbed shape, DeepSeek-V3.2 scaled down: H={sh['n_heads']} query heads "
        f"of width C+R = {sh['kv_lora_rank']}+{sh['qk_rope_head_dim']} (V3.2: 128 of "
        f"512+64) against one shared latent key head, values its first C channels\n"
        f"indexer: H_I={sh['index_n_heads']} heads of D_I={sh['index_head_dim']} (V3.2: "
        f"64 of 128), d={sh['d_model']}, C_q={sh['q_lora_rank']}; a query reads "
        f"min(top-k, its visible keys) keys\n"
    )
    results = bench_sparse(
        args.lengths,
        args.prefill_lengths,
        args.topk,
        device,
        args.repeats,
        max_gib=args.max_gib,
    )
    print(format_sparse(results, args.max_gib))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sparse`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "sparse",
        help="DSA: indexer + top-k sparse attention (gather, masked) vs dense SDPA",
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), help="default: cpu")
    p.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        default=[512, 1024, 2048, 4096, 8192, 16384],
        help="S for decode (T = 1)",
    )
    p.add_argument(
        "--prefill-lengths",
        type=positive_int,
        nargs="*",
        default=[256, 512, 1024],
        help="S for prefill (T = S); none: skip prefill",
    )
    p.add_argument(
        "--topk",
        type=positive_int,
        nargs="+",
        default=[256, 2048],
        help="keys per query (DeepSeek-V3.2: 2048)",
    )
    p.add_argument(
        "--max-gib",
        type=float,
        default=2.0,
        help="skip a cell whose estimated allocation exceeds this",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per cell"
    )
    p.add_argument(
        "--threads", type=positive_int, help="CPU threads (default: torch's)"
    )
    p.set_defaults(run=_run)
