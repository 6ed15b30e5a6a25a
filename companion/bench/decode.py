"""Greedy decoding with real weights (chapter 08): ``python -m companion.bench decode``.

Generates greedily with the real SmolLM2-135M-Instruct weights (batch 1, fp32, CPU)
three ways, alternating them: ``companion``'s cached decoding (``DecoderLM.generate``),
the same with its decode step compiled (``generate(..., compile=True)``: the model's own
blocks through ``torch.compile``; ``--no-compile`` leaves it out), and transformers'
``generate`` on the same weights. It reports tokens/s, the ratios, and the fraction of
the memory-bandwidth bound: decoding one token reads every weight once, so it cannot
beat ``copy bandwidth / weight bytes`` tokens/s, where the copy bandwidth is the memory
traffic (bytes read plus bytes written) per second of a large ``Tensor.copy_``. The
table also gives the *matmul floor* (:func:`matmul_floor`): the time of the weights'
matrix-vector products alone, which bounds every implementation from below on this
machine. Both are measured in every round, between the decoders, and the best round is
kept: on a shared machine the bandwidth drifts, and the bound must not be the low one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import median_seconds, positive_int

__all__ = [
    "add_parser",
    "bench_decode",
    "copy_bandwidth",
    "format_decode",
    "matmul_floor",
]


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory traffic per second of one large tensor copy on the CPU (median of
    ``repeats``).

    A copy reads ``nbytes`` and writes ``nbytes``: both count, as in STREAM's "copy".
    """
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return (
        2
        * nbytes
        / median_seconds(lambda: dst.copy_(src), torch.device("cpu"), repeats)
    )


def matmul_floor(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds per token of the model's matrix-vector products alone: one ``(1, in)``
    row through every ``nn.Linear`` weight in turn, nothing else. No decoder built from
    these weights can be faster on this machine, whatever its framework."""
    weights = [
        m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    rows = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]

    def products() -> None:
        for w, x in zip(weights, rows, strict=True):
            torch.nn.functional.linear(x, w)

    return median_seconds(products, torch.device("cpu"), repeats)


def bench_decode(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    input_ids: torch.Tensor,
    new_tokens: int,
    repeats: int,
    compiled: bool = True,
) -> dict[str, float]:
    """Greedy decoding speed of ``model.generate`` and ``reference.generate``
    (transformers), and with ``compiled`` of ``model.generate(..., compile=True)``,
    alternated ``repeats`` times; medians, plus how many leading tokens agree. The first
    round (warm-up, compilation) is not counted. The copy bandwidth and the matmul floor
    are the best of all rounds."""
    ours, theirs, fixed, bandwidths, floors = [], [], [], [], []
    out_ours = out_theirs = out_fixed = None
    reference.generation_config.eos_token_id = (
        None  # both run the full length, no early stop
    )
    for _ in range(repeats + 1):  # the first round warms both up and is not counted
        bandwidths.append(copy_bandwidth())
        floors.append(matmul_floor(model))
        start = time.perf_counter()
        out_ours = model.generate(input_ids, new_tokens)
        ours.append(time.perf_counter() - start)
        if compiled:
            start = time.perf_counter()
            out_fixed = model.generate(input_ids, new_tokens, compile=True)
            fixed.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            out_theirs = reference.generate(
                input_ids, max_new_tokens=new_tokens, do_sample=False
            )
        theirs.append(time.perf_counter() - start)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = max(bandwidths)
    ours_tps = new_tokens / statistics.median(ours[1:])
    theirs_tps = new_tokens / statistics.median(theirs[1:])
    bound = bandwidth / weight_bytes
    extra = {}
    if compiled:
        fixed_tps = new_tokens / statistics.median(fixed[1:])
        extra = {
            "compiled_tps": fixed_tps,
            "compiled_ratio": fixed_tps / theirs_tps,
            "compiled_of_bound": fixed_tps / bound,
            "compiled_agreeing_tokens": float(
                _agreeing(out_fixed, out_ours, input_ids.shape[1])
            ),
        }
    return extra | {
        "companion_tps": ours_tps,
        "transformers_tps": theirs_tps,
        "ratio": ours_tps / theirs_tps,
        "bandwidth_gbs": bandwidth / 1e9,
        "weight_mb": weight_bytes / 1e6,
        "bound_tps": bound,
        "matmul_floor_tps": 1.0 / min(floors),
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
    compiled = []
    if "compiled_tps" in r:
        compiled = [
            f"{'compiled':<14}{r['compiled_tps']:>10.1f}{r['compiled_of_bound']:>10.0%}"
            "   (generate(..., compile=True): the model's own blocks, compiled)",
        ]
    ratios = [f"ratio companion/transformers: {r['ratio']:.2f}x"]
    if "compiled_tps" in r:
        ratios.append(
            f"ratio compiled/transformers: {r['compiled_ratio']:.2f}x (its greedy tokens equal "
            f"companion's for the first {int(r['compiled_agreeing_tokens'])} of "
            f"{int(r['new_tokens'])})"
        )
    return "\n".join(
        [
            f"{'':<14}{'tokens/s':>10}{'of bound':>10}",
            f"{'companion':<14}{r['companion_tps']:>10.1f}{r['companion_of_bound']:>10.0%}",
            *compiled,
            f"{'transformers':<14}{r['transformers_tps']:>10.1f}{r['transformers_of_bound']:>10.0%}",
            *ratios,
            f"bound: {r['bandwidth_gbs']:.1f} GB/s copy bandwidth / {r['weight_mb']:.0f} MB of "
            f"weights = {r['bound_tps']:.1f} tokens/s",
            f"matmul floor: the same weights' matrix-vector products alone run at "
            f"{r['matmul_floor_tps']:.1f} tokens/s; of it, companion reaches "
            f"{r['companion_tps'] / r['matmul_floor_tps']:.0%}, "
            + (
                f"compiled {r['compiled_tps'] / r['matmul_floor_tps']:.0%}, "
                if "compiled_tps" in r
                else ""
            )
            + f"transformers {r['transformers_tps'] / r['matmul_floor_tps']:.0%}",
            f"greedy tokens identical for the first {int(r['agreeing_tokens'])} of "
            f"{int(r['new_tokens'])} (after that, near-ties in fp32 may break differently)",
        ]
    )


def _decode_command(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from companion.checkpoints.smollm2 import load_smollm2, smollm2_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    path = smollm2_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story."}]
    )
    ids = torch.tensor([tok.encode(prompt)])
    print(
        f"decode: SmolLM2-135M-Instruct, batch 1, fp32, cpu, {ids.shape[1]}-token prompt, "
        f"{args.new_tokens} new tokens, median of {args.repeats} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)"
    )
    r = bench_decode(
        model, reference, ids, args.new_tokens, args.repeats, not args.no_compile
    )
    print(format_decode(r))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``decode`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "decode", help="SmolLM2 greedy decoding: companion vs transformers"
    )
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed rounds per side"
    )
    p.add_argument(
        "--threads", type=positive_int, help="torch threads (default: torch's)"
    )
    p.add_argument(
        "--no-compile", action="store_true", help="leave out the compiled decode step"
    )
    p.set_defaults(run=_decode_command)
