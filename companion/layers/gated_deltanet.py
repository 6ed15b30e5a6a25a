"""Qwen3-Next's Gated DeltaNet layer around the gated delta rule (chapter 11).

Shape legend: B batch, T tokens, d model width, H_k key heads, H value heads (a multiple
of H_k; r = H / H_k), D_k key width, D_v value width, K conv kernel, C_conv = 2·H_k·D_k
+ H·D_v conv channels. Per token the layer projects ``x`` to q, k, v, a gate z and the
per-head scalars b, a; runs q, k, v through a short causal depthwise convolution with
SiLU; L2-normalises q and k (inside the op); sets ``β = σ(b)`` and the log-decay ``g =
−exp(A_log)·softplus(a + dt_bias) ≤ 0``; runs the gated delta rule
(:mod:`companion.ops.linear_attention`); normalises each head's output with a gated
RMSNorm ``rmsnorm(o)·w·silu(z)`` and projects back to d.

Parameters (names and shapes equal transformers' ``Qwen3NextGatedDeltaNet``, so its
state dict loads unchanged; PyTorch ``Linear`` weights are ``(out, in)``):

* ``in_proj_qkvz.weight`` ``(2·H_k·D_k + 2·H·D_v, d)``
* ``in_proj_ba.weight`` ``(2·H, d)``
* ``conv1d.weight`` ``(C_conv, 1, K)`` (no bias)
* ``dt_bias`` ``(H,)`` and ``A_log`` ``(H,)``
* ``norm.weight`` ``(D_v,)``, shared by all heads
* ``out_proj.weight`` ``(d, H·D_v)``

The fused projections are grouped by key head, as in the released checkpoints: for key
head h, ``in_proj_qkvz`` gives ``[q_h (D_k), k_h (D_k), v of its r value heads (r·D_v),
z of them (r·D_v)]`` and ``in_proj_ba`` gives ``[b (r), a (r)]``. The conv channels are
ordered ``[q of all heads, k of all heads, v of all heads]``.

``projections="split"`` (Qwen3.5) holds the same maps as four plain projections, named
as in transformers' ``Qwen3_5GatedDeltaNet``: ``in_proj_qkv.weight (C_conv, d)`` already
in conv-channel order, ``in_proj_z.weight (H·D_v, d)``, ``in_proj_b.weight (H, d)`` and
``in_proj_a.weight (H, d)``, value heads in order (value head j reads key head j // r).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_cache_buffers, check_choice, check_int, check_tensor
from companion.ops.delta_rule import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
)
from companion.ops.linear_attention import (
    chunk_linear_attention,
    l2norm,
    recurrent_linear_attention,
)

__all__ = ["GATE_FUNCTIONS", "IMPLS", "PROJECTIONS", "RULES", "GatedDeltaNet"]
__all__ += ["GatedDeltaNetCache", "GatedRMSNorm"]

IMPLS = ("chunk", "recurrent", "triton")
# how the input projections are stored: "grouped" (two fused matrices grouped by key head:
# Qwen3-Next) or "split" (q·k·v, z, b and a apart, head after head: Qwen3.5)
PROJECTIONS = ("grouped", "split")
# the state update, for ablations inside the same layer: "gated_delta" (the layer as
# released), "delta" (no decay, g = 0: DeltaNet), "linear" (no correction and no decay:
# S += k vᵀ, linear attention with L2-normalised q and k)
RULES = ("gated_delta", "delta", "linear")


# the gated norm's gate: SiLU (Gated DeltaNet) or sigmoid (Kimi Delta Attention)
GATE_FUNCTIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x)·weight·act(gate)`` over the last dimension, computed in fp32;
    ``activation`` "silu" (Gated DeltaNet) or "sigmoid" (KDA)."""

    def __init__(self, d: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        check_choice("activation", activation, tuple(GATE_FUNCTIONS))
        self.eps, self.act = eps, GATE_FUNCTIONS[activation]
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * self.weight.float()
        return (y * self.act(gate.float())).to(x.dtype)


class GatedDeltaNetCache(nn.Module):
    """What decoding keeps per layer, fixed in size whatever the length so far.

    ``conv_state (B, C_conv, K − 1)``: the last K − 1 conv inputs (zeros before the
    start); ``recurrent_state (B, H, D_k, D_v)`` in fp32. Like the KV caches it keeps no
    count: the caller knows the positions
    (:class:`companion.models.decoder.DecodeCache`).
    """

    def __init__(
        self,
        batch: int,
        conv_dim: int,
        conv_kernel: int,
        n_value_heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer(
            "conv_state",
            torch.zeros(batch, conv_dim, conv_kernel - 1, dtype=dtype, device=device),
        )
        self.register_buffer(
            "recurrent_state",
            torch.zeros(batch, n_value_heads, key_dim, value_dim, device=device),
        )


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Yang et al., 2024; Qwen3-Next): ``(B, T, d) -> (B, T,
    d)``.

    ``impl`` picks the op for every call, one-token decode steps included: ``"chunk"``
    (:func:`~companion.ops.delta_rule.chunk_gated_delta_rule`), ``"recurrent"`` (the
    token loop reference) or ``"triton"`` (the kernels of
    :mod:`companion.kernels.gated_delta`; the gated rule only). ``rule`` swaps the
    state update for an ablation (``RULES``); the parameters stay the same, the unused
    ones (``a`` for ``"delta"``, ``a`` and ``b`` for ``"linear"``) get no gradient.
    """

    def __init__(
        self,
        d_model: int,
        n_key_heads: int,
        n_value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        impl: str = "chunk",
        chunk_size: int = 64,
        rule: str = "gated_delta",
        projections: str = "grouped",
    ) -> None:
        super().__init__()
        check_choice("impl", impl, IMPLS)
        check_choice("rule", rule, RULES)
        check_choice("projections", projections, PROJECTIONS)
        if impl == "triton" and rule != "gated_delta":
            raise ValueError(f"impl='triton' needs rule='gated_delta', got {rule!r}")
        sizes = {"d_model": d_model, "n_key_heads": n_key_heads, "key_dim": key_dim,
                 "n_value_heads": n_value_heads, "value_dim": value_dim,
                 "conv_kernel": conv_kernel, "chunk_size": chunk_size}  # fmt: skip
        for name, value in sizes.items():
            check_int(name, value, 1)
        if n_value_heads % n_key_heads:
            raise ValueError(
                f"n_value_heads must be a multiple of n_key_heads, got {n_value_heads} "
                f"and {n_key_heads}"
            )
        self.hk, self.hv, self.dk, self.dv = (
            n_key_heads,
            n_value_heads,
            key_dim,
            value_dim,
        )
        self.d_model = d_model
        self.conv_kernel, self.impl, self.chunk_size = conv_kernel, impl, chunk_size
        self.rule, self.projections = rule, projections
        self.conv_dim = 2 * n_key_heads * key_dim + n_value_heads * value_dim
        if projections == "grouped":
            self.in_proj_qkvz = nn.Linear(
                d_model, self.conv_dim + n_value_heads * value_dim, bias=False
            )
            self.in_proj_ba = nn.Linear(d_model, 2 * n_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(d_model, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d_model, n_value_heads * value_dim, bias=False)
            self.in_proj_b = nn.Linear(d_model, n_value_heads, bias=False)
            self.in_proj_a = nn.Linear(d_model, n_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(n_value_heads))
        # A = exp(A_log) ~ U(0.01, 16): per-head decay rates, as transformers initialises them.
        self.A_log = nn.Parameter(torch.empty(n_value_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(value_dim, eps=norm_eps)
        self.out_proj = nn.Linear(n_value_heads * value_dim, d_model, bias=False)

    def new_cache(
        self,
        batch: int,
        max_len: int = 0,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GatedDeltaNetCache:
        """An empty cache for ``batch`` sequences, on this layer's device by default.
        Its size is fixed, whatever ``max_len`` (accepted so every token mixer is called
        alike)."""
        w = self.conv1d.weight
        return GatedDeltaNetCache(
            batch,
            self.conv_dim,
            self.conv_kernel,
            self.hv,
            self.dk,
            self.dv,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Input projections -> conv input (B, C_conv, T), z (B, T, H, D_v), b and a (B,
        T, H)."""
        b_, t, _ = x.shape
        if self.projections == "split":  # already in conv-channel and head order
            z = self.in_proj_z(x).view(b_, t, self.hv, self.dv)
            return (
                self.in_proj_qkv(x).transpose(1, 2),
                z,
                self.in_proj_b(x),
                self.in_proj_a(x),
            )
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(b_, t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(b_, t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat(
            [q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1
        )  # (B, T, C_conv)
        z = z.reshape(b_, t, self.hv, self.dv)
        return (
            mixed.transpose(1, 2),
            z,
            b.reshape(b_, t, self.hv),
            a.reshape(b_, t, self.hv),
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
        place. A recurrence is causal by construction and needs no positions; it takes
        no mask."""
        if mask is not None:
            raise ValueError(
                "Gated DeltaNet layers take no attention mask: pass unpadded batches"
            )
        self.check_inputs(x, cache)
        b_, t, _ = x.shape
        mixed, z, b, a = self._split(x)
        if cache is None:
            past = mixed.new_zeros(b_, self.conv_dim, self.conv_kernel - 1)
        else:
            past = cache.conv_state.to(mixed.dtype)
        window = torch.cat([past, mixed], dim=-1)  # (B, C_conv, K − 1 + T)
        if cache is not None:
            cache.conv_state.copy_(
                window[:, :, window.shape[-1] - (self.conv_kernel - 1) :]
            )
        conv = F.silu(self.conv1d(window)).transpose(1, 2)  # (B, T, C_conv)
        hk_dk = self.hk * self.dk
        q, k, v = conv.split([hk_dk, hk_dk, self.hv * self.dv], dim=-1)
        q = q.reshape(b_, t, self.hk, self.dk)
        k = k.reshape(b_, t, self.hk, self.dk)
        v = v.reshape(b_, t, self.hv, self.dv)
        state, keep = (None, False) if cache is None else (cache.recurrent_state, True)
        o, state = self._update(q, k, v, b, a, state, keep)
        if cache is not None:
            cache.recurrent_state.copy_(state)
        o = self.norm(o, z)  # (B, T, H, D_v)
        return self.out_proj(o.reshape(b_, t, self.hv * self.dv))

    def check_inputs(self, x: Tensor, cache: GatedDeltaNetCache | None) -> None:
        """Raise an error naming the argument that does not fit, before any state is
        written: ``x (B, T, d)`` and a ``cache`` of the shapes :meth:`new_cache` makes
        for batch B, on the weights' device. Shapes only: cheap per step."""
        w = self.conv1d.weight
        check_tensor("x", x, (None, None, self.d_model), legend="(B, T, d)")
        if cache is None:
            return
        b = x.shape[0]
        buffers = {  # shapes only: forward casts the states to what it computes in
            "conv_state": ((b, self.conv_dim, self.conv_kernel - 1), None),
            "recurrent_state": ((b, self.hv, self.dk, self.dv), None),
        }
        hint = f"this layer's new_cache({b})"
        check_cache_buffers(cache, (GatedDeltaNetCache,), buffers, w.device, hint)

    def _update(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        b: Tensor,
        a: Tensor,
        state: Tensor | None,
        keep: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The recurrence of ``self.rule`` with ``self.impl``: outputs ``(B, T, H,
        D_v)`` and the final state."""
        chunk = self.impl == "chunk"
        if self.rule == "linear":
            op = chunk_linear_attention if chunk else recurrent_linear_attention
            sizes = {"chunk_size": self.chunk_size} if chunk else {}
            return op(l2norm(q), l2norm(k), v, state, keep, **sizes)
        beta = b.sigmoid()
        extra: dict[str, object] = {"use_qk_l2norm_in_kernel": True}
        if chunk:
            extra["chunk_size"] = self.chunk_size
        if self.rule == "delta":
            op = chunk_delta_rule if chunk else recurrent_delta_rule
            return op(q, k, v, beta, state, keep, **extra)
        g = -self.A_log.float().exp() * F.softplus(
            a.float() + self.dt_bias
        )  # (B, T, H)
        op = chunk_gated_delta_rule if chunk else recurrent_gated_delta_rule
        if self.impl == "triton":
            from companion.ops.delta_rule_triton import chunk_gated_delta_rule_triton

            op = chunk_gated_delta_rule_triton
            extra["chunk_size"] = self.chunk_size
        return op(q, k, v, g, beta, state, keep, **extra)
