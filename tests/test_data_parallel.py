"""Data parallelism: two gloo ranks, each on its shard of the global batch, give the
loss curve, gradients and parameters of one process training on the whole batch; the
shards partition the batch; the loss reported is the global mean."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from companion.data_parallel import (
    global_mean,
    setup_process_group,
    shard_batch,
    train_data_parallel,
)
from companion.models.decoder import DecoderLM
from companion.models.presets import tiny
from companion.training import lm_loss, make_adamw, train

V, B, T, STEPS = 16, 4, 8, 4  # vocabulary, global batch, tokens per row, steps


def _model() -> DecoderLM:
    torch.manual_seed(0)
    cfg = tiny(
        vocab_size=V,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        max_seq_len=T,
    )
    return DecoderLM(cfg)


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(STEPS)]
    return [(i[:, :-1], i[:, 1:]) for i in ids]


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":  # not invariant to the gradient's scale, as Adam nearly is
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return make_adamw(model, lr=1e-2)


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


def _check(kind: str, rank: int, world: int) -> None:
    batches = _batches()
    clip = None if kind == "sgd" else 1.0
    ref = _model()  # one process, the whole global batch
    want = train(ref, batches.__getitem__, STEPS, _optimizer(ref, kind), clip=clip)
    seen: list[Tensor] = []

    def recorded(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        seen.append(x.clone())
        return lm_loss(model, x, y)

    model = _model()
    got = train_data_parallel(
        model,
        batches.__getitem__,
        STEPS,
        _optimizer(model, kind),
        loss_fn=recorded,
        clip=clip,
    )
    _close(got.loss, want.loss)  # the global mean, step by step
    # Adam turns a rounding difference in a near-zero gradient into ~1e-7 of a step
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the shards, gathered in rank order, are the global batch: disjoint, complete
    shards: list[list[Tensor] | None] = [None] * world
    dist.all_gather_object(shards, seen)
    for step, (x, _) in enumerate(batches):
        assert torch.equal(torch.cat([s[step] for s in shards]), x)
    # each rank's own loss is its shard's; their mean is the reported loss
    rank_losses: list[list[float] | None] = [None] * world
    dist.all_gather_object(rank_losses, got.rank_loss)
    _close([sum(s) / world for s in zip(*rank_losses, strict=True)], got.loss)
    assert all(a != b for a, b in zip(*rank_losses, strict=True))


def _worker(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{path}", rank=rank, world_size=world
    )
    try:
        for kind in ("adamw", "sgd"):
            _check(kind, rank, world)
        assert setup_process_group()[:2] == (rank, world)  # reuses the group
        x = torch.full((1,), float(rank))
        torch.testing.assert_close(global_mean(x), torch.tensor([(world - 1) / 2]))
        dist.barrier()  # both ranks done before either tears the group down
    finally:
        gc.collect()  # DDP's reducers and their pending work go before the group
        dist.destroy_process_group()


def test_two_ranks_equal_one_process() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, str(Path(tmp) / "init")), nprocs=2)


def _tool_worker(rank: int, world: int, path: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import train_ddp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{path}", rank=rank, world_size=world
    )
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        train_ddp.main(
            ["--chapter", "07", "--steps", "3", "--batch", "4", "--every", "1"]
        )
    Path(f"{out}.{rank}").write_text(printed.getvalue())


def test_train_ddp_tool_runs_on_two_ranks() -> None:
    """tools/train_ddp.py (what torchrun starts), on a gloo group: rank 0 prints."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out")
        mp.spawn(_tool_worker, args=(2, str(Path(tmp) / "init"), out), nprocs=2)
        printed = Path(f"{out}.0").read_text()
        assert Path(f"{out}.1").read_text() == ""
    assert "2 processes on cpu (gloo), global batch 4 x 32 (2 rows each)" in printed
    assert printed.count("  loss ") == 3 and "held-out loss" in printed


def test_one_process_is_train() -> None:
    """Without a process group the loop is train(): the same bits."""
    batches = _batches()
    ref, model = _model(), _model()
    want = train(ref, batches.__getitem__, STEPS, make_adamw(ref, lr=1e-2))
    got = train_data_parallel(
        model, batches.__getitem__, STEPS, make_adamw(model, lr=1e-2)
    )
    assert got.loss == want.loss == got.rank_loss
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not model.training


def test_shard_batch_slices_and_checks() -> None:
    x = torch.arange(6)
    assert shard_batch(x, 1, 3).tolist() == [2, 3]
    assert torch.equal(torch.cat([shard_batch(x, r, 2) for r in range(2)]), x)
    with pytest.raises(ValueError, match="must divide by world=4"):
        shard_batch(x, 0, 4)
    with pytest.raises(ValueError, match="rank must be < world=2"):
        shard_batch(x, 2, 2)


def test_setup_needs_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert "RANK" not in os.environ
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        setup_process_group()
