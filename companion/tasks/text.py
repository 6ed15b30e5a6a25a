"""Text data shipped with the package: Shakespeare, a character tokenizer, a byte-level
BPE.

Used from chapter 02 on. ``data/shakespeare.txt`` holds eight public-domain plays (about
1 MB; see ``data/README.md``). ``data/bpe.json`` is a byte-level BPE trained on it
offline; retrain it from a checkout with ``python -m companion.tasks.text train-bpe
--out companion/data/bpe.json`` (the command never writes into the installed package
unless told to).
"""

from __future__ import annotations

import argparse
from functools import cache
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from companion.checks import check_id_list, check_int, check_text

__all__ = [
    "BPETokenizer",
    "CharTokenizer",
    "load_bpe",
    "load_shakespeare",
    "sample_windows",
    "split_tokens",
    "train_bpe",
]

BPE_VOCAB_SIZE = 2048
_DATA = resources.files("companion") / "data"


@cache
def load_shakespeare() -> str:
    """The eight plays as one string (ASCII, about 1.04 million characters)."""
    return (_DATA / "shakespeare.txt").read_text(encoding="ascii")


class CharTokenizer:
    """One id per distinct character of a text, in sorted order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        check_text("text", text)
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise ValueError(
                f"characters {unknown} are not in the tokenizer's vocabulary"
            )
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int] | Tensor) -> str:
        return "".join(
            self.chars[i] for i in check_id_list("ids", ids, self.vocab_size)
        )


class BPETokenizer:
    """A thin wrapper around a HF ``tokenizers`` byte-level BPE with
    ``encode``/``decode``."""

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(check_text("text", text)).ids

    def decode(self, ids: list[int] | Tensor) -> str:
        return self._tok.decode(check_id_list("ids", ids, self.vocab_size))

    def tokens(self, text: str) -> list[str]:
        """The pieces a text splits into (``Ġ`` marks a leading space)."""
        return self._tok.encode(check_text("text", text)).tokens


def train_bpe(text: str, vocab_size: int = BPE_VOCAB_SIZE) -> BPETokenizer:
    """Train a byte-level BPE on ``text`` (deterministic, about a second for 1 MB).
    ``vocab_size`` counts the 256 byte symbols and one special token, so it must be at
    least 257."""
    check_text("text", text)
    check_int("vocab_size", vocab_size, 257)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return BPETokenizer(tok)


@cache
def load_bpe() -> BPETokenizer:
    """The shipped BPE (vocabulary 2048) trained on :func:`load_shakespeare`."""
    from tokenizers import Tokenizer

    return BPETokenizer(
        Tokenizer.from_str((_DATA / "bpe.json").read_text(encoding="utf-8"))
    )


def _check_stream(ids: object) -> None:
    """Raise naming ``ids`` unless it is a 1-D integer tensor (a token stream)."""
    if not isinstance(ids, Tensor):
        raise TypeError(
            f"ids must be a 1-D tensor of token ids, got {type(ids).__name__}"
        )
    if ids.ndim != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"ids must be a 1-D integer tensor (one token stream), got shape "
            f"{tuple(ids.shape)} {ids.dtype}"
        )


def split_tokens(ids: Tensor, val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """Split a 1-D token tensor into train and validation parts (the tail is
    validation)."""
    _check_stream(ids)
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, (int, float))
        or not 0.0 < val_fraction < 1.0
    ):
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n = int(len(ids) * (1.0 - val_fraction))
    if n == 0 or n == len(ids):
        raise ValueError(
            f"val_fraction={val_fraction} of {len(ids)} tokens leaves an empty split"
        )
    return ids[:n], ids[n:]


def sample_windows(
    ids: Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """Random windows ``x (B, T)`` and their next tokens ``y (B, T)`` from a 1-D token
    tensor."""
    _check_stream(ids)
    check_int("batch_size", batch_size, 1)
    check_int("seq_len", seq_len, 1)
    if len(ids) <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} tokens, got {len(ids)}")
    start = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len)
    x = ids[start[:, None] + offsets]
    y = ids[start[:, None] + offsets + 1]
    return x.to(device), y.to(device)


def main(argv: list[str] | None = None) -> None:
    """``python -m companion.tasks.text train-bpe [--vocab-size N] --out PATH``."""
    parser = argparse.ArgumentParser(prog="python -m companion.tasks.text")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train-bpe", help="train a byte-level BPE on the shipped plays")
    p.add_argument("--vocab-size", type=int, default=BPE_VOCAB_SIZE)
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="where to write it (the shipped one: companion/data/bpe.json in a checkout)",
    )
    args = parser.parse_args(argv)
    tok = train_bpe(load_shakespeare(), args.vocab_size)
    args.out.write_text(tok._tok.to_str(pretty=False), encoding="utf-8")
    print(f"wrote {args.out} (vocab {tok.vocab_size})")


if __name__ == "__main__":
    main()
