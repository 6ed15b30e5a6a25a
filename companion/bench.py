"""Side-by-side micro-benchmarks for the book's chapters (chapters 02 and 08).

Run ``python -m companion.bench attention [--device cpu] [--lengths 256 512 1024 2048]
[--repeats N]`` or ``python -m companion.bench decode [--new-tokens 128] [--repeats 3]``.
Every row is measured in one process, on one machine, one after another, so read the
*ratios* (naive/SDPA time, tiled/SDPA time, naive/tiled memory), not the absolute numbers:
those depend on the hardware, the PyTorch build and what else is running.

``attention`` times the forward pass (median of ``--repeats`` after one warm-up) of the naive
reference, the plain-PyTorch tiled (FlashAttention-style) loop and PyTorch's fused SDPA, with
B=1, H=8, D=64, causal; fp32 on CPU, bf16 on accelerators that support it. Peak memory is
taken by :class:`companion.memory.PeakMemory` over one more forward pass.

``decode`` generates greedily with the real SmolLM2-135M-Instruct weights (batch 1, fp32,
CPU) through ``companion`` and through transformers' ``generate`` on the same weights,
alternating the two, and reports tokens/s, their ratio, and the fraction of the
memory-bandwidth bound: decoding one token reads every weight once, so it cannot beat
``copy bandwidth / weight bytes`` tokens/s, where the copy bandwidth is the memory traffic
(bytes read plus bytes written) per second of a large ``Tensor.copy_`` in the same run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .attention import naive_attention, sdpa_attention
from .device import default_device, default_dtype
from .flash import tiled_attention
from .memory import PeakMemory

__all__ = [
    "bench_attention",
    "bench_decode",
    "copy_bandwidth",
    "format_attention",
    "format_decode",
    "main",
]

ATTENTION_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "naive": lambda q, k, v: naive_attention(q, k, v, causal=True)[0],
    "tiled": lambda q, k, v: tiled_attention(q, k, v, causal=True),
    "sdpa": lambda q, k, v: sdpa_attention(q, k, v, causal=True),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_attention(
    lengths: Sequence[int], device: torch.device, repeats: int
) -> list[dict[str, float]]:
    """One row per length: ``{"T", "<impl>_ms", "<impl>_mib"}`` for naive, tiled and sdpa."""
    dtype = default_dtype(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in lengths:
        q, k, v = (torch.randn(1, 8, t, 64, generator=gen).to(device, dtype) for _ in range(3))
        row: dict[str, float] = {"T": t}
        with torch.no_grad():
            for name, impl in ATTENTION_IMPLS.items():
                run = functools.partial(impl, q, k, v)
                row[f"{name}_ms"] = 1e3 * _median_seconds(run, device, repeats)
                with PeakMemory(device) as pm:
                    run()
                row[f"{name}_mib"] = pm.peak_mib
        rows.append(row)
    return rows


def format_attention(rows: list[dict[str, float]]) -> str:
    """A plain-text table of :func:`bench_attention`'s rows, with the three ratios."""
    header = (
        f"{'T':>6} | {'naive ms':>9} {'tiled ms':>9} {'sdpa ms':>9} | "
        f"{'naive MiB':>9} {'tiled MiB':>9} {'sdpa MiB':>9} | "
        f"{'naive/sdpa time':>15} {'tiled/sdpa time':>15} {'naive/tiled mem':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{int(r['T']):>6} | "
            f"{r['naive_ms']:>9.2f} {r['tiled_ms']:>9.2f} {r['sdpa_ms']:>9.2f} | "
            f"{r['naive_mib']:>9.2f} {r['tiled_mib']:>9.2f} {r['sdpa_mib']:>9.2f} | "
            f"{r['naive_ms'] / r['sdpa_ms']:>14.1f}x {r['tiled_ms'] / r['sdpa_ms']:>14.1f}x "
            f"{r['naive_mib'] / r['tiled_mib']:>14.1f}x"
        )
    return "\n".join(lines)


