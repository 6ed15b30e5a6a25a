"""The Triton kernels against their PyTorch peers (chapters 02, 06, 11): ``python -m
companion.bench kernels``.

Times, in bf16 on a CUDA GPU, one row after another in one process:

- :func:`~companion.kernels.flash_attention.flash_attention` forward and forward +
  backward against PyTorch's SDPA (``F.scaled_dot_product_attention``, causal; GQA by
  ``enable_gqa``; the sliding window as a boolean mask, which SDPA's flash kernel
  cannot take) and, forward only at the shortest length, the plain-PyTorch
  :func:`~companion.ops.tiled.tiled_attention`. FLOPs: 4·D per visible (query, key) pair
  (2·D for q·k, 2·D for p·v), 4·B·H·T·S·D for the full matrix; causal counts half of it,
  a window the pairs in its band; backward = 2.5 × forward (forward + backward 3.5 ×).
- :func:`~companion.ops.delta_rule_triton.chunk_gated_delta_rule_triton` against
  :func:`~companion.ops.delta_rule.chunk_gated_delta_rule`, forward, q and k
  L2-normalised in the kernel.
- :func:`~companion.kernels.rms_norm.add_rms_norm` against eager PyTorch (``x + r`` then
  :class:`~companion.layers.norms.RMSNorm`) and ``torch.compile`` of the same; GB/s
  counts the bytes the fused kernel must move: forward x, r in and y, h out (4·N·D
  elements), forward + backward 4·N·D more (dy, dh, h in, dx out).

``time/base``: a row's time over its baseline's (SDPA, the PyTorch chunk form, eager);
below 1 is faster. Timing: ``triton.testing.do_bench`` (warm-up, then the median).
Without CUDA it says so and stops (Triton's interpreter is for correctness, not speed);
``--tiny`` runs tiny shapes anyway (interpreted on a CPU) to check the table.
``--out-json PATH`` writes ``{"device", "dtype", "torch", "triton", "tiny", "rows"}``,
a row ``{"group", "case", "impl", "pass", "ms", "tflops", "gbps", "ratio", "baseline",
"note"}`` (null where not measured; the note says why).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from companion.kernels import interpreting, triton_available

from .common import median_seconds, positive_int

__all__ = ["ROW_KEYS", "add_parser", "bench_kernels", "format_kernels", "visible_pairs"]

ROW_KEYS = ("group", "case", "impl", "pass", "ms", "tflops", "gbps", "ratio",
            "baseline", "note")  # fmt: skip

FULL = {
    "attention": [  # (label, B, H, H_kv, T, D, window)
        ("causal", 4, 16, 16, 1024, 128, None),
        ("causal", 4, 16, 16, 4096, 128, None),
        ("GQA 16:4", 4, 16, 4, 4096, 128, None),
        ("window 1024", 4, 16, 16, 4096, 128, 1024),
    ],
    "tiled_max_t": 1024,
    "delta": (4, 4096, 16, 128, 64),  # B, T, H, D, chunk
    "norm": (8192, 4096),  # rows, D
}
TINY = {
    "attention": [
        ("causal", 1, 2, 2, 32, 16, None),
        ("GQA 2:1", 1, 2, 1, 32, 16, None),
        ("window 8", 1, 2, 2, 32, 16, 8),
    ],
    "tiled_max_t": 32,
    "delta": (1, 32, 2, 16, 16),
    "norm": (16, 32),
}


def visible_pairs(t: int, window: int | None) -> float:
    """(query, key) pairs a causal mask (T = S) lets through: T²/2 by the usual
    convention, or exactly T·W − W(W−1)/2 under a sliding window of W keys."""
    if window is None or window >= t:
        return t * t / 2
    return t * window - window * (window - 1) / 2


def _timer(device: torch.device, repeats: int) -> Callable[[Callable], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")
    return lambda fn: 1e3 * median_seconds(fn, device, repeats)


def _kernel(module: str, name: str) -> tuple[Callable | None, str | None]:
    """A kernel by name, or None and the reason it is missing."""
    try:
        mod = __import__(f"companion.{module}", fromlist=[name])
        return getattr(mod, name), None
    except (ImportError, AttributeError) as err:
        return None, f"not available ({type(err).__name__})"


def _row(group, case, impl, pas, ms=None, *, flops=None, nbytes=None, note=None):
    note, ms = (ms, None) if isinstance(ms, str) else (note, ms)
    ok = ms is not None and math.isfinite(ms)
    tflops = flops / ms / 1e9 if ok and flops else None
    gbps = nbytes / ms / 1e6 if ok and nbytes else None
    ms = ms if ok else None
    values = (group, case, impl, pas, ms, tflops, gbps, None, None, note)
    return dict(zip(ROW_KEYS, values, strict=True))


def _measure(time, fn: Callable, inputs, pas: str, params=()) -> float | str:
    """ms of ``fn(*inputs)`` (a tuple of outputs) under no_grad for ``"fwd"``; for
    ``"fwd+bwd"`` with a backward of fixed random gradients into inputs and params.
    A failure is returned as a short note, so the other rows still run."""
    try:
        if pas == "fwd":
            with torch.no_grad():
                return time(lambda: fn(*inputs))
        leaves = [t.detach().requires_grad_() for t in inputs]
        grads = [torch.randn_like(t) for t in fn(*leaves)]

        def run() -> None:
            torch.autograd.backward(fn(*leaves), grads)
            for t in (*leaves, *params):
                t.grad = None

        return time(run)
    except Exception as err:  # reported in the table instead
        return f"failed: {type(err).__name__}: {err}"[:60]


def _attention(sizes, dtype, device, time) -> list[dict]:
    from companion.ops.tiled import tiled_attention

    flash, missing = _kernel("kernels.flash_attention", "flash_attention")
    rows = []
    for label, b, h, hkv, t, d, window in sizes["attention"]:
        case = f"{label}, B={b} H={h} T={t} D={d}"
        fwd_flops = 4 * b * h * d * visible_pairs(t, window)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(b, h, t, d, generator=gen).to(device, dtype)
        k, v = (
            torch.randn(b, hkv, t, d, generator=gen).to(device, dtype) for _ in "kv"
        )
        mask = None
        if window is not None:
            i = torch.arange(t, device=device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        impls: dict[str, Callable | None] = {
            "sdpa": lambda q, k, v, m=mask, gqa=hkv != h: (
                F.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, is_causal=m is None, enable_gqa=gqa
                )
            ),
            "flash (triton)": None
            if flash is None
            else lambda q, k, v, w=window: flash(q, k, v, causal=True, window=w),
        }
        if t <= sizes["tiled_max_t"] and window is None and hkv == h:
            impls["tiled (torch)"] = lambda q, k, v: tiled_attention(
                q, k, v, causal=True
            )
        for pas, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            for impl, fn in impls.items():
                if pas == "fwd+bwd" and impl.startswith("tiled"):
                    continue
                if fn is None:
                    rows.append(_row("attention", case, impl, pas, note=missing))
                    continue
                ms = _measure(time, lambda *a, f=fn: (f(*a),), (q, k, v), pas)
                rows.append(
                    _row("attention", case, impl, pas, ms, flops=factor * fwd_flops)
                )
    return _ratios(rows, "sdpa")


def _delta(sizes, dtype, device, time) -> list[dict]:
    from companion.ops.delta_rule import chunk_gated_delta_rule

    kernel, missing = _kernel("ops.delta_rule_triton", "chunk_gated_delta_rule_triton")
    b, t, h, d, c = sizes["delta"]
    case = f"B={b} T={t} H={h} D={d} chunk={c}"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, generator=gen).to(device, dtype) for _ in "qkv")
    g = F.logsigmoid(torch.randn(b, t, h, generator=gen)).to(device, dtype)
    beta = torch.rand(b, t, h, generator=gen).to(device, dtype)
    rows, kw = [], {"chunk_size": c, "use_qk_l2norm_in_kernel": True}
    for impl, fn in (("chunk (torch)", chunk_gated_delta_rule), ("triton", kernel)):
        if fn is None:
            rows.append(_row("gated_delta", case, impl, "fwd", note=missing))
            continue
        ms = _measure(time, functools.partial(fn, **kw), (q, k, v, g, beta), "fwd")
        rows.append(_row("gated_delta", case, impl, "fwd", ms))
    return _ratios(rows, "chunk (torch)")


def _norm(sizes, dtype, device, time, compile_: bool) -> list[dict]:
    from companion.layers.norms import RMSNorm

    kernel, missing = _kernel("kernels.rms_norm", "add_rms_norm")
    n, d = sizes["norm"]
    case = f"N={n} D={d}"
    norm = RMSNorm(d).to(device, dtype)

    def eager(x, r):
        h = x + r
        return norm(h), h

    compiled = (torch.compile(eager), None) if compile_ else (None, "skipped")
    impls: dict[str, tuple[Callable | None, str | None]] = {
        "eager": (eager, None),
        "torch.compile": compiled,
        "fused (triton)": (
            None if kernel is None else lambda x, r: kernel(x, r, norm.weight),
            missing,
        ),
    }
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(n, d, generator=gen).to(device, dtype) for _ in "xr")
    size = x.element_size() * n * d
    rows = []
    for pas, nbytes in (("fwd", 4 * size), ("fwd+bwd", 8 * size)):
        for impl, (fn, note) in impls.items():
            if fn is None:
                rows.append(_row("add_rms_norm", case, impl, pas, note=note))
                continue
            ms = _measure(time, fn, (x, r), pas, params=(norm.weight,))
            rows.append(_row("add_rms_norm", case, impl, pas, ms, nbytes=nbytes))
    return _ratios(rows, "eager")


def _ratios(rows: list[dict], baseline: str) -> list[dict]:
    base = {(r["case"], r["pass"]): r["ms"] for r in rows if r["impl"] == baseline}
    for r in rows:
        b = base.get((r["case"], r["pass"]))
        r["baseline"] = baseline
        if r["ms"] is not None and b:
            r["ratio"] = r["ms"] / b
    return rows


def bench_kernels(
    device: torch.device, tiny: bool = False, repeats: int = 3, compile_: bool = True
) -> list[dict]:
    """Every row of the three groups, in bf16 (see the module docstring for the
    fields)."""
    sizes, dtype, time = TINY if tiny else FULL, torch.bfloat16, _timer(device, repeats)
    return (
        _attention(sizes, dtype, device, time)
        + _delta(sizes, dtype, device, time)
        + _norm(sizes, dtype, device, time, compile_)
    )


def _cell(value: float | None, spec: str, width: int) -> str:
    return f"{'—':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_kernels(rows: list[dict]) -> str:
    """A plain-text table of :func:`bench_kernels`'s rows, one block per group."""
    header = (
        f"{'case':<34} | {'impl':<14} | {'pass':<7} | {'ms':>8} {'TFLOP/s':>8} "
        f"{'GB/s':>7} | {'time/base':>9}"
    )
    lines = []  # a note (a failure, a missing kernel) takes a row's timing columns
    for group in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == group]
        lines += ["", f"{group} (base: {members[0]['baseline']})", header]
        lines.append("-" * len(header))
        for r in members:
            if r["ms"] is None:
                timing = r["note"] or "not measured"
            else:
                ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
                timing = (
                    f"{_cell(r['ms'], '.3f', 8)} {_cell(r['tflops'], '.1f', 8)} "
                    f"{_cell(r['gbps'], '.0f', 7)} | {ratio:>9}"
                )
            line = f"{r['case']:<34} | {r['impl']:<14} | {r['pass']:<7} | {timing}"
            lines.append(line.rstrip())
    return "\n".join(lines[1:])


