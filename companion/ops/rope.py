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
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``): one
division for ``linear``, else :func:`dynamic_ntk_theta`, :func:`yarn_inv_freq` (with
:func:`yarn_mscale`) or :func:`llama3_inv_freq` on the plain :func:`base_inv_freq`.
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
    "base_inv_freq",
    "dynamic_ntk_theta",
    "llama3_inv_freq",
    "rope_cos_sin",
    "rope_frequencies",
    "yarn_inv_freq",
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
            needed = ("low_freq_factor", "high_freq_factor")
            needed += ("original_max_position_embeddings",)
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


def base_inv_freq(rotary_dim: int, theta: float) -> Tensor:
    """Plain RoPE's speeds: ω_f = θ^(−2f/R) radians per token, f = 0 .. R/2 − 1."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exps)


def _check_stretch(trained_len: object, **factors: object) -> None:
    """Raise a ValueError naming the argument unless ``trained_len`` is an int >= 1 and
    each factor a finite number > 0: the checks the scaling functions share."""
    check_int("the trained length", trained_len, 1)
    for name, value in factors.items():
        check_positive(name, value)
        check_number(name, value)


def dynamic_ntk_theta(
    theta: float, rotary_dim: int, factor: float, trained_len: int, seq_len: int
) -> float:
    """The base of dynamic ("NTK-aware") scaling for a ``seq_len``-token text.

    Past ``trained_len`` the base grows to θ·s^(R/(R−2)), s = factor·seq_len/trained_len
    − (factor − 1): the fastest pair keeps its speed, the slowest turns s times slower.
    """
    _check_stretch(trained_len, factor=factor)
    stretch = factor * max(seq_len, trained_len) / trained_len - (factor - 1)
    return theta * stretch ** (rotary_dim / (rotary_dim - 2))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's logit sharpening for a text ``factor`` times longer: 0.1·m·ln(s) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(
    inv_freq: Tensor,
    theta: float,
    factor: float,
    orig_len: int,
    beta_fast: float = 32,
    beta_slow: float = 1,
    truncate: bool = True,
) -> Tensor:
    """YaRN's speeds for a text ``factor`` times longer than ``orig_len`` tokens.

    A pair that turns ``beta_fast`` times or more within ``orig_len`` tokens keeps its
    speed, one that turns fewer than ``beta_slow`` times is slowed ``factor`` times, and
    a linear ramp over the pair index blends those between (its ends rounded outward to
    whole pairs when ``truncate``). The logits are sharpened by :func:`yarn_mscale`.
    """
    _check_stretch(orig_len, factor=factor, beta_fast=beta_fast, beta_slow=beta_slow)
    half = len(inv_freq)  # F pairs; pair f turns orig_len · θ^(−f/F) / 2π times

    def pair_turning(n: float) -> float:  # the (fractional) pair that turns n times
        return half * math.log(orig_len / (n * 2 * math.pi)) / math.log(theta)

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, 2 * half - 1)  # R − 1, as in transformers
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: leave ω alone (extrapolate), 0: ω / factor (interpolate)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def llama3_inv_freq(
    inv_freq: Tensor,
    factor: float,
    orig_len: int,
    low_freq_factor: float,
    high_freq_factor: float,
) -> Tensor:
    """Llama 3.1's speeds: a pair whose wavelength exceeds ``orig_len /
    low_freq_factor`` tokens is slowed ``factor`` times, one shorter than ``orig_len /
    high_freq_factor`` keeps its speed, and those between are blended by how many times
    they turn within ``orig_len``."""
    low, high = low_freq_factor, high_freq_factor
    _check_stretch(orig_len, factor=factor, low_freq_factor=low, high_freq_factor=high)
    wavelen = 2 * math.pi / inv_freq  # tokens per turn
    scaled = torch.where(wavelen > orig_len / low, inv_freq / factor, inv_freq)
    smooth = (orig_len / wavelen - low) / (high - low)  # 0: slow end, 1: fast end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig_len / high) & (wavelen <= orig_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_attention(p: RopeScaling, factor: float) -> float:
    """YaRN's cos/sin scale: ``attention_factor`` if given, else from the mscales."""
    if p.attention_factor is not None:
        return float(p.attention_factor)
    if p.mscale and p.mscale_all_dim:
        return yarn_mscale(factor, p.mscale) / yarn_mscale(factor, p.mscale_all_dim)
    return float(yarn_mscale(factor))


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
    kind, trained = p.rope_type, max_position_embeddings
    if kind == "dynamic":
        n = seq_len or trained
        theta = dynamic_ntk_theta(theta, rotary_dim, p.factor, trained, n)
        return base_inv_freq(rotary_dim, theta), 1.0
    inv_freq = base_inv_freq(rotary_dim, theta)
    if kind == "linear":
        return inv_freq / p.factor, 1.0
    if kind == "yarn":
        orig = p.original_max_position_embeddings or trained
        factor = p.factor or trained / orig
        fast, slow = p.beta_fast or 32, p.beta_slow or 1
        inv_freq = yarn_inv_freq(inv_freq, theta, factor, orig, fast, slow, p.truncate)
        return inv_freq, _yarn_attention(p, factor)
    if kind == "llama3":
        orig = p.original_max_position_embeddings
        low, high = p.low_freq_factor, p.high_freq_factor
        return llama3_inv_freq(inv_freq, p.factor, orig, low, high), 1.0
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
