"""Rotary position embeddings and their context-extension schemes (chapter 05).

Shape legend: T positions, D head width, R ≤ D rotated width
(``partial_rotary_factor``), F = R / 2 frequencies. RoPE turns each pair of channels of
q and k into a point in the plane and rotates it by ``position · ω_f``, so the q·k logit
depends only on the offset between the two positions.

Two pair layouts exist in released models: ``"half"`` pairs channel f with f + R/2 (HF
Llama, Qwen, Gemma), ``"interleaved"`` pairs 2f with 2f + 1 (the RoFormer paper, GPT-J,
Meta's original Llama code). :func:`apply_rope_reference` rotates with complex numbers
and is the definition; :func:`apply_rope` is the fast real-valued form; tests check they
agree.

:func:`rope_frequencies` returns ``(inv_freq (F,), attention_scale)`` for a base
``theta`` and an optional :class:`RopeScaling` whose fields are the keys released
configs use: ``linear`` (``factor``), ``dynamic`` (``factor``; NTK base stretch once the
sequence outgrows ``max_position_embeddings``), ``yarn`` (``factor``,
``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
``mscale_all_dim``, ``attention_factor``, ``truncate``) and ``llama3`` (``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from companion.checks import check_choice, check_int, check_number, check_positive

__all__ = [
    "LAYOUTS",
    "ROPE_TYPES",
    "RopeScaling",
    "apply_rope",
    "apply_rope_reference",
    "rope_cos_sin",
    "rope_frequencies",
    "yarn_mscale",
]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
LAYOUTS = ("half", "interleaved")


# fields that must be finite and > 0 when given; the mscales may be 0 (YaRN's "off")
_POSITIVE_FIELDS = (
    "factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "low_freq_factor",
    "high_freq_factor",
)


@dataclass(frozen=True)
class RopeScaling:
    """One context-extension setting of RoPE; frozen, so a config holding it hashes.

    ``rope_type`` is one of ``ROPE_TYPES``; the other fields are the keys of released
    configs (None: the scheme's default). Checked when built: ``linear``, ``dynamic``
    and ``llama3`` need a positive ``factor``, ``llama3`` its three other numbers.
    """

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self) -> None:
        kind = self.rope_type
        check_choice("rope_type", kind, ROPE_TYPES)
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                try:
                    check_positive(name, value)
                    check_number(name, value)
                except ValueError:
                    raise ValueError(
                        f"RopeScaling {name} must be a finite number > 0 (or None), got "
                        f"{value!r}"
                    ) from None
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0.0)
        n = self.original_max_position_embeddings
        if n is not None:
            check_int("original_max_position_embeddings", n, 1)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be True or False, got {self.truncate!r}")
        if kind in ("linear", "dynamic", "llama3") and self.factor is None:
            raise ValueError(f"rope_type {kind!r} needs a positive factor, got None")
        if kind == "llama3":
            needed = (
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            )
            missing = [name for name in needed if getattr(self, name) is None]
            if missing:
                raise ValueError(f"rope_type 'llama3' needs {missing}")

    @classmethod
    def from_mapping(cls, params: Mapping[str, object]) -> RopeScaling | None:
        """From a released config's dict (``type`` accepted for ``rope_type``); None for
        ``default``. Unknown keys raise, naming the known ones."""
        params = dict(params)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"unknown RoPE scaling key(s) {unknown}; known: {known}")
        if params.get("rope_type", "default") == "default":
            return None
        return cls(**params)  # type: ignore[arg-type]


def _base_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    """ω_f = θ^(−2f/R) for f = 0 .. R/2 − 1, in fp32."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exps)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's logit sharpening for a context stretched ``factor`` times: 0.1·m·ln(s) +
    1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(
    inv_freq: Tensor, rotary_dim: int, theta: float, p: RopeScaling, max_pos: int
) -> tuple[Tensor, float]:
    """YaRN: keep fast-rotating pairs, interpolate slow ones, ramp in between; scale
    logits."""
    orig = p.original_max_position_embeddings or max_pos
    factor = p.factor or max_pos / orig
    attn = p.attention_factor
    if attn is None:
        if p.mscale and p.mscale_all_dim:
            attn = yarn_mscale(factor, p.mscale) / yarn_mscale(factor, p.mscale_all_dim)
        else:
            attn = yarn_mscale(factor)
    beta_fast, beta_slow = p.beta_fast or 32, p.beta_slow or 1

    def pair_index(
        n_rotations: float,
    ) -> float:  # the pair that turns n times over `orig`
        return (
            rotary_dim
            * math.log(orig / (n_rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = (
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)
    ).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (leave ω alone), 0: interpolate (ω / factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attn)


def _llama3(inv_freq: Tensor, p: RopeScaling) -> Tensor:
    """Llama 3.1: divide long wavelengths by ``factor``, keep short ones, blend the
    middle."""
    factor, orig = p.factor, p.original_max_position_embeddings
    low_f, high_f = p.low_freq_factor, p.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low_f, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low_f) / (high_f - low_f)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / high_f) & (wavelen <= orig / low_f)
    return torch.where(medium, blended, scaled)


def rope_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
    partial_rotary_factor: float = 1.0,
    max_position_embeddings: int = 2048,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """Inverse frequencies ``(F,)`` and the attention (cos/sin) scale for one RoPE
    setting.

    ``seq_len`` matters only for ``dynamic``, whose base grows with the sequence.
    """
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"rotary width head_dim * partial_rotary_factor must be even and >= 2, got {rotary_dim}"
        )
    if scaling is not None and not isinstance(scaling, RopeScaling):
        raise TypeError(
            f"scaling must be a RopeScaling or None, got {type(scaling).__name__}"
        )
    p = RopeScaling("default") if scaling is None else scaling
    kind = p.rope_type
    if kind == "dynamic":
        n = max(seq_len or max_position_embeddings, max_position_embeddings)
        grow = (p.factor * n / max_position_embeddings - (p.factor - 1)) ** (
            rotary_dim / (rotary_dim - 2)
        )
        return _base_inv_freq(rotary_dim, theta * grow), 1.0
    inv_freq = _base_inv_freq(rotary_dim, theta)
    if kind == "linear":
        return inv_freq / p.factor, 1.0
    if kind == "yarn":
        return _yarn(inv_freq, rotary_dim, theta, p, max_position_embeddings)
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    return inv_freq, 1.0


