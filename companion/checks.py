"""Argument checks shared by every layer: each error names the argument, what it got and
what is allowed."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = [
    "check_choice",
    "check_int",
    "check_number",
    "check_positive",
    "read_checked",
]

T = TypeVar("T")


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
