"""Recording what modules receive during a forward pass (chapters 02, 03, 05).

The attention maps the chapters draw come from one ordinary forward pass: hooks keep
each attention module's arguments, and the module's ``attention_weights`` recomputes its
softmax weights from them afterwards, so no second copy of the model's loop exists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

__all__ = ["recorded_inputs"]


@contextmanager
def recorded_inputs(modules: Sequence[nn.Module]) -> Iterator[list[tuple[tuple, dict]]]:
    """While active, append ``(args, kwargs)`` of every call to any of ``modules``, in
    call order, to the list it yields; the hooks are removed on exit, also after an
    error."""
    calls: list[tuple[tuple, dict]] = []

    def keep(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((args, kwargs))

    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in modules]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
