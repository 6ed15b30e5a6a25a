"""Where tensors live: the one place that picks device and dtype (used by every
chapter).

Chapters call :func:`default_device` and :func:`default_dtype` once and pass the results
on; nothing else in ``companion`` assumes CUDA.
"""

from __future__ import annotations

import os

import torch

from companion.checks import check_choice

__all__ = ["bf16_supported", "default_device", "default_dtype", "describe"]

_DEVICES = ("cuda", "mps", "cpu")


def default_device(prefer: str | None = None) -> torch.device:
    """Return the best available device: CUDA, then Apple MPS, then CPU.

    ``prefer`` (or the environment variable ``COMPANION_DEVICE``) forces one of
    ``"cuda"``, ``"mps"`` or ``"cpu"``; asking for one that is absent raises.
    """
    choice = prefer or os.environ.get("COMPANION_DEVICE")
    if choice is not None:
        check_choice("device", choice, _DEVICES)
        if choice == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "device 'cuda' was requested but torch.cuda.is_available() is False"
            )
        if choice == "mps" and not torch.backends.mps.is_available():
            raise RuntimeError(
                "device 'mps' was requested but torch.backends.mps is not available"
            )
        return torch.device(choice)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def bf16_supported(device: torch.device | str) -> bool:
    """True where bfloat16 matmuls run natively (Ampere+ CUDA, recent MPS); False on CPU
    here and on a CUDA GPU that would only emulate it (a Turing T4)."""
    device = torch.device(device)
    if device.type == "cuda":
        # native only: a T4 (sm_75) emulates bf16, slower than fp32
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "mps":
        try:
            torch.ones(1, dtype=torch.bfloat16, device=device)
        except (RuntimeError, TypeError):
            return False
        return True
    return False


def default_dtype(device: torch.device | str, prefer_bf16: bool = True) -> torch.dtype:
    """bfloat16 on accelerators that support it (when ``prefer_bf16``), else float32."""
    if prefer_bf16 and bf16_supported(device):
        return torch.bfloat16
    return torch.float32


def describe(device: torch.device | str | None = None) -> str:
    """One line naming the device, dtype and torch version, for the top of a chapter."""
    device = torch.device(device) if device is not None else default_device()
    return f"torch {torch.__version__} on {device.type}, default dtype {default_dtype(device)}"
