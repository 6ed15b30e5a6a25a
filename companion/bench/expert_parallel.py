"""Expert parallelism against one process (chapter 10): ``torchrun --nproc-per-node 2
-m companion.bench.expert_parallel``, or ``python -m companion.bench expert_parallel
--ranks 2`` (which starts the processes itself).

Every rank builds the same :class:`companion.layers.moe.MoEFeedForward` (same seed),
runs it on all the tokens, then runs its own share of the tokens through
:class:`companion.layers.expert_parallel.ExpertParallelMoE`. Rank 0 prints, per rank,
the largest difference from the single-process output, and the bytes the rank sent
over the two all-to-alls beside the bytes the routing says it must send
(:func:`companion.analysis.expert_traffic.traffic_matrix`) and the uniform-routing
formula (:func:`companion.analysis.expert_traffic.all_to_all_bytes`). gloo on a CPU,
NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from companion.analysis.expert_traffic import all_to_all_bytes, traffic_matrix
from companion.layers.expert_parallel import ExpertParallelMoE
from companion.layers.moe import MoEFeedForward
from companion.models.config_parts import MoEConfig
from companion.models.presets import tiny

from .common import positive_int

__all__ = ["add_parser", "compare_ranks", "main"]


def compare_ranks(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """This rank's comparison; on rank 0, every rank's (gathered), else ``[]``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E, k, d, n = args.experts, args.top_k, args.d_model, args.tokens
    torch.manual_seed(0)  # the same layer and tokens on every rank
    full = MoEFeedForward(d, E, k, args.d_ff).to(device)
    x = torch.randn(world * n, d, device=device)
    with torch.no_grad():
        y_full = full(x)
        mine = slice(rank * n, (rank + 1) * n)
        ep = ExpertParallelMoE(full)
        y = ep(x[mine])
    source = torch.arange(world * n, device=device) // n  # each token's rank
    matrix = traffic_matrix(full.last_routing.indices, source, E, world)  # (P, P)
    # out: my copies bound for other ranks, and the outputs of others' copies
    rows_out = matrix[rank].sum() + matrix[:, rank].sum() - 2 * matrix[rank, rank]
    size = x.element_size()
    cfg = tiny(d_model=d, n_heads=1, n_kv_heads=None, moe=MoEConfig(E, k, args.d_ff))
    row = {
        "rank": rank,
        "max_abs_diff": (y - y_full[mine]).abs().max().item(),
        "sent_bytes": ep.last_traffic.sent_bytes(rank),
        "routing_bytes": int(rows_out) * d * size,
        "uniform_bytes": n
        * all_to_all_bytes(cfg, world, dispatch_bytes=size, combine_bytes=size),
    }
    rows = [None] * world if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    return rows or []


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"{len(rows)} ranks, {args.tokens} tokens each, E={args.experts}, "
        f"top-{args.top_k}, d={args.d_model}, fp32"
    )
    print(
        f"{'rank':>4} {'max |Δ|':>9} {'bytes sent':>11} {'by routing':>11} "
        f"{'uniform':>9}"
    )
    for r in rows:
        print(
            f"{r['rank']:>4} {r['max_abs_diff']:>9.1e} {r['sent_bytes']:>11,}"
            f" {r['routing_bytes']:>11,} {r['uniform_bytes']:>9,.0f}"
        )


def _device(name: str) -> torch.device:
    if name != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _spawned(rank: int, world: int, path: str, args: argparse.Namespace) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{path}", rank=rank, world_size=world
    )
    try:
        rows = compare_ranks(args, _device(args.device))
        if rank == 0:
            _print(rows, args)
    finally:
        dist.destroy_process_group()


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    p.add_argument("--tokens", type=positive_int, default=256, help="N per rank")
    p.add_argument("--experts", type=positive_int, default=8, help="E")
    p.add_argument("--top-k", type=positive_int, default=2, help="k")
    p.add_argument("--d-model", type=positive_int, default=64, help="d")
    p.add_argument("--d-ff", type=positive_int, default=32, help="expert width")


def _run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "init")
        mp.spawn(_spawned, args=(args.ranks, path, args), nprocs=args.ranks)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``expert_parallel`` on the ``python -m companion.bench`` command
    line."""
    p = sub.add_parser(
        "expert_parallel", help="experts split over processes vs one process"
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="processes P")
    _options(p)
    p.set_defaults(run=_run)


def main(argv: Sequence[str] | None = None) -> None:
    """The ``torchrun`` entry point: the process group comes from its environment."""
    p = argparse.ArgumentParser(prog="torchrun -m companion.bench.expert_parallel")
    _options(p)
    args = p.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    try:
        rows = compare_ranks(args, _device(args.device))
        if dist.get_rank() == 0:
            _print(rows, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
