"""Argument checks shared by every layer: each error names the argument, what it got and
what is allowed."""

from __future__ import annotations

__all__ = ["check_choice", "check_int", "check_positive"]


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


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
