"""Greedy decoding with real weights (chapter 08): ``python -m companion.bench decode``.

Generates greedily with the real SmolLM2-135M-Instruct weights (batch 1, fp32, CPU)
three ways, alternating them: ``companion``'s cached decoding (``DecoderLM.generate``),
the same with its decode step compiled (``generate(..., compile=True)``: the model's own
blocks through ``torch.compile``; ``--no-compile`` leaves it out), and transformers'
``generate`` on the same weights. It reports tokens/s, the ratios, and the fraction of
the memory-bandwidth bound: decoding one token reads every weight once, so it cannot
beat ``copy bandwidth / weight bytes`` tokens/s, where the copy bandwidth is the memory
traffic (bytes read plus bytes written) per second of a large ``Tensor.copy_``. The
table also gives the *matmul floor* (:func:`~companion.bench.floors.matmul_floor`): the
time of the weights' matrix-vector products alone as ``F.linear`` calls (the BLAS
kernel's speed for one row, the floor of every eager loop), and on the CPU the compiled
step's own floor, the same products compiled in their decode form
(:mod:`companion.ops.matvec`). All three are measured in every round, between the
decoders, and the best round is kept: on a shared machine the bandwidth drifts, and the
bound must not be the low one.

On a GPU, ``--device cuda --dtype bf16`` runs the same comparison there, and
``--preset NAME`` decodes with random weights of a preset of
:mod:`companion.models.presets` instead (``llama3-8b``: 16 GB of weights in bf16;
no transformers side, random prompt ids): eager and compiled tokens/s against the bound
from the device's own copy bandwidth (a 1 GiB copy in its memory, HBM on a data-centre
GPU). The weight bytes count every parameter, the embedding table too, though a step
reads one row of it, so the bound is slightly low for untied embeddings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from .common import median_seconds, positive_int, sync
from .floors import copy_bandwidth, decode_form_products, matmul_floor

__all__ = ["add_parser", "bench_decode", "format_decode"]


def bench_decode(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    input_ids: torch.Tensor,
    new_tokens: int,
    repeats: int,
    compiled: bool = True,
) -> dict[str, float]:
    """Greedy decoding speed of ``model.generate`` and ``reference.generate``
    (transformers; ``None`` leaves it out), and with ``compiled`` of
    ``model.generate(..., compile=True)``, alternated ``repeats`` times on the device of
    ``input_ids``; medians, plus how many leading tokens agree. The first round
    (warm-up, compilation) is not counted. The copy bandwidth and the floors are the
    best of all rounds."""
    device = input_ids.device
    ours, theirs, fixed, bandwidths, floors, fast = [], [], [], [], [], []
    # the compiled step's own floor: its products in their decode form (CPU only)
    products = (
        decode_form_products(model) if compiled and device.type == "cpu" else None
    )
    out_ours = out_theirs = out_fixed = None
    if reference is not None:  # both run the full length, no early stop
        reference.generation_config.eos_token_id = None

    def timed(run: Callable[[], torch.Tensor], times: list[float]) -> torch.Tensor:
        start = time.perf_counter()
        out = run()
        sync(device)
        times.append(time.perf_counter() - start)
        return out

    for _ in range(repeats + 1):  # the first round warms both up and is not counted
        nbytes = 256 * 2**20 if device.type == "cpu" else 2**30
        bandwidths.append(copy_bandwidth(nbytes, device=device))
        floors.append(matmul_floor(model))
        if products is not None:
            fast.append(median_seconds(products, device, 5))
        out_ours = timed(lambda: model.generate(input_ids, new_tokens), ours)
        if compiled:
            out_fixed = timed(
                lambda: model.generate(input_ids, new_tokens, compile=True), fixed
            )
        if reference is not None:
            with torch.no_grad():
                out_theirs = timed(
                    lambda: reference.generate(
                        input_ids, max_new_tokens=new_tokens, do_sample=False
                    ),
                    theirs,
                )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = max(bandwidths)
    ours_tps = new_tokens / statistics.median(ours[1:])
    bound = bandwidth / weight_bytes
    extra = {}
    if fast:
        extra["decode_floor_tps"] = 1.0 / min(fast)
    if compiled:
        fixed_tps = new_tokens / statistics.median(fixed[1:])
        extra |= {
            "compiled_tps": fixed_tps,
            "compiled_agreeing_tokens": float(
                _agreeing(out_fixed, out_ours, input_ids.shape[1])
            ),
        }
    if reference is not None:
        theirs_tps = new_tokens / statistics.median(theirs[1:])
        extra |= {
            "transformers_tps": theirs_tps,
            "ratio": ours_tps / theirs_tps,
            **(
                {"compiled_ratio": extra["compiled_tps"] / theirs_tps}
                if compiled
                else {}
            ),
            "agreeing_tokens": float(
                _agreeing(out_ours, out_theirs, input_ids.shape[1])
            ),
        }
    return extra | {
        "companion_tps": ours_tps,
        "bandwidth_gbs": bandwidth / 1e9,
        "weight_mb": weight_bytes / 1e6,
        "bound_tps": bound,
        "matmul_floor_tps": 1.0 / min(floors),
        "new_tokens": float(new_tokens),
    }


def _agreeing(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    """How many generated tokens agree before the first difference."""
    same = (a[0, start:] == b[0, start:]).tolist()
    return same.index(False) if False in same else len(same)


def format_decode(r: dict[str, float]) -> str:
    """The decode results as a small table: each loop against the bound and against
    the floor of the products it runs (the compiled step's: their decode form)."""
    floor = r["matmul_floor_tps"]
    fast = r.get("decode_floor_tps", floor)
    hf = "transformers_tps" in r
    rows = [("companion" if hf else "eager", r["companion_tps"], floor)]
    if "compiled_tps" in r:
        rows.append(("compiled", r["compiled_tps"], fast))
    if hf:
        rows.append(("transformers", r["transformers_tps"], floor))
    lines = [f"{'':<14}{'tokens/s':>10}{'of bound':>10}{'of floor':>10}"]
    lines += [
        f"{n:<14}{t:>10.1f}{t / r['bound_tps']:>10.0%}{t / f:>10.0%}"
        for n, t, f in rows
    ]
    if hf:
        lines.append(f"ratio companion/transformers: {r['ratio']:.2f}x")
    if "compiled_tps" in r:
        lines.append(
            (f"ratio compiled/transformers: {r['compiled_ratio']:.2f}x; " if hf else "")
            + f"compiled tokens equal eager's for the first "
            f"{int(r['compiled_agreeing_tokens'])} of {int(r['new_tokens'])}"
        )
    lines += [
        f"bound: {r['bandwidth_gbs']:.1f} GB/s copy bandwidth / {r['weight_mb']:.0f} MB of "
        f"weights = {r['bound_tps']:.1f} tokens/s",
        f"floor: the weights' matrix-vector products alone, as F.linear calls: "
        f"{floor:.1f} tokens/s"
        + (
            f"; compiled in their decode form (companion.ops.matvec), the compiled "
            f"row's floor: {fast:.1f} tokens/s"
            if "decode_floor_tps" in r
            else ""
        ),
    ]
    if hf:
        lines.append(
            f"greedy tokens identical for the first {int(r['agreeing_tokens'])} of "
            f"{int(r['new_tokens'])} (after that, near-ties in fp32 may break differently)"
        )
    return "\n".join(lines)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _preset_name(text: str) -> str:
    """An argparse type: a name of :data:`companion.models.presets.PRESETS`."""
    from companion.models.presets import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(
            f"unknown preset {text!r}; valid names: {', '.join(sorted(PRESETS))}"
        )
    return text


def _random_model(
    name: str, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """A preset's model with random weights, made on ``device`` then cast."""
    from companion.models.decoder import DecoderLM
    from companion.models.presets import preset

    torch.manual_seed(0)
    with device:
        model = DecoderLM(preset(name))
    return model.to(dtype).eval()


def _decode_command(args: argparse.Namespace) -> None:
    from companion.device import default_device

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = default_device(args.device)
    except RuntimeError as err:
        raise SystemExit(f"--device: {err}") from None
    dtype_name = args.dtype or ("fp32" if args.preset is None else "bf16")
    if args.preset is not None:
        model, reference = _random_model(args.preset, device, DTYPES[dtype_name]), None
        ids = torch.randint(model.cfg.vocab_size, (1, 32), device=device)
        name = f"{args.preset} (random weights)"
    else:
        from transformers import AutoModelForCausalLM

        from companion.checkpoints.smollm2 import load_smollm2, smollm2_path

        model, tok = load_smollm2()
        path = smollm2_path()
        reference = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        model, reference = (
            m.to(device, DTYPES[dtype_name]) for m in (model, reference)
        )
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Tell me a long story."}]
        )
        ids = torch.tensor([tok.encode(prompt)], device=device)
        name = "SmolLM2-135M-Instruct"
    print(
        f"decode: {name}, batch 1, {dtype_name}, {device.type}, "
        f"{ids.shape[1]}-token prompt, {args.new_tokens} new tokens, median of "
        f"{args.repeats} (torch {torch.__version__}, {torch.get_num_threads()} threads)"
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
    p.add_argument(
        "--device",
        choices=("cuda", "mps", "cpu"),
        help="default: cuda, else mps, else cpu",
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), help="default: fp32; bf16 with --preset"
    )
    p.add_argument(
        "--preset",
        type=_preset_name,
        help="random weights of this companion.models.presets model, no transformers",
    )
    p.set_defaults(run=_decode_command)
