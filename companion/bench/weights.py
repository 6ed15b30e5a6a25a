"""Decoding with fewer bytes per weight (chapter 16): ``python -m companion.bench
weights``.

SmolLM2-135M-Instruct (batch 1, CPU) decoded greedily with its weights in three forms:
fp32 (the file dequantised), int8 with one scale per output row
(:func:`~companion.layers.weight_quant.quantize_linears`), and the file's own Q4_1/Q8_0
blocks (``load_smollm2(blocks=True)``), each through the compiled decode step, with
transformers' fp32 ``generate`` on the same weights beside them and, where
``llama-cpp-python`` is installed, llama.cpp on the same Q4_1 file, all alternated in
every round. Per form it reports tokens/s, the bytes its matrix products read per
token, the bound those bytes allow (copy bandwidth / bytes), the *products floor* (its
weights' matrix-vector products alone, compiled, per token), greedy agreement with the
fp32 model over ``--new-tokens`` tokens from Shakespeare prompts (the peers' too), and
the change of the teacher-forced loss on Shakespeare windows (mean over windows, paired
95% interval).
SmolLM2 may have seen Shakespeare in pre-training: the loss measures the change on real
text, not generalisation. Run it on the native path (without ``companion.numerics``'
variables): the compiled products are generated for the CPU's widest vector ISA.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.layers.weight_quant import (
    quantize_linears,
    stored_weight_bytes,
)

from .common import positive_int
from .floors import copy_bandwidth, products_seconds
from .kvquant import cached_nll, leading_agreement

__all__ = ["add_parser", "bench_weights", "format_weights"]

HF = "transformers fp32"  # the peer the ratios are taken against


def bench_weights(
    models: dict[str, nn.Module],
    peers: dict[str, Callable[[Tensor], Tensor]],
    prompts: Tensor,
    windows: Tensor,
    new_tokens: int,
    repeats: int,
) -> dict[str, dict[str, object]]:
    """Per form of ``models`` (the first is the fp32 baseline): compiled greedy
    tokens/s on ``prompts[:1]`` (median of ``repeats`` rounds after a warm-up round,
    the forms and ``peers`` alternated), products floor, bytes, bound, greedy agreement
    with the baseline on every prompt ``(P, T)``, and the per-window loss on ``windows
    (W, L)`` (32-token prompt, the rest teacher-forced). A peer maps a prompt ``(1, T)``
    to its ``new_tokens`` greedy ids ``(1, new)``: tokens/s and agreement only."""
    from companion.analysis.seeds import difference

    names = list(models)
    runs = {
        **{n: lambda m=m: m.generate(prompts[:1], new_tokens, compile=True)
           for n, m in models.items()},
        **{n: lambda f=f: f(prompts[:1]) for n, f in peers.items()},
    }  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in runs}
    bandwidth = 0.0
    for _ in range(repeats + 1):
        bandwidth = max(bandwidth, copy_bandwidth())
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    out: dict[str, dict[str, object]] = {}
    base_tokens = base_nll = None
    t = prompts.shape[1]
    for name, model in models.items():
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
    for name, generate in peers.items():
        tokens = torch.cat([generate(p[None]) for p in prompts])
        out[name] = {
            "tps": new_tokens / statistics.median(times[name][1:]),
            "agree": leading_agreement(tokens, base_tokens),
        }
    out["_run"] = {"bandwidth_gbs": bandwidth / 1e9, "new_tokens": new_tokens}
    return out


def format_weights(r: dict[str, dict[str, object]]) -> str:
    """The results as a table, ratios against transformers fp32 where it ran; a peer's
    row has no bytes, bound, floor or loss."""
    peer = r.get(HF, {}).get("tps")
    head = f"{'weights':<17}{'MB':>5}{'tok/s':>8}{'vs HF':>7}{'bound':>8}{'floor':>8}"
    lines = [head + "  greedy = fp32 (tokens, per prompt)   loss, change vs fp32"]
    for name, row in r.items():
        if name.startswith("_"):
            continue
        ratio = f"{row['tps'] / peer:>6.2f}x" if peer else f"{'':>7}"
        cells = f"{'':>5}{row['tps']:>8.1f}{ratio}{'':>16}"
        if "mb" in row:
            cells = (
                f"{row['mb']:>5.0f}{row['tps']:>8.1f}{ratio}"
                f"{row['bound_tps']:>8.1f}{row['floor_tps']:>8.1f}"
            )
        agree = ", ".join(map(str, row["agree"]))
        loss = f" {row['loss']:.4f} {row['dloss']}" if "loss" in row else ""
        lines.append(f"{name:<17}{cells}  {agree:<35}{loss}")
    run = r["_run"]
    lines.append(
        f"bound: {run['bandwidth_gbs']:.1f} GB/s copy bandwidth / MB; floor: the form's "
        f"matrix products alone, compiled; greedy over {run['new_tokens']} tokens"
    )
    return "\n".join(lines)


def _transformers(new_tokens: int) -> Callable[[Tensor], Tensor]:
    """transformers' fp32 ``generate`` on the same file, as a peer."""
    from transformers import AutoModelForCausalLM

    from companion.checkpoints.smollm2 import smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # the full length, no early stop

    def generate(ids: Tensor) -> Tensor:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        return out[:, ids.shape[1] :]

    return generate


def _llama_cpp(new_tokens: int) -> Callable[[Tensor], Tensor] | None:
    """llama.cpp (``llama-cpp-python``, where installed) greedy on the same Q4_1
    file, with torch's thread count, as a peer; None where it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    from companion.checkpoints.smollm2 import smollm2_path

    llm = Llama(
        model_path=str(smollm2_path()),
        n_ctx=512,
        n_threads=torch.get_num_threads(),
        verbose=False,
    )

    def generate(ids: Tensor) -> Tensor:
        new = []
        for token in llm.generate(ids[0].tolist(), temp=0.0, reset=True):
            new.append(token)
            if len(new) == new_tokens:
                break
        return torch.tensor([new])

    return generate


def _command(args: argparse.Namespace) -> None:
    from companion.checkpoints.smollm2 import load_smollm2
    from companion.tasks.text import load_shakespeare

    if args.threads:
        torch.set_num_threads(args.threads)
    fp32, tok = load_smollm2()
    models = {"fp32": fp32, "int8": quantize_linears(copy.deepcopy(fp32))}
    models["gguf q4_1"] = load_smollm2(blocks=True)[0]
    peers = {}
    if not args.no_transformers:
        peers[HF] = _transformers(args.new_tokens)
    llama_cpp = _llama_cpp(args.new_tokens)
    if llama_cpp is not None:
        peers["llama.cpp q4_1"] = llama_cpp
    text = load_shakespeare()
    starts = (100_000, 150_000, 250_000, 350_000)
    prompts = torch.tensor([tok.encode(text[s : s + 400])[:32] for s in starts])
    tokens = tok.encode(text[300_000:312_000])
    windows = torch.tensor(tokens[: 4 * 256]).view(4, 256)
    print(
        f"weights: SmolLM2-135M-Instruct, batch 1, cpu, compiled decode step, "
        f"{args.new_tokens} new tokens, median of {args.repeats} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
        + ("" if llama_cpp else "; llama-cpp-python not installed")
    )
    r = bench_weights(models, peers, prompts, windows, args.new_tokens, args.repeats)
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