def _attention_command(args: argparse.Namespace) -> None:
    device = default_device(args.device)
    print(
        f"attention forward, B=1 H=8 D=64 causal, {default_dtype(device)} on {device.type}, "
        f"median of {args.repeats} after a warm-up (torch {torch.__version__})"
    )
    print(format_attention(bench_attention(args.lengths, device, args.repeats)))


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory traffic per second of one large tensor copy on the CPU (median of ``repeats``).

    A copy reads ``nbytes`` and writes ``nbytes``: both count, as in STREAM's "copy".
    """
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), torch.device("cpu"), repeats)


def bench_decode(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    input_ids: torch.Tensor,
    new_tokens: int,
    repeats: int,
) -> dict[str, float]:
    """Greedy decoding speed of ``model.generate`` and ``reference.generate`` (transformers),
    alternated ``repeats`` times; medians, plus how many leading tokens both agree on."""
    ours, theirs = [], []
    out_ours = out_theirs = None
    reference.generation_config.eos_token_id = None  # both run the full length, no early stop
    for _ in range(repeats + 1):  # the first round warms both up and is not counted
        start = time.perf_counter()
        out_ours = model.generate(input_ids, new_tokens)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            out_theirs = reference.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
        theirs.append(time.perf_counter() - start)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth()
    ours_tps = new_tokens / statistics.median(ours[1:])
    theirs_tps = new_tokens / statistics.median(theirs[1:])
    bound = bandwidth / weight_bytes
    return {
        "companion_tps": ours_tps,
        "transformers_tps": theirs_tps,
        "ratio": ours_tps / theirs_tps,
        "bandwidth_gbs": bandwidth / 1e9,
        "weight_mb": weight_bytes / 1e6,
        "bound_tps": bound,
        "companion_of_bound": ours_tps / bound,
        "transformers_of_bound": theirs_tps / bound,
        "agreeing_tokens": float(_agreeing(out_ours, out_theirs, input_ids.shape[1])),
        "new_tokens": float(new_tokens),
    }


def _agreeing(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    """How many generated tokens agree before the first difference."""
    same = (a[0, start:] == b[0, start:]).tolist()
    return same.index(False) if False in same else len(same)


def format_decode(r: dict[str, float]) -> str:
    """The decode results as a small table."""
    return "\n".join(
        [
            f"{'':<14}{'tokens/s':>10}{'of bound':>10}",
            f"{'companion':<14}{r['companion_tps']:>10.1f}{r['companion_of_bound']:>10.0%}",
            f"{'transformers':<14}{r['transformers_tps']:>10.1f}{r['transformers_of_bound']:>10.0%}",
            f"ratio companion/transformers: {r['ratio']:.2f}x",
            f"bound: {r['bandwidth_gbs']:.1f} GB/s copy bandwidth / {r['weight_mb']:.0f} MB of "
            f"weights = {r['bound_tps']:.1f} tokens/s",
            f"greedy tokens identical for the first {int(r['agreeing_tokens'])} of "
            f"{int(r['new_tokens'])} (after that, near-ties in fp32 may break differently)",
        ]
    )


def _decode_command(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from .weights import load_smollm2, smollm2_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    path = smollm2_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}])
    ids = torch.tensor([tok.encode(prompt)])
    print(
        f"decode: SmolLM2-135M-Instruct, batch 1, fp32, cpu, {ids.shape[1]}-token prompt, "
        f"{args.new_tokens} new tokens, median of {args.repeats} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)"
    )
    print(format_decode(bench_decode(model, reference, ids, args.new_tokens, args.repeats)))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: ``python -m companion.bench <benchmark> [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m companion.bench",
        description="Side-by-side micro-benchmarks: read the ratios, not the absolute numbers.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="benchmark", required=True)
    att = sub.add_parser("attention", help="naive vs tiled vs SDPA attention: time and memory")
    att.add_argument("--device", choices=("cuda", "mps", "cpu"), help="default: the best present")
    att.add_argument(
        "--lengths", type=_positive_int, nargs="+", default=[256, 512, 1024, 2048], help="T = S"
    )
    att.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per cell")
    att.set_defaults(run=_attention_command)
    dec = sub.add_parser("decode", help="SmolLM2 greedy decoding: companion vs transformers")
    dec.add_argument("--new-tokens", type=_positive_int, default=128)
    dec.add_argument("--repeats", type=_positive_int, default=3, help="timed rounds per side")
    dec.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's)")
    dec.set_defaults(run=_decode_command)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