def _run(args: argparse.Namespace) -> None:
    if not triton_available():
        print("the kernels benchmark needs Triton: pip install -e '.[gpu]' (Linux)")
        return
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print(
            "the kernels benchmark needs a CUDA GPU (Triton's interpreter is for "
            "correctness, not speed); --tiny checks the table on tiny shapes"
        )
        return
    if not cuda and not interpreting():
        # Triton reads TRITON_INTERPRET when it is imported (torch may import it
        # early), so the interpreted run is a fresh process with the switch on
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        argv = [sys.executable, "-m", "companion.bench", "kernels", "--tiny"]
        argv += ["--repeats", str(args.repeats)]
        argv += ["--out-json", args.out_json] if args.out_json else []
        raise SystemExit(subprocess.run(argv, env=env, check=False).returncode)
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    print(
        f"Triton kernels vs PyTorch on {name}, bf16, torch {torch.__version__}, triton "
        f"{triton.__version__}{', tiny shapes' if args.tiny else ''}"
    )
    rows = bench_kernels(device, args.tiny, args.repeats, compile_=not args.tiny)
    print(format_kernels(rows))
    if args.out_json:
        meta = {"device": name, "dtype": "bfloat16", "torch": torch.__version__}
        meta |= {"triton": triton.__version__, "tiny": args.tiny, "rows": rows}
        Path(args.out_json).write_text(json.dumps(meta, indent=1), encoding="utf-8")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``kernels`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser("kernels", help="Triton kernels vs SDPA / torch forms (CUDA)")
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes (interpreted without a GPU)"
    )
    p.add_argument("--out-json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed runs per cell off CUDA"
    )
    p.set_defaults(run=_run)
