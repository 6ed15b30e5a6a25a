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

__all__ = [
    "add_parser",
    "bench_decode",
    "copy_bandwidth",
    "format_decode",
    "matmul_floor",
]


def copy_bandwidth(
    nbytes: int = 256 * 2**20,
    repeats: int = 5,
    device: torch.device | str = "cpu",
) -> float:
    """Memory traffic per second of one large tensor copy on ``device`` (median of
    ``repeats``, synchronised on an accelerator).

    A copy reads ``nbytes`` and writes ``nbytes``: both count, as in STREAM's "copy".
    """
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, repeats)


def matmul_floor(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds per token of the model's matrix-vector products alone: one ``(1, in)``
    row through every ``nn.Linear`` weight in turn, nothing else. No decoder built from
    these weights can be faster on this machine, whatever its framework."""
    weights = [
        m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    rows = [torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]

    def products() -> None:
        for w, x in zip(weights, rows, strict=True):
            torch.nn.functional.linear(x, w)

    return median_seconds(products, weights[0].device, repeats)


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
    (warm-up, compilation) is not counted. The copy bandwidth and the matmul floor are
    the best of all rounds."""
    device = input_ids.device
    ours, theirs, fixed, bandwidths, floors = [], [], [], [], []
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
    if compiled:
        fixed_tps = new_tokens / statistics.median(fixed[1:])
        extra = {
            "compiled_tps": fixed_tps,
            "compiled_of_bound": fixed_tps / bound,
            "compiled_agreeing_tokens": float(
                _agreeing(out_fixed, out_ours, input_ids.shape[1])
            ),
        }
    if reference is not None:
        theirs_tps = new_tokens / statistics.median(theirs[1:])
        extra |= {
            "transformers_tps": theirs_tps,
            "ratio": ours_tps / theirs_tps,
            "transformers_of_bound": theirs_tps / bound,
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
        "companion_of_bound": ours_tps / bound,
        "new_tokens": float(new_tokens),
    }


def _agreeing(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    """How many generated tokens agree before the first difference."""
    same = (a[0, start:] == b[0, start:]).tolist()
    return same.index(False) if False in same else len(same)


def _format_alone(r: dict[str, float]) -> str:
    """The table of a run without the transformers side (random preset weights)."""
    floor = r["matmul_floor_tps"]
    rows = [("eager", r["companion_tps"], r["companion_of_bound"])]
    if "compiled_tps" in r:
        rows.append(("compiled", r["compiled_tps"], r["compiled_of_bound"]))
    lines = [f"{'':<14}{'tokens/s':>10}{'of bound':>10}{'of floor':>10}"]
    lines += [f"{n:<14}{t:>10.1f}{b:>10.0%}{t / floor:>10.0%}" for n, t, b in rows]
    if "compiled_tps" in r:
        lines.append(
            f"compiled tokens equal eager's for the first "
            f"{int(r['compiled_agreeing_tokens'])} of {int(r['new_tokens'])}"
        )
    return "\n".join(
        [
            *lines,
            f"bound: {r['bandwidth_gbs']:.1f} GB/s copy bandwidth / {r['weight_mb']:.0f} MB of "
            f"weights = {r['bound_tps']:.1f} tokens/s",
            f"matmul floor: the weights' matrix-vector products alone, one launch each: "
            f"{floor:.1f} tokens/s",
        ]
    )


def format_decode(r: dict[str, float]) -> str:
    """The decode results as a small table."""
    if "transformers_tps" not in r:
        return _format_alone(r)
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
