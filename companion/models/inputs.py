"""The input guard of the models' public entry points (chapters 02-13): token ids and
masks.

Every model checks its inputs here before any layer runs, so a bad call fails with a
message that names the argument and what it allows, and changes nothing (a decode cache
included: see :meth:`companion.models.decoder.DecoderLM.check_cache`).
"""

from __future__ import annotations

import torch

__all__ = ["check_mask", "check_token_ids"]


def check_token_ids(
    ids: object,
    name: str,
    vocab_size: int,
    max_len: int,
    start: int = 0,
    device: torch.device | None = None,
    vocab_name: str = "vocab_size",
) -> None:
    """Raise naming ``name`` unless ``ids`` is a non-empty (B, T) integer tensor of ids
    in [0, vocab_size) (the field ``vocab_name``), on ``device`` if given, whose last
    position (``start`` + T) fits in ``max_len``: a TypeError for a wrong type or dtype,
    else a ValueError."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids with shape (B, T), got "
            f"{type(ids).__name__}; e.g. torch.tensor([[1, 2, 3]])"
        )
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32 token ids, got {ids.dtype}")
    if ids.ndim != 2 or 0 in ids.shape:
        raise ValueError(
            f"{name} must have shape (B, T) with B, T >= 1, got {tuple(ids.shape)}"
        )
    if device is not None and ids.device != device:
        raise ValueError(
            f"{name} is on {ids.device} but the model is on {device}; move the ids "
            f"with {name}.to({str(device)!r})"
        )
    t = start + ids.shape[1]
    if t > max_len:
        raise ValueError(
            f"{name} reaches {t} tokens but the model's context is max_seq_len={max_len}; "
            "shorten the prompt"
        )
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"{name} must lie in [0, {vocab_name}={vocab_size}), got ids in "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


def check_mask(mask: object, name: str, ids: torch.Tensor) -> None:
    """Raise naming ``name`` unless ``mask`` is a tensor of 0/1 (or bool) values with
    the shape and device of ``ids`` (B, T): no broadcasting, so a (1, T) mask for a
    batch of two is an error, not a silent copy."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape {tuple(ids.shape)} (1: a real "
            f"token, 0: padding), got {type(mask).__name__}"
        )
    if mask.dtype.is_complex:
        raise TypeError(f"{name} must hold 0/1 or bool values, got {mask.dtype}")
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"{name} must have the shape of its ids {tuple(ids.shape)}, got "
            f"{tuple(mask.shape)}"
        )
    if mask.device != ids.device:
        raise ValueError(f"{name} is on {mask.device} but its ids on {ids.device}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1")
