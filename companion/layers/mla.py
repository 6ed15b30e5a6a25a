"""Multi-head latent attention (MLA, DeepSeek-V2/V3) and its latent cache (chapter 08).

Shape legend: B batch, T query tokens, S key tokens (cached + new), d model width, H
heads, C ``kv_lora_rank`` (the latent), C_q ``q_lora_rank``, Dn ``qk_nope_head_dim``
(query/key channels without position), R ``qk_rope_head_dim`` (the decoupled RoPE
channels, one key shared by all heads), Dv ``v_head_dim``, F = R / 2 RoPE frequencies.

Each token is compressed into a latent ``c (C,)`` (RMS-normed) and one RoPE key ``k_rope
(R,)``; only these two are cached: ``C + R`` numbers per token and layer instead of ``H
· (Dn + R + Dv)``. ``kv_b_proj`` holds, per head, W_UK ``(Dn, C)`` and W_UV ``(Dv, C)``:

* ``form="naive"`` up-projects the latent to full per-head keys ``[W_UK c, k_rope]`` and
  values ``W_UV c`` and runs ordinary attention (the model as trained, and transformers'
  ``DeepseekV3Attention``).
* ``form="absorbed"`` folds W_UK into the query, ``q_lat = W_UKᵀ q_nope (C,)``, so the
  scores are ``q_lat·c + q_rope·k_rope``: multi-query attention with one shared head of
  width C + R whose values are the latents themselves; W_UV is applied after the
  softmax. Nothing per head is ever built for the S keys, which is what makes decoding
  cheap.

DeepSeek Sparse Attention (V3.2, GLM-5) composes onto either form: with an ``indexer``
(:mod:`companion.layers.lightning_indexer`) each query attends only to the K keys it
selects (:mod:`companion.ops.sparse_attention`), and the cache adds the indexer keys.

The softmax scale defaults to 1/√(Dn + R). YaRN checkpoints (DeepSeek-V3) multiply it by
``mscale(factor, mscale_all_dim)²``: pass ``scale=softmax_scale(Dn + R, rope_scaling)``.
``rope_layout="interleaved"`` is transformers' ``rope_interleave=True``: both rotate the
pairs (2f, 2f + 1); transformers then stores the rotated channels de-interleaved, a
fixed permutation of q_rope and k_rope alike, which leaves every q·k, hence the output,
unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from companion.checks import check_choice, check_int
from companion.layers.kv_cache import LatentCache, attention_mask, query_positions
from companion.layers.lightning_indexer import DSAIndexer, check_indexer
from companion.layers.norms import RMSNorm
from companion.layers.rotary import RotaryEmbedding
from companion.ops.attention import attention_weights
from companion.ops.dispatch import IMPLS, attention
from companion.ops.grouped import expand_kv
from companion.ops.rope import LAYOUTS, RopeScaling, apply_rope, yarn_mscale
from companion.ops.sparse_attention import SPARSE_IMPLS, selection_mask
from companion.ops.sparse_attention import sparse_attention as sparse

__all__ = ["FORMS", "MultiHeadLatentAttention", "bytes_per_token", "softmax_scale"]

FORMS = ("naive", "absorbed")


def bytes_per_token(
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    n_layers: int = 1,
    bytes_per_element: int = 2,
) -> int:
    """Latent-cache bytes one token costs: ``(C + R) · layers · bytes`` (no per-head
    term)."""
    return (kv_lora_rank + qk_rope_head_dim) * n_layers * bytes_per_element


def softmax_scale(qk_head_dim: int, rope_scaling: RopeScaling | None = None) -> float:
    """1/√(Dn + R), times ``mscale(factor, mscale_all_dim)²`` for scaled RoPE that sets
    ``mscale_all_dim`` (DeepSeek's YaRN): the logit sharpening is applied here, not in
    cos/sin."""
    scale = 1.0 / math.sqrt(qk_head_dim)
    p = rope_scaling
    if p is not None and p.mscale_all_dim:
        scale *= yarn_mscale(p.factor or 1.0, p.mscale_all_dim) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's MLA: queries direct or through a latent, keys and values through a
    latent.

    Parameters (no biases): ``q_proj (H·(Dn+R), d)`` when ``q_lora_rank == 0``, else
    ``q_a_proj (C_q, d)``, ``q_a_norm (C_q,)``, ``q_b_proj (H·(Dn+R), C_q)``; then
    ``kv_a_proj (C+R, d)``, ``kv_a_norm (C,)``, ``kv_b_proj (H·(Dn+Dv), C)``,
    ``out_proj (d, H·Dv)``. Rows of ``q_*`` are per head ``[nope | rope]``, rows of
    ``kv_b_proj`` per head ``[k_nope | v]``. Both forms use the same parameters.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int = 0,
        norm_eps: float = 1e-6,
        rope_layout: str = "interleaved",
        scale: float | None = None,
        form: str = "naive",
        impl: str = "sdpa",
        dropout: float = 0.0,
        causal: bool = False,
        window: int | None = None,
        rope: RotaryEmbedding | None = None,
        indexer: DSAIndexer | None = None,
        sparse_impl: str = "gather",
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("qk_rope_head_dim", qk_rope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            check_int(name, value, 1)
        check_int("q_lora_rank", q_lora_rank, 0)  # 0: direct queries
        if qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (RoPE pairs), got {qk_rope_head_dim}"
            )
        for name, value, allowed in (
            ("form", form, FORMS),
            ("impl", impl, IMPLS),
            ("rope_layout", rope_layout, LAYOUTS),
            ("sparse_impl", sparse_impl, SPARSE_IMPLS),
        ):
            check_choice(name, value, allowed)
        self.d_model, self.n_heads, self.q_lora_rank = d_model, n_heads, q_lora_rank
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.rope_layout, self.form = rope_layout, form
        self.impl, self.dropout = impl, dropout
        # fixed per layer: causal or not, the window, the RoPE table (None: no RoPE)
        self.causal, self.window, self.rope = causal, window, rope
        self.scale = 1.0 / math.sqrt(self.qk_head_dim) if scale is None else scale
        if indexer is not None:  # DSA: fixed here too, and checked against the layer
            check_indexer(indexer, q_lora_rank, causal, window, dropout)
        self.indexer, self.sparse_impl = indexer, sparse_impl
        q_out = n_heads * self.qk_head_dim
        if q_lora_rank == 0:
            self.q_proj = nn.Linear(d_model, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=False)

    @property
    def qk_head_dim(self) -> int:
        """The width of one head's query and key in the naive form, Dn + R."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK ``(H, Dn, C)`` and W_UV ``(H, Dv, C)``: views of
        ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.n_heads, -1, self.kv_lora_rank)
        return w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """An empty :class:`companion.layers.kv_cache.LatentCache` sized for this layer
        (default: the weights' dtype); with an indexer, what its ``layer_cache`` makes
        of it."""
        w = self.kv_a_proj.weight
        latent = LatentCache(
            batch,
            max_len,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )
        return latent if self.indexer is None else self.indexer.layer_cache(latent)

    def check_input(self, x: Tensor) -> None:
        """Raise a ValueError unless ``x`` is ``(B, T, d)``."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (B, T, {self.d_model}), got {tuple(x.shape)}"
            )

    def project(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        q_latent: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q_nope ``(B,H,T,Dn)``, q_rope ``(B,H,T,R)`` and the cache rows ``kv
        (B,T,C+R)`` = ``[normed latent | k_rope]``; RoPE applied when ``rope = (cos,
        sin)`` is given; ``q_latent``: the query latent if already computed."""
        self.check_input(x)
        b, t, _ = x.shape
        if self.q_lora_rank == 0:
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_norm(self.q_a_proj(x)) if q_latent is None else q_latent
            q = self.q_b_proj(q_latent)
        # (B, H, T, Dn+R)
        q = q.view(b, t, self.n_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], -1
        )
        latent = self.kv_a_norm(latent)  # (B, T, C)
        if rope is not None:
            q_rope = apply_rope(q_rope, *rope, layout=self.rope_layout)
            k_rope = apply_rope(k_rope, *rope, layout=self.rope_layout)  # (B, T, R)
        return q_nope, q_rope, torch.cat([latent, k_rope], dim=-1)

    def naive_qkv(
        self, q_nope: Tensor, q_rope: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Full per-head q ``(B,H,T,Dn+R)``, k ``(B,H,S,Dn+R)``, v ``(B,H,S,Dv)``."""
        b, s, _ = kv.shape
        latent, k_rope = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(b, s, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # one key shared by all heads
        k_rope = k_rope[:, None].expand(-1, self.n_heads, -1, -1)
        return torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), v

    def absorbed_qkv(
        self, q_nope: Tensor, q_rope: Tensor, kv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Latent-space q ``(B,H,T,C+R)``; one shared k ``(B,1,S,C+R)`` (the cache rows)
        and v ``(B,1,S,C)`` (their latent part, a view)."""
        w_uk, _ = self.up_weights()
        q_lat = torch.einsum(
            "bhtn,hnc->bhtc", q_nope, w_uk
        )  # q_nope·k_nope = q_lat·latent
        kv = kv[:, None]
        return torch.cat([q_lat, q_rope], dim=-1), kv, kv[..., : self.kv_lora_rank]

    def attention_inputs(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: LatentCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool, Tensor | None]:
        """q, k, v of this layer's form (cache written and read), the dense mask and
        causal flag, and the indexer's selection ``(B, T, K)`` (None without one)."""
        needed = any(p is not None for p in (self.rope, self.window, self.indexer))
        positions = query_positions(x, positions, cache, needed=needed)
        q_latent = indices = None
        if self.indexer is not None:  # select first: a failure leaves the cache alone
            self.check_input(x)
            q_latent = self.q_a_norm(self.q_a_proj(x)) if self.q_lora_rank else None
            indices = self.indexer(
                x, q_latent, positions, self.indexer.own_cache(cache), mask=mask
            )
        q_nope, q_rope, kv = self.project(
            x, None if self.rope is None else self.rope(positions), q_latent
        )
        k_pos = None
        if cache is not None:
            kv, k_pos = cache.update(positions, kv)
        mask, causal = attention_mask(positions, k_pos, self.window, mask, self.causal)
        make = self.naive_qkv if self.form == "naive" else self.absorbed_qkv
        return (*make(q_nope, q_rope, kv), mask, causal, indices)

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: LatentCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """``(B, T, d)``, called like :class:`companion.layers.mha.MultiHeadAttention`.
        With a ``cache`` the new latents are stored at their positions and the mask
        comes from the positions the cache holds (and this layer's window)."""
        q, k, v, mask, causal, indices = self.attention_inputs(
            x, positions, cache, mask=mask
        )
        p = self.dropout if self.training else 0.0
        kw = {"impl": self.impl, "mask": mask, "scale": self.scale, "dropout_p": p}
        b, h, t, _ = q.shape
        if indices is not None:  # DSA: each query reads only its K selected keys
            o = sparse(q, k, v, indices, scale=self.scale, impl=self.sparse_impl)
        elif t == 1 and not causal and k.shape[1] == 1:
            # absorbed decode step: every head reads the same latent keys, so fold the heads
            # into the query axis and run one head's attention (no repeated latents)
            o = attention(q.reshape(b, 1, h, -1), k, v, **kw).reshape(b, h, 1, -1)
        else:
            o = attention(q, k, v, causal=causal, **kw)
        if self.form == "absorbed":
            _, w_uv = self.up_weights()
            o = torch.einsum("bhtc,hvc->bhtv", o, w_uv)  # (B, H, T, Dv)
        return self.out_proj(self.merge_heads(x, o))  # (B, T, d)

    def merge_heads(self, x: Tensor, o: Tensor) -> Tensor:
        """The heads' outputs ``o (B, H, T, Dv)`` side by side, ``(B, T, H·Dv)``; a
        gated layer scales each head by its gate first (``x`` is the layer's input)."""
        return o.transpose(1, 2).flatten(2)

    def attention_weights(
        self, x: Tensor, positions: Tensor | None = None, *, mask: Tensor | None = None
    ) -> Tensor:
        """The ``(B, H, T, S)`` softmax weights (zero off the selection, with an
        indexer)."""
        q, k, _, mask, causal, indices = self.attention_inputs(x, positions, mask=mask)
        if indices is not None:
            mask, causal = selection_mask(indices, k.shape[2])[:, None], False
        k = expand_kv(k, q.shape[1])  # the absorbed form's one shared latent key
        return attention_weights(q, k, mask=mask, causal=causal, scale=self.scale)
