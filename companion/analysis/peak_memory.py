"""Peak memory of a piece of code, on CUDA, MPS or CPU (chapter 02).

``with PeakMemory(device) as pm: ...`` then ``pm.peak_bytes`` is the highest number of
bytes held at once by tensors allocated inside the block, on ``device``, over what was
live at entry (tensors created before entry do not count).

On CUDA this is the caching allocator's own counter. On CPU and MPS there is no such
counter, so a :class:`~torch.utils._python_dispatch.TorchDispatchMode` watches every op:
each output storage not seen before adds its bytes, and a ``weakref.finalize`` on the
storage object subtracts them when it is freed. (PyTorch keeps a storage's Python object
alive exactly as long as the storage itself, so the finalizer fires at the real free.)
The count is of tensor bytes, not allocator overhead, and is deterministic: the same
code gives the same number.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemory"]


def _storage(x: object) -> torch.UntypedStorage | None:
    """The storage behind a dense tensor; None for anything else."""
    if isinstance(x, torch.Tensor) and x.layout == torch.strided:
        return x.untyped_storage()
    return None


class _LiveBytes(TorchDispatchMode):
    """Running and peak total of bytes in storages created on one device type."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, int] = {}  # storage id (its C pointer) -> bytes
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            s._cdata
            for s in map(_storage, tree_leaves((args, kwargs)))
            if s is not None
        }
        for x in tree_leaves(out):
            storage = _storage(x)
            if storage is None or storage.device.type != self.device_type:
                continue
            key = storage._cdata
            if (
                key in inputs or key in self.live
            ):  # a view or an in-place result: no new bytes
                continue
            self.live[key] = storage.nbytes()
            self.current += self.live[key]
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out


class PeakMemory:
    """Context manager: ``peak_bytes`` is the peak extra memory used inside the
    block."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._mode: _LiveBytes | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveBytes(self.device.type)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is None:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
            self._mode = None

    @property
    def peak_mib(self) -> float:
        """``peak_bytes`` in MiB."""
        return self.peak_bytes / 2**20
