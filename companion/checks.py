"""Argument checks shared by every layer: each error names the argument, what it got and
what is allowed."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "DISTRIBUTION",
    "check_choice",
    "check_id_list",
    "check_int",
    "check_number",
    "check_positive",
    "check_targets",
    "check_text",
    "read_checked",
    "require",
]

T = TypeVar("T")

# the name this package is installed under (``import companion`` stays the import name)
DISTRIBUTION = "transformer-2017-2026"


def require(module: str, extra: str, what: str) -> None:
    """Raise a ModuleNotFoundError naming the extra to install unless ``module`` can be
    imported; ``what`` says what needs it."""
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ModuleNotFoundError(
            f"{what} needs the package {module!r}, which is not installed: "
            f"pip install '{DISTRIBUTION}[{extra}]'",
            name=module,
        )


def check_int(
    name: str, value: object, minimum: int, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` unless ``value`` is an int (not a bool) of at least
    ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = {0: "a non-negative integer", 1: "a positive integer"}
        kind = what.get(minimum, f"an integer >= {minimum}")
        raise error(f"{name} must be {kind}, got {value!r}")


def check_positive(
    name: str, value: object, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` unless ``value`` is a number (not a bool) greater than 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise error(f"{name} must be a positive number, got {value!r}")


def check_number(
    name: str, value: object, minimum: float = 0.0, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` unless ``value`` is a finite number (not a bool) of at least
    ``minimum``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
    ):
        raise error(f"{name} must be a finite number >= {minimum:g}, got {value!r}")


def check_id_list(name: str, ids: object, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, or a ValueError/TypeError naming ``name``: a sequence
    or 1-D integer tensor (or array) of ids in [0, vocab_size), what a tokenizer's
    ``decode`` takes."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(
            f"{name} must be a list or 1-D tensor of token ids, got {type(ids).__name__}"
        )
    if getattr(ids, "ndim", 1) != 1:
        raise ValueError(
            f"{name} must be 1-D (one sequence), got shape {tuple(ids.shape)}; "
            f"decode each row of a batch on its own"
        )
    dtype = getattr(ids, "dtype", None)  # a torch tensor's or a numpy array's
    if dtype is not None and not str(dtype).removeprefix("torch.").startswith(
        ("int", "uint")
    ):
        raise TypeError(f"{name} must hold integer ids, got dtype {dtype}")
    out = [int(i) if dtype is not None else i for i in ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        bad = next(i for i in out if not isinstance(i, int) or isinstance(i, bool))
        raise TypeError(f"{name} must hold integer ids, got {bad!r}")
    wrong = [i for i in out if not 0 <= i < vocab_size]
    if wrong:
        raise ValueError(
            f"{name} must lie in [0, vocab_size={vocab_size}), got {wrong[:5]}"
        )
    return out


def check_text(name: str, text: object) -> str:
    """``text``, or a TypeError naming ``name`` unless it is a str."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    return text


def check_targets(targets: Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """Raise a ValueError naming ``targets`` unless each is a class id in [0,
    vocab_size) or ``ignore_index`` (an id out of range would index past the logits:
    an IndexError on a CPU, a device-side assert on a GPU)."""
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"targets must be int64 or int32 class ids, got {targets.dtype}"
        )
    keep = targets[targets != ignore_index]
    if keep.numel() and bool((keep < 0).any() | (keep >= vocab_size).any()):
        raise ValueError(
            f"targets must lie in [0, vocab_size={vocab_size}) or be ignore_index="
            f"{ignore_index}, got ids in [{int(keep.min())}, {int(keep.max())}]"
        )


def read_checked(path: Path | str, kind: str, read: Callable[[str], T]) -> T:
    """``read(path)``, where a missing file raises FileNotFoundError and an empty or
    malformed one ``ValueError("not a valid <kind> file: <path> ...")``.

    The readers of GGUF, safetensors and tokenizer files fail on a bad file in many
    ways (reshape errors, mmap errors, index errors, their own exceptions); this gives
    one message that names the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no {kind} file at {p}")
    if p.stat().st_size == 0:
        raise ValueError(f"not a valid {kind} file: {p} (it is empty)")
    try:
        return read(str(p))
    except Exception as err:  # any failure of the reader means a bad file
        raise ValueError(
            f"not a valid {kind} file: {p} ({type(err).__name__}: {err})"
        ) from err


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
