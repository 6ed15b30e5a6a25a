"""DeepSeek-V4's attention: a sliding window, plus compressed entries of the whole past
(CSA or HCA), one shared key/value head, sinks and a grouped low-rank output.

Shape legend: B batch, T query tokens, d model width, H heads, D head width, C_q
``q_lora_rank``, R rotated channels (the last R of a head), W ``window``, m
``compress_ratio``, N compressed entries, S_w window keys, G ``o_groups``, r
``o_lora_rank``.

Per token: a query latent ``q_residual = q_a_norm(q_a_proj(x)) (C_q,)``; queries
``q_b_proj(q_residual)`` split into H heads, each RMS-normalised without a weight; one
key ``kv_norm(kv_proj(x)) (D,)`` that is also the value (K = V). Queries and keys are
rotated on their last R channels (:func:`~companion.layers.v4_compressor.rope_tail`).
Every query reads the keys of the last W positions (its own included) and, by ``kind``:

* ``"sliding"``: nothing more.
* ``"hca"`` (heavily compressed attention): every compressed entry that exists, one per
  block of m tokens (m = 128 in V4), pooled without overlap.
* ``"csa"`` (compressed sparse attention): entries of overlapping blocks (m = 4 in V4),
  of which a lightning indexer (:mod:`companion.layers.v4_indexer`) keeps the
  ``index_topk`` best per query.

Each head has a sink logit in its softmax (:mod:`companion.ops.sinks`). Since the values
were rotated like the keys, the output's last R channels are rotated back by the query's
position. The heads then go through ``o_a_proj``, G independent maps of H·D/G -> r (one
per group of heads), and ``o_b_proj`` (G·r -> d).

Parameter names and shapes equal transformers' ``DeepseekV4Attention``: ``q_a_proj (C_q,
d)``, ``q_a_norm (C_q,)``, ``q_b_proj (H·D, C_q)``, ``kv_proj (D, d)``, ``kv_norm
(D,)``, ``o_a_proj (G·r, H·D/G)``, ``o_b_proj (d, G·r)``, ``sinks (H,)``, and under
``compressor.`` those of :class:`~companion.layers.v4_compressor.Compressor` (with
``compressor.indexer.`` for CSA); :func:`convert_hf_state_dict` does the one rename.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_choice, check_int
from companion.layers.kv_cache import position_mask, query_positions
from companion.layers.norms import RMSNorm
from companion.layers.rotary import RotaryEmbedding
from companion.layers.v4_cache import CompressedAttentionCache
from companion.layers.v4_compressor import Compressor, rope_tail
from companion.layers.v4_indexer import Indexer
from companion.ops.compressed_attention import visible_entries
from companion.ops.dispatch import attention

__all__ = [
    "HF_LAYER_TYPES",
    "KINDS",
    "CompressedAttention",
    "GroupedLinear",
    "convert_hf_state_dict",
]

KINDS = ("sliding", "csa", "hca")
HF_LAYER_TYPES = {  # transformers' config.layer_types -> kind
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_HF_RENAMES = {
    "compressor.indexer.scorer.weights_proj.": "compressor.indexer.weights_proj."
}


def convert_hf_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``DeepseekV4Attention`` state dict under this module's names."""
    out = {}
    for key, value in state.items():
        for old, new in _HF_RENAMES.items():
            key = key.replace(old, new)
        out[key] = value
    return out


