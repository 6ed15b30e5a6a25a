"""Data parallelism: one training loop run on W processes at once (``torchrun``).

Shape legend: B the global batch (rows), W the world size (processes, one per GPU),
r a rank in 0..W-1, B/W the rows of one rank's shard, T tokens per row.

Every rank holds a full replica of the model (DistributedDataParallel broadcasts rank
0's parameters when it wraps the model, so the replicas start equal). Each step every
rank builds the same global batch ``(B, T)`` and keeps its shard: the contiguous rows
``r·B/W .. (r+1)·B/W - 1`` (:func:`shard_batch`). It runs forward and backward on its
shard alone; during the backward DDP all-reduces the gradients in buckets of about
25 MB, overlapping the exchange with the rest of the backward, and divides by W, so
every rank holds the gradient of the global batch's mean loss (for equal shards, the
mean of the shards' means) and takes the same optimizer step. The loss it reports is
the global mean too: the ranks' losses all-reduced (:func:`global_mean`); rank r's own
loss is only its shard's.

The loop is :func:`~companion.training.train` itself, given the wrapped model and a
loss on the rank's shard: on one process, or on W processes
with the global batch, it gives the same losses and parameters up to the order of the
floating-point sums (tests/test_data_parallel.py). Launch with ``torchrun
--nproc-per-node W tools/train_ddp.py`` (see the README); gloo on CPUs, NCCL on GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from companion.checks import check_int
from companion.training import Batch, History, lm_loss, train

__all__ = [
    "DataParallelHistory",
    "global_mean",
    "setup_process_group",
    "shard_batch",
    "train_data_parallel",
]


def setup_process_group(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` describes; return ``(rank, world,
    device)``.

    Reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and
    ``MASTER_ADDR``/``MASTER_PORT`` through ``init_method="env://"``). The backend is
    NCCL where CUDA is present (device ``cuda:LOCAL_RANK``, one GPU per process), else
    gloo on the CPU. A group already initialised (a test's) is reused as it is.
    """
    cuda = torch.cuda.is_available()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"environment variables {missing} are unset: launch with torchrun "
                "(torchrun --nproc-per-node N script.py)"
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        backend = backend or ("nccl" if cuda else "gloo")
        if cuda and backend == "nccl":
            torch.cuda.set_device(local)  # before init: NCCL binds this GPU
        dist.init_process_group(backend, init_method="env://")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return rank, world, device


def shard_batch(x: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s contiguous slice of a global batch: rows ``rank·B/W`` up to
    ``(rank+1)·B/W`` of ``x (B, ...)``; ``B`` must divide by ``world``.

    Equal shards keep the mean of the ranks' mean losses equal to the global mean."""
    check_int("world", world, 1)
    check_int("rank", rank, 0)
    if rank >= world:
        raise ValueError(f"rank must be < world={world}, got {rank}")
    b = x.shape[0]
    if b % world:
        raise ValueError(
            f"the global batch ({b} rows) must divide by world={world}: "
            "unequal shards would weight the ranks' losses unequally"
        )
    n = b // world
    return x[rank * n : (rank + 1) * n]


def global_mean(value: Tensor) -> Tensor:
    """The mean of ``value`` over the ranks (a sum all-reduce, then / W; gloo has no
    average op). Without a process group, ``value`` itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    total = value.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


@dataclass
class DataParallelHistory(History):
    """:class:`~companion.training.History` (``loss``: the global mean per step) plus
    this rank's own shard loss per step, ``rank_loss``."""

    rank_loss: list[float] = field(default_factory=list)


def train_data_parallel(
    model: nn.Module,
    get_batch: Callable[[int], Batch],
    steps: int,
    optimizer: torch.optim.Optimizer,
    lr_at: Callable[[int], float] | None = None,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = lm_loss,
    clip: float | None = 1.0,
    desc: str = "train",
) -> DataParallelHistory:
    """:func:`~companion.training.train` on every rank of the process group: each rank
    calls it with the same ``model`` initialisation, the same ``get_batch`` (the global
    batch of ``step``) and an optimizer over ``model``'s parameters.

    The model is wrapped in DistributedDataParallel (one device per process: the device
    of its parameters) and ``train`` runs it on each rank's :func:`shard_batch` of the
    batch. The loss ``train`` sees has the value of the global mean (so it records it,
    and every rank stops at the same non-finite step) and the gradient of this rank's
    shard loss (DDP averages those). Without a process group (one process) this is
    ``train`` itself, unwrapped. No evaluation inside the loop: evaluate after.
    """
    grouped = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    ddp: nn.Module = model
    if grouped:  # broadcasts rank 0's parameters and buffers to every rank
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids)
    rank_loss: list[float] = []

    def shard_loss(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        loss = loss_fn(m, shard_batch(x, rank, world), shard_batch(y, rank, world))
        rank_loss.append(loss.item())
        # the global mean's value, this shard's gradient (DDP averages the gradients)
        return loss + (global_mean(loss) - loss).detach()

    hist = train(ddp, get_batch, steps, optimizer, lr_at, shard_loss, clip, desc=desc)
    return DataParallelHistory(**vars(hist), rank_loss=rank_loss)
