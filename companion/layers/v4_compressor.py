"""DeepSeek-V4's key compressor: token rows pooled into one entry per block; with a
:class:`~companion.layers.v4_cache.CompressorState` decoding continues a block across
calls.

Shape legend: B batch, T new tokens, d model width, m ``ratio``, D entry width, W row
width (D, or 2D with ``overlap``), N entries (``max_len // m`` in a cache), R rotated
channels, F = R / 2 RoPE frequencies.

Each token is projected to a row ``kv_proj(x) (W,)`` and gate logits ``gate_proj(x)
(W,)``; every complete block of m tokens is pooled by
:func:`companion.ops.compressed_attention.blocked_compress`, RMS-normalised
(``kv_norm``) and rotated at the position of the block's first token, w·m. V4 rotates
the *last* R channels of a vector (its layout is ``[nope | rope]``) with interleaved
pairs: :func:`rope_tail`.

Parameter names and shapes equal those of transformers' ``DeepseekV4HCACompressor``
(``overlap=False``) and ``DeepseekV4CSACompressor`` (``overlap=True``, with its
``indexer`` passed in): ``kv_proj.weight (W, d)``, ``gate_proj.weight (W, d)``,
``position_bias (m, W)``, ``kv_norm.weight (D,)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.layers.norms import RMSNorm
from companion.layers.rotary import RotaryEmbedding
from companion.layers.v4_cache import CompressorState
from companion.ops.compressed_attention import blocked_compress
from companion.ops.rope import apply_rope

__all__ = ["Compressor", "rope_tail"]


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the last R = 2F channels of ``x (..., D)`` with interleaved pairs (2f, 2f
    + 1); the leading D − R channels pass through. ``cos, sin`` broadcast to ``(..., F)``;
    ``-sin`` undoes the rotation."""
    r = 2 * cos.shape[-1]
    rot = apply_rope(x[..., -r:], cos, sin, layout="interleaved")
    return torch.cat([x[..., :-r], rot], dim=-1)


class Compressor(nn.Module):
    """``x (B, T, d)`` of positions ``start .. start + T − 1`` -> compressed entries
    ``(B, N, D)``.

    Without a state the tokens are a whole sequence from position 0 and the result holds
    its ``T // m`` complete blocks. With a state the open block's earlier rows (and, with
    overlap, the block before it) come from the state, the new rows and entries are
    written into it, and the result is all ``max_len // m`` entry rows (a query must not
    read those of blocks not yet complete:
    :func:`~companion.ops.compressed_attention.visible_entries`).
    """

    def __init__(
        self,
        d_model: int,
        head_dim: int,
        ratio: int,
        *,
        overlap: bool,
        rope: RotaryEmbedding,
        norm_eps: float = 1e-6,
        indexer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if 2 * rope.inv_freq.numel() > head_dim:
            raise ValueError(
                f"the RoPE table rotates {2 * rope.inv_freq.numel()} channels, more "
                f"than head_dim={head_dim}"
            )
        self.head_dim, self.ratio, self.overlap, self.rope = (
            head_dim,
            ratio,
            overlap,
            rope,
        )
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(d_model, width, bias=False)
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(head_dim, eps=norm_eps)
        self.indexer = indexer  # CSA's lightning indexer (its own compressor), or None

    def new_state(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> CompressorState:
        """An empty :class:`~companion.layers.v4_cache.CompressorState` for ``batch``
        sequences of ``max_len``."""
        w = self.kv_proj.weight
        return CompressorState(
            batch,
            max_len,
            self.ratio,
            self.kv_proj.out_features,
            self.head_dim,
            overlap=self.overlap,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )

    def forward(
        self, x: Tensor, start: int = 0, state: CompressorState | None = None
    ) -> Tensor:
        """Entries ``(B, N, D)``, each normalised and rotated at its position w·m."""
        if state is None and start != 0:
            raise ValueError(
                f"without a state the tokens must start at position 0, got start={start}"
            )
        b, t, _ = x.shape
        m = self.ratio
        kv, gate = self.kv_proj(x), self.gate_proj(x)  # (B, T, W)
        first, end = start // m, (start + t) // m  # complete blocks: first .. end − 1
        prev_kv = prev_gate = None
        if state is not None:
            # the open block's rows seen in earlier calls, and the block before it
            seen = torch.arange(first * m, start, device=x.device) % state.slots
            rows_kv = torch.cat([state.kv[:, seen].to(kv.dtype), kv], dim=1)
            rows_gate = torch.cat([state.gate[:, seen].to(gate.dtype), gate], dim=1)
            if self.overlap and first > 0:
                before = torch.arange((first - 1) * m, first * m, device=x.device)
                prev_kv = state.kv[:, before % state.slots].to(kv.dtype)
                prev_gate = state.gate[:, before % state.slots].to(gate.dtype)
            keep = min(t, state.slots)  # then store the newest rows
            slots = torch.arange(start + t - keep, start + t, device=x.device)
            state.kv[:, slots % state.slots] = kv[:, t - keep :].to(state.kv.dtype)
            state.gate[:, slots % state.slots] = gate[:, t - keep :].to(
                state.gate.dtype
            )
        else:
            rows_kv, rows_gate = kv, gate
        n = end - first
        pooled = blocked_compress(
            rows_kv[:, : n * m],
            rows_gate[:, : n * m],
            self.position_bias,
            m,
            overlap=self.overlap,
            prev_kv=prev_kv,
            prev_gate=prev_gate,
        )  # (B, n, D)
        first_tokens = torch.arange(first, end, device=x.device) * m  # (n,)
        cos, sin = self.rope(first_tokens)  # (n, F)
        entries = rope_tail(self.kv_norm(pooled), cos, sin)
        if state is None:
            return entries
        state.entries[:, first:end] = entries.to(state.entries.dtype)
        return state.entries
