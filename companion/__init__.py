"""companion: the runnable code behind the book "The Transformer, 2017 → 2026".

Each module is explained by a chapter (its docstring says which). Start with
:class:`companion.config.ModelConfig`, :class:`companion.model.DecoderLM` and
:func:`companion.device.default_device`.
"""

from .config import ConfigError, ModelConfig
from .device import default_device, default_dtype
from .model import DecoderLM

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DecoderLM",
    "ModelConfig",
    "__version__",
    "default_device",
    "default_dtype",
]
