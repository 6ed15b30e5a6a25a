"""Decoding with fewer bytes per weight (chapter 16): ``python -m companion.bench
weights``.

SmolLM2-135M-Instruct (batch 1, CPU) decoded greedily with its weights in three forms:
fp32 (the file dequantised), int8 with one scale per output row
(:func:`~companion.layers.weight_quant.quantize_linears`), and the file's own Q4_1/Q8_0
blocks (``load_smollm2(blocks=True)``), each through the compiled decode step, with
transformers' fp32 ``generate`` on the same weights beside them, all alternated in every
round. Per form it reports tokens/s, the bytes its matrix products read per token, the
bound those bytes allow (copy bandwidth / bytes), the *products floor* (its weights'
matrix-vector products alone, compiled, per token), greedy agreement with the fp32
model over ``--new-tokens`` tokens from Shakespeare prompts, and the change of the
teacher-forced loss on Shakespeare windows (mean over windows, paired 95% interval).
SmolLM2 may have seen Shakespeare in pre-training: the loss measures the change on real
text, not generalisation. Run it on the native path (without ``companion.numerics``'
variables): the compiled products are generated for the CPU's widest vector ISA.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import Tensor, nn

from companion.layers.weight_quant import (
    quantize_linears,
    stored_weight_bytes,
)

from .common import positive_int
from .floors import copy_bandwidth, products_seconds
from .kvquant import cached_nll, leading_agreement

__all__ = [
    "add_parser",
    "bench_weights",
    "format_weights",
]


def bench_weights(
    models: dict[str, nn.Module],
    reference: nn.Module | None,
    prompts: Tensor,
    windows: Tensor,
    new_tokens: int,
    repeats: int,
) -> dict[str, dict[str, object]]:
    """Per form of ``models`` (the first is the fp32 baseline): compiled greedy
    tokens/s on ``prompts[:1]`` (median of ``repeats`` rounds after a warm-up round,
    the forms and ``reference`` alternated), products floor, bytes, bound, greedy
    agreement with the baseline on every prompt ``(P, T)``, and the per-window loss
    on ``windows (W, L)`` (32-token prompt, the rest teacher-forced)."""
    from companion.analysis.seeds import difference

    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in [*names, "transformers"]}
    if reference is not None:
        reference.generation_config.eos_token_id = None
    bandwidth = 0.0
    for _ in range(repeats + 1):
        bandwidth = max(bandwidth, copy_bandwidth())
        for name, model in models.items():
            start = time.perf_counter()
            model.generate(prompts[:1], new_tokens, compile=True)
            times[name].append(time.perf_counter() - start)
        if reference is not None:
            start = time.perf_counter()
            with torch.no_grad():
                reference.generate(
                    prompts[:1], max_new_tokens=new_tokens, do_sample=False
                )
            times["transformers"].append(time.perf_counter() - start)
    out: dict[str, dict[str, object]] = {}
    base_tokens = base_nll = None
    for name, model in models.items():
        t = prompts.shape[1]
        tokens = torch.cat(
            [model.generate(p[None], new_tokens, compile=True)[:, t:] for p in prompts]
        )
        nll = cached_nll(model, windows, 32).mean(dim=1).tolist()
        if base_tokens is None:
            base_tokens, base_nll = tokens, nll
        nbytes = stored_weight_bytes(model)
        out[name] = {
            "tps": new_tokens / statistics.median(times[name][1:]),
            "mb": nbytes / 1e6,
            "bound_tps": bandwidth / nbytes,
            "floor_tps": 1.0 / products_seconds(model),
            "agree": leading_agreement(tokens, base_tokens),
            "loss": statistics.mean(nll),
            "dloss": difference(nll, base_nll).format(4) if name != names[0] else "",
        }
    if reference is not None:
        out["transformers"] = {
            "tps": new_tokens / statistics.median(times["transformers"][1:])
        }
    out["_run"] = {"bandwidth_gbs": bandwidth / 1e9, "new_tokens": new_tokens}
    return out


def format_weights(r: dict[str, dict[str, object]]) -> str:
    """The results as a table, ratios against transformers fp32 where it ran."""
    peer = r.get("transformers", {}).get("tps")
    head = f"{'weights':<10}{'MB':>7}{'tok/s':>8}{'vs HF':>7}{'bound':>8}{'floor':>8}"
    lines = [head + "  greedy = fp32 (tokens, per prompt)   loss, change vs fp32"]
    for name, row in r.items():
        if name.startswith("_") or name == "transformers":
            continue
        ratio = f"{row['tps'] / peer:>6.2f}x" if peer else f"{'':>7}"
        lines.append(
            f"{name:<10}{row['mb']:>7.0f}{row['tps']:>8.1f}{ratio}"
            f"{row['bound_tps']:>8.1f}{row['floor_tps']:>8.1f}  "
            f"{', '.join(map(str, row['agree'])):<35} {row['loss']:.4f} {row['dloss']}"
        )
    if peer:
        lines.append(f"{'transformers fp32':<17}{peer:>8.1f}")
    run = r["_run"]
    lines.append(
        f"bound: {run['bandwidth_gbs']:.1f} GB/s copy bandwidth / MB; floor: the form's "
        f"matrix products alone, compiled; greedy over {run['new_tokens']} tokens"
    )
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> None:
    from companion.checkpoints.smollm2 import load_smollm2, smollm2_path
    from companion.tasks.text import load_shakespeare

    if args.threads:
        torch.set_num_threads(args.threads)
    fp32, tok = load_smollm2()
    models = {"fp32": fp32, "int8": quantize_linears(copy.deepcopy(fp32))}
    models["gguf q4_1"] = load_smollm2(blocks=True)[0]
    reference = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        path = smollm2_path()
        reference = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    text = load_shakespeare()
    starts = (100_000, 150_000, 250_000, 350_000)
    prompts = torch.tensor([tok.encode(text[s : s + 400])[:32] for s in starts])
    tokens = tok.encode(text[300_000:312_000])
    windows = torch.tensor(tokens[: 4 * 256]).view(4, 256)
    print(
        f"weights: SmolLM2-135M-Instruct, batch 1, cpu, compiled decode step, "
        f"{args.new_tokens} new tokens, median of {args.repeats} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    r = bench_weights(
        models, reference, prompts, windows, args.new_tokens, args.repeats
    )
    print(format_weights(r))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``weights`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "weights", help="SmolLM2 decoding with fp32, int8 and GGUF Q4_1 weights"
    )
    p.add_argument("--new-tokens", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds")
    p.add_argument("--threads", type=positive_int, help="torch threads")
    p.add_argument(
        "--no-transformers", action="store_true", help="leave out transformers fp32"
    )
    p.set_defaults(run=_command)
