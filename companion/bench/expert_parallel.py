"""Expert parallelism against one process (chapter 10): ``torchrun --nproc-per-node 2
-m companion.bench.expert_parallel``, or ``python -m companion.bench expert_parallel
--ranks 2`` (which starts the processes itself).

Every rank holds the same :class:`companion.layers.moe.MoEFeedForward` (a random one
here; chapter 10 passes its trained layer to :func:`spawn_compare`), runs it on all
the tokens, then runs its own contiguous share of the tokens through
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

__all__ = ["add_parser", "compare_ranks", "format_rows", "main", "spawn_compare"]


def compare_ranks(full: MoEFeedForward, x: torch.Tensor) -> list[dict]:
    """This rank's comparison of ``full`` on all of ``x (P·n, d)`` with its
    expert-parallel split on this rank's n tokens; on rank 0 every rank's, else
    ``[]``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(x) % world:
        raise ValueError(f"x's {len(x)} tokens must split evenly over {world} ranks")
    n, d = len(x) // world, x.shape[1]
    E, k = full.router.n_experts, full.router.top_k
    with torch.no_grad():
        y_full = full(x)
        mine = slice(rank * n, (rank + 1) * n)
        ep = ExpertParallelMoE(full)
        y = ep(x[mine])
    source = torch.arange(world * n, device=x.device) // n  # each token's rank
    matrix = traffic_matrix(full.last_routing.indices, source, E, world)  # (P, P)
    # out: my copies bound for other ranks, and the outputs of others' copies
    rows_out = matrix[rank].sum() + matrix[:, rank].sum() - 2 * matrix[rank, rank]
    size = x.element_size()
    cfg = tiny(d_model=d, n_heads=1, n_kv_heads=None, moe=MoEConfig(E, k))
    uniform = all_to_all_bytes(cfg, world, dispatch_bytes=size, combine_bytes=size)
    row = {
        "rank": rank,
        "max_abs_diff": (y - y_full[mine]).abs().max().item(),
        "sent_bytes": ep.last_traffic.sent_bytes(rank),
        "routing_bytes": int(rows_out) * d * size,
        "uniform_bytes": n * uniform,
        "matrix": matrix.cpu(),
    }
    rows = [None] * world if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    return rows or []


def _device(name: str) -> torch.device:
    if name != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _spawned(
    rank: int, world: int, tmp: str, full: MoEFeedForward, x: torch.Tensor, device: str
) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    init = f"file://{Path(tmp) / 'init'}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        dev = _device(device)
        rows = compare_ranks(full.to(dev), x.to(dev))
        if rank == 0:
            torch.save(rows, Path(tmp) / "rows.pt")
    finally:
        dist.destroy_process_group()


def spawn_compare(
    full: MoEFeedForward, x: torch.Tensor, ranks: int, device: str = "cpu"
) -> list[dict]:
    """Start ``ranks`` processes (gloo, or NCCL with ``device="cuda"``), run
    :func:`compare_ranks` on ``full`` and ``x`` there, and return every rank's
    row."""
    with tempfile.TemporaryDirectory() as tmp:
        args = (ranks, tmp, full.cpu(), x.cpu(), device)
        mp.spawn(_spawned, args=args, nprocs=ranks)
        return torch.load(Path(tmp) / "rows.pt")


def format_rows(rows: list[dict]) -> str:
    """The per-rank table: agreement, bytes sent, the count from the routing and the
    uniform-routing formula."""
    lines = [
        f"{'rank':>4} {'max |Δ|':>9} {'bytes sent':>11} {'by routing':>11}"
        f" {'uniform':>9}"
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['max_abs_diff']:>9.1e} {r['sent_bytes']:>11,}"
            f" {r['routing_bytes']:>11,} {r['uniform_bytes']:>9,.0f}"
        )
    return "\n".join(lines)


def _random_layer(
    args: argparse.Namespace, ranks: int
) -> tuple[MoEFeedForward, torch.Tensor]:
    torch.manual_seed(0)  # the same layer and tokens on every rank
    full = MoEFeedForward(args.d_model, args.experts, args.top_k, args.d_ff)
    return full, torch.randn(ranks * args.tokens, args.d_model)


def _title(args: argparse.Namespace, ranks: int) -> str:
    return (
        f"{ranks} ranks, {args.tokens} tokens each, E={args.experts}, "
        f"top-{args.top_k}, d={args.d_model}, fp32"
    )


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    p.add_argument("--tokens", type=positive_int, default=256, help="N per rank")
    p.add_argument("--experts", type=positive_int, default=8, help="E")
    p.add_argument("--top-k", type=positive_int, default=2, help="k")
    p.add_argument("--d-model", type=positive_int, default=64, help="d")
    p.add_argument("--d-ff", type=positive_int, default=32, help="expert width")


def _run(args: argparse.Namespace) -> None:
    rows = spawn_compare(*_random_layer(args, args.ranks), args.ranks, args.device)
    print(_title(args, args.ranks) + "\n" + format_rows(rows))


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
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        dev, world = _device(args.device), dist.get_world_size()
        full, x = _random_layer(args, world)
        rows = compare_ranks(full.to(dev), x.to(dev))
        if rows:
            print(_title(args, world) + "\n" + format_rows(rows))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
