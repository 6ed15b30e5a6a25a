"""companion: the runnable code behind the book "The Transformer, 2017 → 2026".

Each module is explained by a chapter (its docstring says which). Start with
:class:`companion.config.ModelConfig`, :class:`companion.model.DecoderLM` and
:func:`companion.device.default_device`.

Importing the package loads nothing else: the names below are imported on first use, so
``from companion.numerics import pin_cpu_path`` can run before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ConfigError, ModelConfig
    from .device import default_device, default_dtype
    from .model import DecoderLM

__version__ = "0.1.0"

_LAZY = {
    "ConfigError": "config",
    "ModelConfig": "config",
    "DecoderLM": "model",
    "default_device": "device",
    "default_dtype": "device",
}

__all__ = [
    "ConfigError",
    "DecoderLM",
    "ModelConfig",
    "__version__",
    "default_device",
    "default_dtype",
]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'companion' has no attribute {name!r}")
