"""Decode attention's cache read against copy bandwidth (chapter 08):
``python -m companion.bench bandwidth``.

Does one decode step of attention run at the speed of memory? It times one step (batch
1, one query for each of H = 32 query heads of width 128, median of ``--repeats`` after
a warm-up) in four layouts: MHA (32 K/V heads), GQA (8) and MQA (1) through
:func:`companion.ops.grouped.grouped_attention`, which reads each cached head once, and
GQA with its heads first repeated by :func:`companion.ops.grouped.expand_kv`, as the
easy implementation does. Every layout gets a K/V cache of the same size in MiB (so MQA
holds 32 times MHA's positions S); sizes above the last-level cache (32 MiB of L3 on the
2-core CPUs this book is built on; check your accelerator's and pass ``--cache-mib``
well above it) make the reads come from memory. Each row gives the bytes the step must
move at the least, the time, the rate that implies, that rate as a fraction of the copy
bandwidth, and the step's FLOPs per second. The copy bandwidth is measured in the same
process, before and after the rows (the higher of the two is kept, so that on a shared
machine the yardstick is not the low one): the memory traffic per second, bytes read
plus bytes written as in STREAM's "copy", of one large ``Tensor.copy_``.

Bytes moved: the grouped forms read K and V once, 2·H_kv·S·D elements. Repeating the
heads reads the stored GQA cache, writes an MHA-sized copy and reads that copy:
(H_kv + 2·H)·2·S·D elements. The query, the H·S scores and the output are left out
(the scores are 1/8 of MQA's cache at H = 32, D = 128, and are written and read more
than once), so the rate is a lower bound on the step's traffic rate. A step well below
the copy rate is limited by something other than memory (arithmetic, per-call costs).
fp32 on CPU, bf16 on accelerators that support it.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch

from companion.analysis.decode_cost import decode_attention_flops
from companion.device import default_device, default_dtype
from companion.ops.grouped import expand_kv, grouped_attention

from .common import median_seconds, positive_int

__all__ = [
    "LAYOUTS",
    "add_parser",
    "bench_kv_read",
    "device_copy_bandwidth",
    "format_kv_read",
    "moved_bytes",
]

# name: (K/V heads, heads repeated before attention), for H = 32 query heads
LAYOUTS: dict[str, tuple[int, bool]] = {
    "MHA 32:32": (32, False),
    "GQA 32:8": (8, False),
    "MQA 32:1": (1, False),
    "GQA 32:8 repeated": (8, True),
}


def moved_bytes(
    n_heads: int,
    n_kv_heads: int,
    context: int,
    head_dim: int,
    element_size: int,
    *,
    repeated: bool = False,
) -> int:
    """Least bytes one decode step of one layer moves (batch 1): the cache read once,
    2·H_kv·S·D elements; with ``repeated``, also an H-head copy written and read back."""
    heads = n_kv_heads + (2 * n_heads if repeated else 0)
    return 2 * heads * context * head_dim * element_size


def device_copy_bandwidth(
    device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5
) -> float:
    """Bytes per second, read plus written, of one ``nbytes`` tensor copy on ``device``
    (median of ``repeats`` after a warm-up)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, repeats)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeated: bool):
    if repeated:  # copy each K/V head to the query heads that share it, then attend
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    return grouped_attention(q, k, v)


def bench_kv_read(
    cache_mib: Sequence[int],
    device: torch.device,
    repeats: int,
    head_dim: int = 128,
    copy_mib: int = 256,
) -> tuple[list[dict[str, float | str]], float]:
    """Rows ``{"cache_mib", "layout", "S", "mib", "ms", "gbps", "of_copy", "gflops"}``,
    one per cache size and layout of ``LAYOUTS``, and the copy bandwidth (bytes/s) they
    are compared with. Every layout gets a K/V cache of ``cache_mib`` MiB (S chosen to
    fit; the repeated GQA gets GQA's), so all are compared at equal bytes, and sizes
    above the last-level cache keep the reads in memory."""
    dtype = default_dtype(device)
    size = torch.empty((), dtype=dtype).element_size()
    n_heads = 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, n_heads, 1, head_dim, generator=gen).to(device, dtype)
    copy_bps = device_copy_bandwidth(device, copy_mib * 2**20, repeats)
    rows: list[dict[str, float | str]] = []
    with torch.no_grad():
        for mib in cache_mib:
            for name, (h_kv, repeated) in LAYOUTS.items():
                s = max(1, mib * 2**20 // (2 * h_kv * head_dim * size))
                k, v = (
                    torch.rand(1, h_kv, s, head_dim, generator=gen).to(device, dtype)
                    for _ in range(2)
                )  # (1, H_kv, S, D)
                run = functools.partial(_step, q, k, v, repeated)
                seconds = median_seconds(run, device, repeats)
                nbytes = moved_bytes(
                    n_heads, h_kv, s, head_dim, size, repeated=repeated
                )
                flops = decode_attention_flops(n_heads, head_dim, head_dim, s)
                rows.append(
                    {
                        "cache_mib": mib,
                        "layout": name,
                        "S": s,
                        "mib": nbytes / 2**20,
                        "ms": 1e3 * seconds,
                        "gbps": nbytes / seconds / 1e9,
                        "gflops": flops / seconds / 1e9,
                    }
                )
                del k, v, run
    copy_bps = max(copy_bps, device_copy_bandwidth(device, copy_mib * 2**20, repeats))
    for r in rows:
        r["of_copy"] = r["gbps"] * 1e9 / copy_bps
    return rows, copy_bps


def format_kv_read(rows: list[dict[str, float | str]], copy_bps: float) -> str:
    """A plain-text table of :func:`bench_kv_read`'s rows under the copy bandwidth."""
    header = (
        f"{'cache':>5}  {'layout':<18}{'S':>7} {'MiB moved':>9} {'ms':>8} "
        f"{'GB/s':>6} {'of copy':>7} {'GFLOP/s':>7}"
    )
    lines = [f"copy bandwidth (read + write): {copy_bps / 1e9:.1f} GB/s", header]
    lines.append("-" * len(header))
    for r in rows:
        lines.append(
            f"{int(r['cache_mib']):>5}  {r['layout']:<18}{int(r['S']):>7} "
            f"{r['mib']:>9.0f} {r['ms']:>8.2f} {r['gbps']:>6.1f} {r['of_copy']:>7.0%} "
            f"{r['gflops']:>7.1f}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    device = default_device(args.device)
    print(
        f"one decode step's attention, B=1 H=32 D={args.head_dim}, one query per head,"
        f" {default_dtype(device)} on {device.type}\n"
        f"{torch.get_num_threads()} threads, median of {args.repeats} after a warm-up"
        f" (torch {torch.__version__}); cache = K/V cache size in MiB"
    )
    rows, copy_bps = bench_kv_read(
        args.cache_mib, device, args.repeats, args.head_dim, args.copy_mib
    )
    print(format_kv_read(rows, copy_bps))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bandwidth`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "bandwidth",
        help="decode attention's cache read (MHA, GQA, MQA, repeated) vs copy GB/s",
    )
    p.add_argument(
        "--device", choices=("cuda", "mps", "cpu"), help="default: the best present"
    )
    p.add_argument(
        "--cache-mib",
        type=positive_int,
        nargs="+",
        default=[64, 256],
        help="K/V cache sizes, the same for every layout (above the last-level cache)",
    )
    p.add_argument("--head-dim", type=positive_int, default=128, help="D")
    p.add_argument(
        "--copy-mib", type=positive_int, default=256, help="size of the copied tensor"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per cell"
    )
    p.set_defaults(run=_run)
