"""Triton kernels for the book's fast paths (chapters 02, 06 and 11), an optional extra.

Each kernel module sits beside the PyTorch form it speeds up and keeps that form's
signature, so the two are tested against each other forward and backward. The kernels
need the ``gpu`` extra (``pip install -e ".[gpu]"``, Linux only) and run in one of two
ways:

- compiled, on tensors on a CUDA GPU (the real thing);
- interpreted, on CPU tensors, when ``TRITON_INTERPRET=1`` is set before the kernel
  module is imported: Triton then runs each program instance with NumPy, slowly but
  exactly as written. The unit tests and the chapters use this on machines without a GPU.

Importing this package does not import Triton; :func:`check_triton` raises a clear error
where a kernel cannot run (no Triton, Apple MPS, a CPU tensor without the interpreter).
Backends stay explicit: a caller asks for ``impl="triton"``; nothing falls back silently.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

__all__ = ["check_triton", "interpret_on_cpu", "interpreting", "triton_available"]


def triton_available() -> bool:
    """True where the ``triton`` package can be imported (it need not find a GPU)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True where Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels then take
    CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpret_on_cpu() -> bool:
    """Turn the interpreter on when no CUDA GPU is present; return whether it is on.

    Call it before ``triton`` is first imported (``torch.utils.flop_counter`` imports it):
    Triton reads the switch when it defines its own helpers and each kernel, and a raise
    says so if it is too late. On a CUDA machine it changes nothing, so kernels compile.
    """
    if not torch.cuda.is_available() and not interpreting():
        if "triton" in sys.modules:
            raise RuntimeError(
                "interpret_on_cpu() must run before triton is imported (torch's flop "
                "counter imports it): call it first"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreting()


def check_triton(name: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error unless the kernel ``name`` can run on ``tensors``."""
    if not triton_available():
        raise RuntimeError(
            f"{name} needs Triton: pip install -e '.[gpu]' (Linux), or pick another impl"
        )
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {devices}")
    (device,) = devices
    if device == "cuda":
        if interpreting():
            raise RuntimeError(
                f"{name}: TRITON_INTERPRET=1 runs kernels on CPU tensors only; unset it "
                "to compile for the GPU"
            )
        return
    if device == "cpu" and interpreting():
        return
    if device == "cpu":
        raise RuntimeError(
            f"{name} runs on a CUDA GPU, or on CPU tensors under Triton's interpreter "
            "(TRITON_INTERPRET=1 before the kernels are imported; slow, for tests)"
        )
    raise RuntimeError(
        f"{name}: Triton has no backend for device {device!r}; use a CUDA GPU or "
        "another impl"
    )
