"""Argument checks shared by every layer: each error names the argument, what it got and
what is allowed."""

from __future__ import annotations

import math
import numbers
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
    if targets.numel() and not keep.numel():
        raise ValueError(
            f"targets: every target equals ignore_index={ignore_index}, so the mean "
            "loss is over no tokens (NaN); pass at least one target in [0, vocab_size)"
        )
    if keep.numel() and bool((keep < 0).any() | (keep >= vocab_size).any()):
        raise ValueError(
            f"targets must lie in [0, vocab_size={vocab_size}) or be ignore_index="
            f"{ignore_index}, got ids in [{int(keep.min())}, {int(keep.max())}]"
        )


def check_tensor(
    name: str,
    value: object,
    shape: tuple[int | None, ...],
    *,
    legend: str,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise an error naming ``name`` unless ``value`` is a tensor of ``shape`` (None:
    any size), one of ``dtypes`` and on ``device``; ``legend`` names the axes, e.g.
    ``"(B, H_kv, T, D)"``. Shapes, dtypes and devices only: no value is read."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    got = tuple(value.shape)
    if len(got) != len(shape) or any(
        w is not None and g != w for g, w in zip(got, shape, strict=False)
    ):
        axes = legend.strip("()").split(", ")
        want = ", ".join(
            a if w is None else str(w) for a, w in zip(axes, shape, strict=True)
        )
        raise ValueError(
            f"{name} must have shape ({want}), got {got}; the axes are {legend}"
        )
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device} but must be on {device}")


def check_dtypes_match(**tensors: Tensor | None) -> None:
    """Raise a ValueError naming every tensor unless the given ones (None: absent)
    share one dtype."""
    given = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(given.values())) > 1:
        names = ", ".join(given)
        got = ", ".join(
            f"{n} {str(d).removeprefix('torch.')}" for n, d in given.items()
        )
        raise ValueError(f"{names} must share one dtype, got {got}")


def check_cache_buffers(
    cache: object,
    kinds: tuple[type, ...],
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype | None]],
    device: torch.device,
    hint: str,
) -> None:
    """Raise an error naming ``cache`` unless it is one of ``kinds`` whose buffers have
    the given shapes and dtypes (None: any) and lie on ``device``: a cache this layer
    could have made. ``hint`` says how to make the right one. Shapes, dtypes and devices
    only: no value is read (a cache that stores a buffer in another form, a quantised
    one, describes it through its ``layout(name)``)."""
    if not isinstance(cache, kinds):
        allowed = " or ".join(k.__name__ for k in kinds)
        raise TypeError(
            f"cache must be a {allowed} from {hint}, got {type(cache).__name__}"
        )
    for name, (shape, dtype) in buffers.items():
        layout = getattr(cache, "layout", None)
        buf = getattr(cache, name) if layout is None else layout(name)
        kind = type(cache).__name__
        if tuple(buf.shape) != shape or (dtype is not None and buf.dtype != dtype):
            want = f"{shape}" + ("" if dtype is None else f" of {dtype}")
            raise ValueError(
                f"cache is a {kind} whose {name} is {tuple(buf.shape)} of {buf.dtype}, "
                f"but this layer needs {want}: make it with {hint}"
            )
        if buf.device != device:
            raise ValueError(
                f"cache holds {name} on {buf.device} but the layer is on {device}"
            )


FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_cache_update(
    input_pos: Tensor,
    new: dict[str, tuple[Tensor, Tensor]],
    *,
    axis: int,
    legend: str,
    max_len: int | None,
) -> None:
    """Raise an error naming the argument of a cache's ``update`` that does not fit it,
    before anything is written: ``input_pos`` a 1-D int64 tensor of positions in [0,
    max_len) (None: any position >= 0, a ring buffer), and each new tensor ``name:
    (tensor, the buffer it goes into)`` floating point, shaped like its buffer with T
    new tokens on ``axis`` (``legend`` names the axes), all on the buffer's device.

    The positions' values are read only where that is free: on a CPU and outside
    ``torch.compile`` (a model's decode step takes them from ``DecodeCache.positions``,
    which checks its count).
    """
    device = next(iter(new.values()))[1].device
    check_tensor("input_pos", input_pos, (None,), legend="(T,)",
                 dtypes=(torch.int64,), device=device)  # fmt: skip
    t = input_pos.shape[0]
    for name, (value, buf) in new.items():
        shape = tuple(t if i == axis else n for i, n in enumerate(buf.shape))
        check_tensor(name, value, shape, legend=legend, dtypes=FLOATS, device=device)
    if t and input_pos.device.type == "cpu" and not torch.compiler.is_compiling():
        low, high = int(input_pos.min()), int(input_pos.max())
        if low < 0 or (max_len is not None and high >= max_len):
            allowed = ">= 0" if max_len is None else f"[0, max_len={max_len})"
            raise ValueError(
                f"input_pos must hold positions {allowed}, got [{low}, {high}]"
                + ("" if max_len is None else "; make the cache with a larger max_len")
            )


def check_finite_lr(schedule: str, step: int, lr: object) -> float:
    """``lr``, or a ValueError naming ``schedule`` and ``step`` unless it is a finite
    number (a NaN or infinite learning rate would wreck every weight in one step)."""
    if (
        isinstance(lr, bool)
        or not isinstance(lr, numbers.Real)
        or not math.isfinite(lr)
    ):
        raise ValueError(
            f"the learning-rate schedule {schedule} returned {lr!r} at step {step}; "
            "it must return a finite number"
        )
    return lr


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