def rope_cos_sin(
    positions: Tensor, inv_freq: Tensor, attention_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos and sin of ``position · ω``: each ``(..., T, F)``, times
    ``attention_scale``."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(
        positions.device
    )  # (..., T, F)
    return angles.cos() * attention_scale, angles.sin() * attention_scale


def _check(x: Tensor, cos: Tensor, layout: str) -> int:
    check_choice("layout", layout, LAYOUTS)
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(
            f"cos/sin cover {rotary_dim} channels but x has only {x.shape[-1]}"
        )
    return rotary_dim


def apply_rope_reference(
    x: Tensor, cos: Tensor, sin: Tensor, layout: str = "half"
) -> Tensor:
    """Rotate the pairs of ``x (..., T, D)`` as complex numbers; channels past R pass
    through."""
    rotary_dim = _check(x, cos, layout)
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if layout == "half":
        f = rotary_dim // 2
        z = torch.complex(rot[..., :f], rot[..., f:])  # pair (f, f + R/2)
    else:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])  # pair (2f, 2f + 1)
    z = z * torch.complex(cos, sin)  # multiply by e^{i·pos·ω}
    if layout == "half":
        out = torch.cat([z.real, z.imag], dim=-1)
    else:
        out = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "half") -> Tensor:
    """The same rotation with real arithmetic: ``x·cos + rotate(x)·sin``."""
    rotary_dim = _check(x, cos, layout)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if layout == "half":
        c, s = (
            torch.cat([cos, cos], dim=-1),
            torch.cat([sin, sin], dim=-1),
        )  # (..., T, R)
        x1, x2 = rot.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    else:
        c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], dim=-1).flatten(-2)
    out = rot * c.to(x.dtype) + turned * s.to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
