"""Routed experts, loop vs grouped (chapter 10): ``python -m companion.bench moe``.

Times the forward pass of one MoE layer (E=64 experts, top-8, d=256, expert width 128,
fp32) on the same weights: :class:`companion.layers.moe.MoEFeedForward` with the grouped
experts (tokens sorted by expert, one matmul per expert's segment), with the same on one
``torch._grouped_mm`` call (``grouped_mm``, where it runs: NaN elsewhere) and with the
reference loop over experts, and transformers' ``Qwen3MoeSparseMoeBlock`` with its plain
loop (``eager``, what the module does on its own) and with its ``grouped_mm`` experts (a
full model's default). All run in turn in every round, so that load from elsewhere hits
them alike; each figure is the median over ``--repeats`` rounds after a warm-up round.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable, Sequence

import torch

from companion.device import default_device
from companion.layers.moe import MoEFeedForward
from companion.ops.experts import grouped_mm_available

from .common import interleaved_medians, positive_int

__all__ = ["add_parser", "bench_moe", "format_moe"]

IMPLS = ("grouped", "grouped_mm", "reference", "hf_eager", "hf_grouped_mm")
NAN = float("nan")


def _transformers_blocks(
    ours: MoEFeedForward, n_experts: int, top_k: int, d_model: int, d_ff: int
) -> dict[str, torch.nn.Module]:
    """Qwen3-MoE blocks with ``ours``' weights, one per experts implementation ({} if
    absent)."""
    if importlib.util.find_spec("transformers") is None:
        return {}
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = {}
    for name, experts_impl in (("hf_eager", "eager"), ("hf_grouped_mm", "grouped_mm")):
        cfg = Qwen3MoeConfig(
            hidden_size=d_model,
            moe_intermediate_size=d_ff,
            num_experts=n_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
        cfg._experts_implementation = experts_impl
        block = Qwen3MoeSparseMoeBlock(cfg)
        block.load_state_dict(
            {
                "gate.weight": ours.router.weight,
                "experts.gate_up_proj": ours.experts.gate_up,
                "experts.down_proj": ours.experts.down,
            }
        )
        blocks[name] = block.to(ours.router.weight.device)
    return blocks


def bench_moe(
    tokens: Sequence[int],
    n_experts: int = 64,
    top_k: int = 8,
    d_model: int = 256,
    d_ff: int = 128,
    repeats: int = 5,
    device: torch.device | None = None,
) -> list[dict[str, float]]:
    """One row per token count: ``{"tokens", "<impl>_ms", "max_abs_diff"}``.

    ``<impl>`` is each of ``IMPLS`` (transformers' rows are NaN when it is not
    installed); ``max_abs_diff`` compares our grouped output with transformers' eager
    one.
    """
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    ours = MoEFeedForward(d_model, n_experts, top_k, d_ff).to(device)
    blocks = _transformers_blocks(ours, n_experts, top_k, d_model, d_ff)
    rows = []
    for n in tokens:
        x = torch.randn(1, n, d_model, device=device)

        def run_ours(impl: str, x: torch.Tensor = x) -> torch.Tensor:
            ours.experts.impl = impl
            return ours(x)

        w = ours.experts.gate_up
        grouped_mm = {"grouped_mm": lambda: run_ours("grouped_mm")}
        runs: dict[str, Callable[[], torch.Tensor]] = {
            "grouped": lambda: run_ours("grouped"),
            **(grouped_mm if grouped_mm_available(x.view(-1, d_model), w) else {}),
            "reference": lambda: run_ours("reference"),
            **{name: (lambda b=block, x=x: b(x)) for name, block in blocks.items()},
        }
        with torch.no_grad():
            times = interleaved_medians(runs, device, repeats)
            diff = (
                (run_ours("grouped") - blocks["hf_eager"](x)).abs().max()
                if blocks
                else NAN
            )
        row: dict[str, float] = {"tokens": n, "max_abs_diff": float(diff)}
        for name in IMPLS:
            row[f"{name}_ms"] = 1e3 * times[name] if name in times else NAN
        rows.append(row)
    return rows


def format_moe(rows: list[dict[str, float]]) -> str:
    """A plain-text table of :func:`bench_moe`'s rows; ratios are times over ours
    grouped."""
    header = (
        f"{'tokens':>6} | {'grouped ms':>10} {'grouped_mm ms':>13} {'reference ms':>12} "
        f"{'HF eager ms':>11} "
        f"{'HF grouped_mm ms':>16} | {'reference/grouped':>17} {'HF eager/grouped':>16} "
        f"{'HF grouped_mm/grouped':>21} | {'max |Δ| vs HF':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        g = r["grouped_ms"]
        lines.append(
            f"{int(r['tokens']):>6} | {g:>10.2f} {r['grouped_mm_ms']:>13.2f} "
            f"{r['reference_ms']:>12.2f} "
            f"{r['hf_eager_ms']:>11.2f} {r['hf_grouped_mm_ms']:>16.2f} | "
            f"{r['reference_ms'] / g:>16.2f}x {r['hf_eager_ms'] / g:>15.2f}x "
            f"{r['hf_grouped_mm_ms'] / g:>20.2f}x | {r['max_abs_diff']:>13.1e}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    device = default_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"MoE forward, E={args.experts} top-{args.top_k} d={args.d_model} d_ff={args.d_ff}, "
        f"fp32 on {device.type}, median of {args.repeats} rounds after a warm-up "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    rows = bench_moe(
        args.tokens,
        args.experts,
        args.top_k,
        args.d_model,
        args.d_ff,
        args.repeats,
        device,
    )
    print(format_moe(rows))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``moe`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "moe", help="routed experts: reference loop vs grouped vs transformers"
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), default="cpu")
    p.add_argument(
        "--tokens", type=positive_int, nargs="+", default=[2048], help="N = B·T"
    )
    p.add_argument("--experts", type=positive_int, default=64, help="E")
    p.add_argument("--top-k", type=positive_int, default=8, help="k")
    p.add_argument("--d-model", type=positive_int, default=256, help="d")
    p.add_argument(
        "--d-ff", type=positive_int, default=128, help="one expert's hidden width"
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="timed rounds")
    p.add_argument(
        "--threads",
        type=positive_int,
        help="CPU threads (default: torch's); 1 steadies a busy box",
    )
    p.set_defaults(run=_run)