class GroupedLinear(nn.Module):
    """G independent linear maps without bias: ``(..., G, I) -> (..., G, O)``; group g
    uses rows g·O .. (g + 1)·O − 1 of ``weight (G·O, I)``."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups, self.out_features = groups, out_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.view(self.groups, self.out_features, -1)  # (G, O, I)
        return torch.einsum("...gi,goi->...go", x, w)


class CompressedAttention(nn.Module):
    """DeepSeek-V4's token mixer, ``(B, T, d) -> (B, T, d)``; ``kind`` fixed at build.

    ``rope`` is the layer's table: V4 uses its "main" RoPE (``rope_theta``) for sliding
    layers and its "compress" RoPE (``compress_rope_theta``, maybe YaRN) for CSA and HCA
    layers, whose compressor and indexer use the same table. ``impl`` picks the attention
    form (``"reference"`` or ``"sdpa"``, the two with sinks).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        window: int,
        rope: RotaryEmbedding,
        kind: str = "sliding",
        compress_ratio: int = 0,
        index_n_heads: int = 0,
        index_head_dim: int = 0,
        index_topk: int = 0,
        norm_eps: float = 1e-6,
        impl: str = "sdpa",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self._check(locals())
        self.n_heads, self.head_dim, self.o_groups = n_heads, head_dim, o_groups
        self.window, self.kind, self.compress_ratio = window, kind, compress_ratio
        self.rope, self.norm_eps = rope, norm_eps
        self.impl, self.dropout = impl, dropout
        self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_a_proj = GroupedLinear(
            n_heads * head_dim // o_groups, o_lora_rank, o_groups
        )
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, d_model, bias=False)
        self.sinks = nn.Parameter(torch.zeros(n_heads))
        self.compressor = None
        if kind != "sliding":
            indexer = None
            if kind == "csa":
                indexer = Indexer(
                    d_model,
                    q_lora_rank,
                    index_n_heads,
                    index_head_dim,
                    compress_ratio,
                    index_topk,
                    rope=rope,
                    norm_eps=norm_eps,
                )
            self.compressor = Compressor(
                d_model,
                head_dim,
                compress_ratio,
                overlap=kind == "csa",
                rope=rope,
                norm_eps=norm_eps,
                indexer=indexer,
            )

    @staticmethod
    def _check(args: dict) -> None:
        """Raise a ValueError naming the constructor argument that does not fit."""
        for name in ("d_model", "n_heads", "head_dim", "q_lora_rank"):
            check_int(name, args[name], 1)
        for name in ("o_groups", "o_lora_rank", "window"):
            check_int(name, args[name], 1)
        check_choice("kind", args["kind"], KINDS)
        if args["impl"] not in ("reference", "sdpa"):
            raise ValueError(
                f"impl must be 'reference' or 'sdpa', got {args['impl']!r}"
            )
        if args["n_heads"] % args["o_groups"]:
            raise ValueError(
                f"n_heads ({args['n_heads']}) must be a multiple of o_groups "
                f"({args['o_groups']})"
            )
        if 2 * args["rope"].inv_freq.numel() > args["head_dim"]:
            raise ValueError("rope rotates more channels than head_dim")
        if args["kind"] != "sliding":
            check_int("compress_ratio", args["compress_ratio"], 1)
        if args["kind"] == "csa":
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                check_int(name, args[name], 1)

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> CompressedAttentionCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` positions."""
        w = self.kv_proj.weight
        kw = {"dtype": dtype or w.dtype, "device": device or w.device}
        states = {}
        if self.compressor is not None:
            states["compressor"] = self.compressor.new_state(batch, max_len, **kw)
            if self.compressor.indexer is not None:
                states["indexer"] = self.compressor.indexer.new_state(
                    batch, max_len, **kw
                )
        return CompressedAttentionCache(
            batch, max_len, self.window, self.head_dim, **states, **kw
        )

    def _start(
        self, x: Tensor, positions: Tensor, cache: CompressedAttentionCache | None
    ) -> int:
        """The first position, after checking ``positions`` are ``start .. start + T −
        1`` (from 0 without a cache) and fit the cache: before anything is written."""
        t = x.shape[1]
        if positions.shape != (t,):
            raise ValueError(
                f"positions must have shape (T,) = ({t},), got {tuple(positions.shape)}"
            )
        start = int(positions[0])
        if t > 1 and not bool((positions.diff() == 1).all()):
            raise ValueError("positions must be consecutive: start, start + 1, ...")
        if cache is None and start != 0 and self.compressor is not None:
            raise ValueError(f"without a cache positions must start at 0, got {start}")
        if cache is not None and not 0 <= start <= cache.max_len - t:
            raise ValueError(
                f"positions {start}..{start + t - 1} do not fit the cache's "
                f"max_len={cache.max_len}"
            )
        return start

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: CompressedAttentionCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """``(B, T, d)`` for the tokens at ``positions (T,)`` (default 0..T−1). Without
        a cache ``x`` is a whole sequence; with one, its states continue and are
        written."""
        if mask is not None:
            raise ValueError(
                "compressed attention takes no mask (padding would enter the pooled "
                "entries): pass unpadded batches"
            )
        d = self.kv_proj.in_features
        if x.ndim != 3 or x.shape[1] == 0 or x.shape[-1] != d:
            raise ValueError(
                f"x must have shape (B, T >= 1, {d}), got {tuple(x.shape)}"
            )
        b, t, _ = x.shape
        positions = query_positions(x, positions, cache, needed=True)
        start = self._start(x, positions, cache)
        cos, sin = self.rope(positions)  # (T, F)
        q_residual = self.q_a_norm(self.q_a_proj(x))  # (B, T, C_q)
        q = self.q_b_proj(q_residual).view(b, t, self.n_heads, self.head_dim)
        q = F.rms_norm(q.transpose(1, 2), (self.head_dim,), eps=self.norm_eps)
        q = rope_tail(q, cos, sin)  # (B, H, T, D)
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # (B, T, D)
        k_pos = positions
        if cache is not None:
            kv, k_pos = cache.update(positions, kv)  # (B, S_w, D), (S_w,)
        seen = position_mask(positions, k_pos, self.window).expand(b, t, -1)
        if self.compressor is not None:
            state = None if cache is None else cache.compressor
            entries = self.compressor(x, start, state)  # (B, N, D)
            reach = visible_entries(positions, entries.shape[1], self.compress_ratio)
            indexer = self.compressor.indexer
            if indexer is not None:
                state = None if cache is None else cache.indexer
                keys = indexer(x, start, state)  # (B, N, c)
                reach = indexer.select(x, q_residual, positions, keys, reach)
            kv = torch.cat([kv, entries], dim=1)  # (B, S_w + N, D)
            seen = torch.cat([seen, reach.expand(b, t, -1)], dim=-1)
        p = self.dropout if self.training else 0.0
        kv = kv[:, None]  # one head, read as keys and as values
        o = attention(
            q,
            kv,
            kv,
            impl=self.impl,
            mask=seen[:, None],
            scale=self.head_dim**-0.5,
            dropout_p=p,
            sinks=self.sinks,
        )  # (B, H, T, D)
        o = rope_tail(o, cos, -sin).transpose(1, 2)  # rotated back: (B, T, H, D)
        o = self.o_a_proj(o.reshape(b, t, self.o_groups, -1))  # (B, T, G, r)
        return self.o_b_proj(o.flatten(2))  # (B, T, d)
