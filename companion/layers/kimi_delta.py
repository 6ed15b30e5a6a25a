"""Kimi Delta Attention (KDA): the linear-attention layer of Kimi Linear and of Ling's
Bailing hybrid, the gated delta rule with one forget rate per key channel (chapter 11).

Shape legend: B batch, T tokens, d model width, H heads, D head width (queries, keys and
values alike), K conv kernel, C_conv = 3·H·D conv channels. Per token the layer projects
``x`` to q, k, v (three projections), runs them through a short causal depthwise
convolution with SiLU; L2-normalises q and k (inside the op); sets ``β = σ(b_proj x)``
``(B, T, H)`` and a per-channel log-decay ``g (B, T, H, D) ≤ 0`` (the forget gate); runs
KDA (:func:`~companion.ops.delta_rule.chunk_kda`); normalises each head's output with an
RMSNorm gated by a sigmoid, ``rmsnorm(o)·w·σ(z)``, and projects back to d.

The forget gate adds ``dt_bias`` to a projection of x, ``f (B, T, H, D)``, and scales it
by ``A = exp(A_log)``, one rate per head:

* ``gate_lower_bound=None`` (Kimi Linear; Bailing with ``kda_safe_gate=False``):
  ``g = −A·softplus(f)``, any log-decay ``≤ 0``;
* ``gate_lower_bound=l < 0`` (Bailing's default ``kda_safe_gate=True``,
  ``kda_lower_bound=−5``): ``g = l·σ(A·f)`` in ``(l, 0)``, a bounded decay per token.

Parameters (names and shapes equal transformers' ``KimiLinearDeltaAttention`` and
``BailingHybridDeltaAttention``, so their state dicts load unchanged):

* common: ``q_proj``, ``k_proj``, ``v_proj`` ``.weight (H·D, d)``; ``conv1d.weight
  (C_conv, 1, K)`` (channels ``[q | k | v]``, no bias); ``forget_gate.dt_bias (H·D,)``;
  ``b_proj.weight (H, d)``; ``o_norm.weight (D,)``; ``o_proj.weight (d, H·D)``;
* ``layout="kimi"``: low-rank gates, ``forget_gate.f_a_proj.weight (D, d)``,
  ``forget_gate.f_b_proj.weight (H·D, D)``, ``g_a_proj.weight (D, d)``,
  ``g_b_proj.weight (H·D, D)``; ``forget_gate.A_log (1, 1, H, 1)``;
* ``layout="bailing"``: full-rank gates, ``forget_gate.f_proj.weight (H·D, d)``,
  ``g_proj.weight (H·D, d)``; ``forget_gate.A_log (H,)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_choice, check_int
from companion.layers.gated_deltanet import IMPLS, GatedDeltaNetCache, GatedRMSNorm
from companion.ops.delta_rule import chunk_kda, recurrent_kda

__all__ = ["KDA_LAYOUTS", "KDAForgetGate", "KimiDeltaAttention"]

# where the gates' parameters sit: "kimi" (low-rank f and output gates, A_log (1, 1, H, 1))
# or "bailing" (full-rank, A_log (H,))
KDA_LAYOUTS = ("kimi", "bailing")


class KDAForgetGate(nn.Module):
    """Per-channel log-decay ``g (B, T, H, D) ≤ 0`` from ``x (B, T, d)``, in fp32."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        layout: str = "kimi",
        lower_bound: float | None = None,
    ) -> None:
        super().__init__()
        check_choice("layout", layout, KDA_LAYOUTS)
        if lower_bound is not None and (
            isinstance(lower_bound, bool)
            or not isinstance(lower_bound, (int, float))
            or not -math.inf < lower_bound < 0
        ):
            raise ValueError(
                "lower_bound (KimiDeltaAttention's gate_lower_bound) must be None or a "
                f"finite negative number, got {lower_bound!r}"
            )
        self.n_heads, self.head_dim, self.lower_bound = n_heads, head_dim, lower_bound
        self.layout = layout
        width = n_heads * head_dim
        if layout == "kimi":
            self.f_a_proj = nn.Linear(d_model, head_dim, bias=False)
            self.f_b_proj = nn.Linear(head_dim, width, bias=False)
            a_shape: tuple[int, ...] = (1, 1, n_heads, 1)
        else:
            self.f_proj = nn.Linear(d_model, width, bias=False)
            a_shape = (n_heads,)
        # as fla and transformers initialise them: A ~ U(1, 16); dt_bias the inverse
        # softplus of dt, log-uniform in [1e-3, 1e-1]
        self.A_log = nn.Parameter(torch.empty(a_shape).uniform_(1, 16).log())
        dt = torch.empty(width).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        dt = dt.clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: Tensor) -> Tensor:
        if self.layout == "kimi":
            f = self.f_b_proj(self.f_a_proj(x))  # (B, T, H·D)
        else:
            f = self.f_proj(x)
        f = (f.float() + self.dt_bias.float()).unflatten(-1, (self.n_heads, -1))
        rate = self.A_log.float().exp().reshape(self.n_heads, 1)  # (H, 1)
        if self.lower_bound is None:
            return -rate * F.softplus(f)  # (B, T, H, D)
        return self.lower_bound * torch.sigmoid(rate * f)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer (Kimi Linear, Bailing hybrid): ``(B, T, d) -> (B, T, d)``.

    ``impl`` picks the op for every call, one-token decode steps included: ``"chunk"``
    (:func:`~companion.ops.delta_rule.chunk_kda`) or ``"recurrent"`` (the token loop
    reference). The cache is a :class:`~companion.layers.gated_deltanet.GatedDeltaNetCache`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-5,
        *,
        layout: str = "kimi",
        gate_lower_bound: float | None = None,
        impl: str = "chunk",
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("head_dim", head_dim),
            ("conv_kernel", conv_kernel),
            ("chunk_size", chunk_size),
        ):
            check_int(name, value, 1)
        # no KDA kernel: the Triton one takes one log-decay per head, not per channel
        check_choice("impl", impl, tuple(i for i in IMPLS if i != "triton"))
        # checks layout and gate_lower_bound
        self.forget_gate = KDAForgetGate(
            d_model, n_heads, head_dim, layout=layout, lower_bound=gate_lower_bound
        )
        self.d_model, self.h, self.dk = d_model, n_heads, head_dim
        self.layout, self.impl, self.chunk_size = layout, impl, chunk_size
        self.conv_kernel = conv_kernel
        width = n_heads * head_dim
        self.conv_dim = 3 * width
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        if layout == "kimi":  # the output gate, low rank
            self.g_a_proj = nn.Linear(d_model, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        else:
            self.g_proj = nn.Linear(d_model, width, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def new_cache(
        self,
        batch: int,
        max_len: int = 0,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GatedDeltaNetCache:
        """An empty cache for ``batch`` sequences, on this layer's device by default:
        ``conv_state (B, C_conv, K − 1)`` and ``recurrent_state (B, H, D, D)`` in fp32.
        Its size is fixed, whatever ``max_len`` (accepted so every token mixer is called
        alike)."""
        check_int("batch", batch, 1)
        w = self.conv1d.weight
        return GatedDeltaNetCache(
            batch,
            self.conv_dim,
            self.conv_kernel,
            self.h,
            self.dk,
            self.dk,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )

    def _check(self, x: Tensor, cache: GatedDeltaNetCache | None, mask: Tensor | None):
        """Raise a ValueError naming the argument that does not fit."""
        if mask is not None:
            raise ValueError("KDA layers take no attention mask: pass unpadded batches")
        if x.ndim != 3 or x.shape[-1] != self.d_model or x.shape[1] == 0:
            raise ValueError(
                f"x must have shape (B, T >= 1, d_model={self.d_model}), "
                f"got {tuple(x.shape)}"
            )
        if cache is None:
            return
        b = x.shape[0]
        want = ((b, self.conv_dim, self.conv_kernel - 1), (b, self.h, self.dk, self.dk))
        got = (
            tuple(getattr(cache, "conv_state", torch.empty(0)).shape),
            tuple(getattr(cache, "recurrent_state", torch.empty(0)).shape),
        )
        if got != want:
            raise ValueError(
                f"cache must hold conv_state {want[0]} and recurrent_state {want[1]} "
                f"(from this layer's new_cache({b})), got {got[0]} and {got[1]}"
            )

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: GatedDeltaNetCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """``x (B, T, d)``; with a cache, continue from its states and update them in
        place (only once the call has succeeded). A recurrence is causal by
        construction and needs no positions; it takes no mask."""
        self._check(x, cache, mask)
        b, t, _ = x.shape
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = mixed.transpose(1, 2)  # (B, C_conv, T)
        if cache is None:
            past = mixed.new_zeros(b, self.conv_dim, self.conv_kernel - 1)
        else:
            past = cache.conv_state.to(mixed.dtype)
        window = torch.cat([past, mixed], dim=-1)  # (B, C_conv, K − 1 + T)
        conv = F.silu(self.conv1d(window)).transpose(1, 2)  # (B, T, C_conv)
        q, k, v = (y.unflatten(-1, (self.h, self.dk)) for y in conv.chunk(3, dim=-1))
        g = self.forget_gate(x)  # (B, T, H, D)
        beta = torch.sigmoid(self.b_proj(x))  # (B, T, H)
        state = None if cache is None else cache.recurrent_state
        extra = {"chunk_size": self.chunk_size} if self.impl == "chunk" else {}
        op = chunk_kda if self.impl == "chunk" else recurrent_kda
        o, state = op(  # (B, T, H, D)
            q,
            k,
            v,
            g,
            beta,
            state,
            cache is not None,
            use_qk_l2norm_in_kernel=True,
            **extra,
        )
        if cache is not None:
            cache.conv_state.copy_(
                window[:, :, window.shape[-1] - (self.conv_kernel - 1) :]
            )
            cache.recurrent_state.copy_(state)
        if self.layout == "kimi":
            z = self.g_b_proj(self.g_a_proj(x))
        else:
            z = self.g_proj(x)
        o = self.o_norm(o, z.unflatten(-1, (self.h, self.dk)))  # (B, T, H, D)
        return self.o_proj(o.flatten(2))
