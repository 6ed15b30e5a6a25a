"""Train a chapter's language model data-parallel, one process per GPU (or CPU rank).

    torchrun --nproc-per-node 8 tools/train_ddp.py --chapter 07 --full
    torchrun --nproc-per-node 2 tools/train_ddp.py --chapter 04 --steps 100   # CPU, gloo

The model, data, global batch, learning rate and schedule are the chapter's
(``--full``: its ``FULL = True`` sizes): chapter 04's next-token decoder (2 Pre-LN
blocks, sinusoidal positions) or chapter 07's SwiGLU decoder, on the character-level
Shakespeare of :mod:`companion.tasks.text`. Every rank draws the same global batch from
the same seeded generator and trains on its contiguous shard
(:func:`companion.data_parallel.train_data_parallel`); rank 0 prints the global mean
loss every ``--every`` steps, the held-out loss at the end, and the throughput. The
global batch must divide by the number of processes. Run from the repository root
(the root goes on ``sys.path``, so no install is needed).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from companion.data_parallel import (  # noqa: E402
    setup_process_group,
    train_data_parallel,
)
from companion.models.config import ModelConfig  # noqa: E402
from companion.models.decoder import DecoderLM  # noqa: E402
from companion.models.presets import tiny  # noqa: E402
from companion.tasks.text import (  # noqa: E402
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (  # noqa: E402
    cosine_lr,
    evaluate,
    make_adamw,
    seed_everything,
)


def chapter_04(vocab: int, full: bool) -> tuple[ModelConfig, int, int, int, float]:
    """Chapter 04's next-token decoder: (config, seq, global batch, steps, lr)."""
    seq, batch, steps = (32, 256, 3000) if full else (16, 128, 600)
    d = 128 if full else 48
    cfg = ModelConfig(
        vocab_size=vocab + 1,  # the chapter's extra [MASK] id, unused here
        d_model=d,
        n_layers=2,
        n_heads=d // 16,
        max_seq_len=seq,
        position="sinusoidal",
        scale_embeddings=True,
        init_std=0.1,
        norm_placement="pre",
        attn_impl="sdpa",
    )
    return cfg, seq, batch, steps, 1e-2


def chapter_07(vocab: int, full: bool) -> tuple[ModelConfig, int, int, int, float]:
    """Chapter 07's SwiGLU decoder: (config, seq, global batch, steps, lr)."""
    seq, batch, steps, lr = (128, 64, 3000, 3e-3) if full else (32, 32, 250, 1e-2)
    d = 128 if full else 48
    cfg = tiny(
        vocab_size=vocab,
        d_model=d,
        n_layers=4 if full else 1,
        n_heads=d // 16,
        d_ff=8 * d // 3,
        ffn="glu",
        activation="silu",
        max_seq_len=seq,
        init_std=0.1,
        n_kv_heads=None,
    )
    return cfg, seq, batch, steps, lr


CHAPTERS: dict[str, Callable[[int, bool], tuple[ModelConfig, int, int, int, float]]] = {
    "04": chapter_04,
    "07": chapter_07,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chapter", choices=sorted(CHAPTERS), default="07")
    parser.add_argument("--full", action="store_true", help="the chapter's FULL sizes")
    parser.add_argument("--steps", type=int, help="default: the chapter's")
    parser.add_argument(
        "--batch", type=int, help="global batch; default: the chapter's"
    )
    parser.add_argument("--every", type=int, default=25, help="print every N steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rank, world, device = setup_process_group()
    if rank:  # one progress bar: rank 0's
        os.environ["COMPANION_PROGRESS"] = "0"
    text = load_shakespeare()
    chars = CharTokenizer(text)
    train_ids, val_ids = split_tokens(torch.tensor(chars.encode(text)), 0.1)
    cfg, seq, batch, steps, lr = CHAPTERS[args.chapter](chars.vocab_size, args.full)
    steps, batch = args.steps or steps, args.batch or batch
    if batch % world:
        raise SystemExit(f"--batch {batch} must divide by the {world} processes")

    seed_everything(args.seed)  # the same initial weights on every rank
    model = DecoderLM(cfg).to(device)
    windows = torch.Generator().manual_seed(1000 + args.seed)  # the same on every rank
    if rank == 0:
        print(
            f"chapter {args.chapter}: {model.num_params():,} parameters, {world} "
            f"processes on {device.type} ({dist.get_backend()}), global batch "
            f"{batch} x {seq} ({batch // world} rows each), {steps} steps, lr {lr}"
        )
    start = time.perf_counter()
    hist = train_data_parallel(
        model,
        lambda step: sample_windows(train_ids, batch, seq, windows, device),
        steps,
        make_adamw(model, lr=lr),
        lr_at=lambda s: cosine_lr(
            s, lr, warmup=steps // 10, total=steps, min_lr=lr / 10
        ),
        desc=f"chapter {args.chapter}",
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if rank == 0:
        for step, loss in zip(hist.step, hist.loss, strict=True):
            if step % args.every == 0 or step == steps - 1:
                print(f"step {step:>5}  loss {loss:.4f}  lr {hist.lr[step]:.2e}")
        g = torch.Generator().manual_seed(500)
        val = [sample_windows(val_ids, 256, seq, g, device) for _ in range(4)]
        print(f"held-out loss {evaluate(model, val):.4f}")
        print(f"{steps * batch * seq / seconds:,.0f} tokens/s over {seconds:.1f} s")
    del model, hist  # DDP's reducer and its pending work go before the group
    gc.collect()
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
