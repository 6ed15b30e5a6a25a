"""The RoPE table of a layer, as a module built once with the model (chapters 05, 08).

Shape legend: T positions, F = R / 2 frequencies (R the rotated width). The functions it
calls are :mod:`companion.ops.rope`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.ops.rope import RopeScaling, rope_cos_sin, rope_frequencies

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """One layer's RoPE setting, fixed when the model is built: ``positions (T,)`` ->
    ``(cos, sin)``, each ``(T, F)`` in fp32.

    The table of all ``max_len`` positions is computed once per device (bit-identical to
    :func:`companion.ops.rope.rope_cos_sin` of the positions) and indexed, so a decode
    step reads one row. ``dynamic`` scaling depends on the sequence length and is
    computed at each call: its base grows once a call reaches past
    ``scaling.original_max_position_embeddings`` (the length trained at; None:
    ``max_len``, so it never grows), as transformers' grows past the config's
    ``max_position_embeddings``. The module holds no parameters and no buffers: casting a
    model to bf16 leaves it in fp32, and one instance can serve every layer that shares
    the setting.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        scaling: RopeScaling | None = None,
        partial_rotary_factor: float = 1.0,
        max_len: int = 2048,
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_len = head_dim, theta, max_len
        self.scaling, self.partial_rotary_factor = scaling, partial_rotary_factor
        self.dynamic = scaling is not None and scaling.rope_type == "dynamic"
        trained = scaling.original_max_position_embeddings if self.dynamic else None
        self.trained_len = trained or max_len  # where dynamic scaling starts to grow
        with torch.device("cpu"):  # real numbers, even when a model is built on "meta"
            self.inv_freq, self.attention_scale = rope_frequencies(
                head_dim, theta, scaling, partial_rotary_factor, max_len
            )
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin ``(T, F)`` of ``positions`` (integers in ``[0, max_len)``)."""
        if self.dynamic:  # the base grows with the sequence: no fixed table
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
            inv, scale = rope_frequencies(
                self.head_dim,
                self.theta,
                self.scaling,
                self.partial_rotary_factor,
                self.trained_len,
                seq_len=seq_len,
            )
            return rope_cos_sin(positions, inv, scale)
        device = positions.device
        if device not in self._tables:
            every = torch.arange(self.max_len, device=device)
            self._tables[device] = rope_cos_sin(
                every, self.inv_freq, self.attention_scale
            )
        cos, sin = self._tables[device]
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}, "
            f"partial_rotary_factor={self.partial_rotary_factor}, max_len={self.max_len}"
        )
