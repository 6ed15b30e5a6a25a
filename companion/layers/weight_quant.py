"""Weight-only quantised linear layers (chapter 16): int8 per output channel, and the
blocks of 32 that llama.cpp's GGUF files store (Q4_1, Q8_0), kept as the file has them.

Decoding one token reads every weight once, so at batch 1 its speed is bytes over
bandwidth; these layers store fewer bytes per weight and turn them back into numbers
only inside the product. Shape legend: ``O`` output features, ``I`` input features,
``N = I / 32`` blocks per row.

* :class:`Int8Linear`: ``w = s_o · q`` with ``q`` int8 in [-127, 127] and one fp32 scale
  ``s_o = max|w_o| / 127`` per output row: 1 byte per weight (plus 4 per row).
* :class:`BlockLinear` holds a GGUF tensor's raw bytes ``(O, N, block bytes)``:

  - ``Q4_1``, 20 bytes per block: fp16 ``d``, fp16 ``m``, then 16 bytes whose low nibbles
    are codes 0-15 and high nibbles codes 16-31: ``w = d · q + m`` (5 bits per weight);
  - ``Q8_0``, 34 bytes per block: fp16 ``d``, then 32 int8 codes: ``w = d · q``.

Two forms compute the same product. The reference dequantises the weight to the input's
dtype and calls ``F.linear`` (any number of rows). The decode form, for one row inside
``torch.compile``, multiplies codes by inputs and sums per block, so the generated loop
reads each stored byte once; ``F.linear`` on a dequantised weight would first write the
full fp32 weight and read it back. :func:`quantize_linears` puts ``Int8Linear`` in
place of a model's ``nn.Linear`` layers; ``load_smollm2(blocks=True)`` builds
``BlockLinear`` layers from the file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_choice

__all__ = [
    "BLOCK_FORMATS",
    "BlockLinear",
    "Int8Linear",
    "block_matvec",
    "dequantize_blocks",
    "int8_matvec",
    "quantize_linears",
    "stored_weight_bytes",
]

BLOCK = 32  # weights per GGUF block
BLOCK_FORMATS = {"Q4_1": 20, "Q8_0": 34}  # bytes per block of 32


def _halves(raw: Tensor, start: int) -> Tensor:
    """The fp16 number at byte ``start`` of every block, as fp32 ``(O, N, 1)``."""
    return raw[..., start : start + 2].contiguous().view(torch.float16).float()


def _codes(raw: Tensor, fmt: str) -> Tensor:
    """Every block's 32 codes in weight order, as uint8 (Q4_1) or int8 (Q8_0)."""
    if fmt == "Q8_0":
        return raw[..., 2:].contiguous().view(torch.int8)
    qs = raw[..., 4:]
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def dequantize_blocks(
    raw: Tensor, fmt: str, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The ``(O, N · 32)`` weight that a GGUF tensor's blocks ``(O, N, bytes)`` encode."""
    check_choice("fmt", fmt, tuple(BLOCK_FORMATS))
    w = _codes(raw, fmt).float() * _halves(raw, 0)
    if fmt == "Q4_1":
        w = w + _halves(raw, 2)
    return w.reshape(raw.shape[0], -1).to(dtype)


def block_matvec(x: Tensor, raw: Tensor, fmt: str) -> Tensor:
    """``x (…, I) @ W.T`` for one row, from the blocks: per block, ``d · Σ q x`` (plus
    ``m · Σ x`` for Q4_1), then summed over blocks. Meant for ``torch.compile``."""
    n = raw.shape[1]
    xb = x.reshape(n, BLOCK)
    d = _halves(raw, 0)[..., 0]  # (O, N)
    if fmt == "Q8_0":
        dot = (raw[..., 2:].view(torch.int8).to(x.dtype) * xb).sum(-1)
        return (d * dot).sum(-1).reshape(*x.shape[:-1], -1).to(x.dtype)
    qs = raw[..., 4:]
    dot = ((qs & 15).to(x.dtype) * xb[:, :16]).sum(-1)
    dot = dot + ((qs >> 4).to(x.dtype) * xb[:, 16:]).sum(-1)
    y = (d * dot + _halves(raw, 2)[..., 0] * xb.sum(-1)).sum(-1)
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def int8_matvec(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``x (…, I) @ W.T`` for one row, from int8 codes: ``s_o · Σ q x``."""
    y = (q.to(x.dtype) * x.reshape(1, -1)).sum(-1) * scale
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _one_row_compiled(x: Tensor, in_features: int) -> bool:
    """Whether the decode form applies: one input row, traced by ``torch.compile``."""
    return torch.compiler.is_compiling() and x.numel() == in_features


class BlockLinear(nn.Module):
    """A bias-free linear layer whose weight is a GGUF tensor's raw blocks."""

    def __init__(self, raw: Tensor, fmt: str) -> None:
        super().__init__()
        check_choice("fmt", fmt, tuple(BLOCK_FORMATS))
        if (
            raw.dtype != torch.uint8
            or raw.dim() != 3
            or raw.shape[-1] != BLOCK_FORMATS[fmt]
        ):
            raise ValueError(
                f"raw must be uint8 (O, N, {BLOCK_FORMATS[fmt]}) blocks for {fmt}, got "
                f"{raw.dtype} {tuple(raw.shape)}"
            )
        self.fmt = fmt
        self.out_features, self.in_features = raw.shape[0], raw.shape[1] * BLOCK
        self.register_buffer("raw", raw.contiguous())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the dequantised weight, fp32 (the input's in ``forward``)."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def weight_fp32(self) -> Tensor:
        """The dequantised weight ``(O, I)``."""
        return dequantize_blocks(self.raw, self.fmt)

    def forward(self, x: Tensor) -> Tensor:
        if _one_row_compiled(x, self.in_features):
            return block_matvec(x, self.raw, self.fmt)
        return F.linear(x, dequantize_blocks(self.raw, self.fmt, x.dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fmt={self.fmt}"


class Int8Linear(nn.Module):
    """A bias-free linear layer with an int8 weight and one fp32 scale per output row."""

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != q.shape[:1]:
            raise ValueError(
                f"q must be int8 (O, I) and scale (O,), got {q.dtype} {tuple(q.shape)} "
                f"and {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Round ``linear.weight`` to the nearest of 255 levels per row (absmax / 127)."""
        if linear.bias is not None:
            raise ValueError("Int8Linear has no bias; the linear layer given has one")
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.to(w.device), scale)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the dequantised weight, the scales' (fp32 unless cast)."""
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def weight_fp32(self) -> Tensor:
        """The dequantised weight ``(O, I)``."""
        return self.q.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if _one_row_compiled(x, self.in_features):
            return int8_matvec(x, self.q, self.scale)
        return F.linear(x, self.weight_fp32().to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}"


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every bias-free ``nn.Linear`` of ``model`` by an :class:`Int8Linear`, in
    place (a tied output head gets its own int8 copy; the embedding keeps its table).
    Linear layers with a bias are left as they are. Returns ``model``."""
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.bias is None
    ]
    for name, m in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int8Linear.from_linear(m))
    return model


def stored_weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads for the matrix products: every linear layer's stored
    weight (codes, scales, blocks), float or quantised; embeddings are not counted (a
    step reads one row of the table)."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (Int8Linear, BlockLinear)):
            total += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
    return total
