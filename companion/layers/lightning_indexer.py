"""The lightning indexer of DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): a
small scorer that picks, for every query, the K keys the attention will read.

Shape legend: B batch, T query tokens, S key slots (cached + new), d model width, C_q
the query latent's width (MLA's ``q_lora_rank``), H_I indexer heads, D_I indexer head
width, R ≤ D_I rotated channels (the first R of each head), K = ``topk``.

The indexer has its own cheap heads: queries ``q_h = W_q c_q`` from MLA's query latent,
one key per token ``k = LayerNorm(W_k x)`` shared by the heads, and a weight per head
and query ``w = W_w x / √H_I``. A key's index score for query t is

    I(t, s) = Σ_h w_h(t) · ReLU(q_h(t) · k(s) / √D_I),

computed for every visible key (O(T·S), but with H_I·D_I small and no softmax), and
the K best become the selection ``(B, T, K)``; ``-1`` fills the slots of a query with
fewer than K visible keys. The indexer is causal by positions: a query never selects a
key at a later position, nor an empty cache slot. Only the keys are cached
(:class:`~companion.layers.kv_cache.IndexKeyCache`, D_I numbers per token beside MLA's
C + R). DeepSeek's kernels also rotate q and k by a Hadamard matrix and score in FP8;
the rotation keeps every q·k and FP8 is a precision choice, so neither is here (nor in
transformers).

:class:`SharedIndexer` is the indexer part of GLM-5's ``"shared"`` layers: no weights,
no cache; it hands on the selection the earlier ``"full"`` layer made for the same
queries in the same forward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.checks import check_choice, check_int
from companion.layers.kv_cache import (
    IndexKeyCache,
    LatentCache,
    SparseLatentCache,
    position_mask,
    query_positions,
)
from companion.layers.norms import LayerNorm
from companion.layers.rotary import RotaryEmbedding
from companion.ops.rope import LAYOUTS, apply_rope

__all__ = [
    "DSAIndexer",
    "LightningIndexer",
    "SharedIndexer",
    "check_indexer",
    "key_mask",
]


def key_mask(mask: Tensor | None, b: int, t: int, s: int) -> Tensor | None:
    """A layer's bool mask (broadcasting to ``(B, H, T, S)``, one for all heads) as
    ``(B|1, T|1, S|1)``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor (True = attend), got {mask.dtype}"
        )
    if mask.ndim == 4:
        if mask.shape[1] != 1:
            raise ValueError(
                f"mask must be the same for every head (the indexer selects once per "
                f"token): its head axis must be 1, got shape {tuple(mask.shape)}"
            )
        mask = mask[:, 0]
    shape = (1,) * (3 - mask.ndim) + tuple(mask.shape)
    if len(shape) != 3 or not all(
        m in (1, n) for m, n in zip(shape, (b, t, s), strict=True)
    ):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, T, S) = "
            f"{(b, t, s)}"
        )
    return mask.reshape(shape)


class LightningIndexer(nn.Module):
    """DSA's top-k selector. Parameters, named as in transformers: ``wq_b (H_I·D_I,
    C_q)``, ``wk (D_I, d)``, ``k_norm`` (LayerNorm over D_I, weight and bias),
    ``weights_proj (H_I, d)``; no biases in the projections.

    ``rope`` (the layer's table, shared with its MLA) rotates the first R channels of
    q and k in ``rope_layout``: ``"half"`` for DeepSeek-V3.2, ``"interleaved"`` for
    GLM-5. ``forward`` returns the selection; it keeps it (``selection``) only once a
    :class:`SharedIndexer` reads from it.
    """

    def __init__(
        self,
        d_model: int,
        q_lora_rank: int,
        *,
        n_heads: int,
        head_dim: int,
        topk: int,
        rope: RotaryEmbedding | None = None,
        rope_layout: str = "half",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("q_lora_rank", q_lora_rank),
            ("n_heads", n_heads),
            ("head_dim", head_dim),
            ("topk", topk),
        ):
            check_int(name, value, 1)
        check_choice("rope_layout", rope_layout, LAYOUTS)
        if rope is not None and 2 * rope.inv_freq.numel() > head_dim:
            raise ValueError(
                f"rope rotates {2 * rope.inv_freq.numel()} channels but head_dim is "
                f"{head_dim}"
            )
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.q_lora_rank, self.rope, self.rope_layout = q_lora_rank, rope, rope_layout
        self.scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = LayerNorm(head_dim, eps=norm_eps)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)
        self.keep_selection = False  # set by a SharedIndexer that reads this one
        self.selection: tuple[Tensor, Tensor | None, tuple[int, int]] | None = None

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> IndexKeyCache:
        """An empty :class:`~companion.layers.kv_cache.IndexKeyCache` for this indexer
        (default: the weights' dtype)."""
        w = self.wk.weight
        return IndexKeyCache(
            batch,
            max_len,
            self.head_dim,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )

    def layer_cache(self, latent: LatentCache) -> SparseLatentCache:
        """The cache of the MLA layer this indexer serves: its latents and these keys."""
        b, n = latent.kv.shape[:2]
        kw = {"dtype": latent.kv.dtype, "device": latent.kv.device}
        return SparseLatentCache(latent, self.new_cache(b, n, **kw))

    def own_cache(self, cache: nn.Module | None) -> IndexKeyCache | None:
        """This indexer's part of its layer's ``cache`` (None: no cache)."""
        if cache is None:
            return None
        if not isinstance(cache, SparseLatentCache):
            raise TypeError(
                f"cache must be the SparseLatentCache this layer's new_cache makes (the "
                f"latents and the indexer keys), got {type(cache).__name__}"
            )
        return cache.index

    def project(
        self, x: Tensor, q_latent: Tensor, rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q ``(B, H_I, T, D_I)``, k ``(B, T, D_I)`` (both RoPE'd), weights ``(B, T,
        H_I)``."""
        b, t, _ = x.shape
        if q_latent.shape != (b, t, self.q_lora_rank):
            raise ValueError(
                f"q_latent must have shape (B, T, {self.q_lora_rank}) = "
                f"{(b, t, self.q_lora_rank)}, got {tuple(q_latent.shape)}"
            )
        q = self.wq_b(q_latent).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x))  # (B, T, D_I)
        if rope is not None:
            q = apply_rope(q, *rope, layout=self.rope_layout)
            k = apply_rope(k, *rope, layout=self.rope_layout)
        w = self.weights_proj(x) * self.n_heads**-0.5  # (B, T, H_I)
        return q, k, w

    def scores(
        self,
        x: Tensor,
        q_latent: Tensor,
        positions: Tensor | None = None,
        cache: IndexKeyCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Index scores ``(B, T, S)`` in fp32, -inf where a key is not visible (later,
        empty, or masked). With a ``cache`` the new keys are stored first."""
        positions = query_positions(x, positions, cache, needed=True)
        q, k, w = self.project(
            x, q_latent, None if self.rope is None else self.rope(positions)
        )
        b, t = x.shape[:2]
        allowed = key_mask(mask, b, t, t if cache is None else cache.max_len)
        k_pos = positions
        if cache is not None:  # checked above: the cache is written only now
            k, k_pos = cache.update(positions, k)  # (B, S, D_I), (S,)
        logits = torch.einsum("bhtd,bsd->bhts", q.float(), k.float()) * self.scale
        score = torch.einsum("bth,bhts->bts", w.float(), logits.relu())  # (B, T, S)
        visible = position_mask(positions, k_pos)  # (T, S): no later key, no empty slot
        if allowed is not None:
            visible = visible & allowed
        return score.masked_fill(~visible, float("-inf"))

    def forward(
        self,
        x: Tensor,
        q_latent: Tensor,
        positions: Tensor | None = None,
        cache: IndexKeyCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """The selection ``(B, T, K)`` (int64, ``-1`` = empty slot) of ``x (B, T, d)``
        with its query latent ``(B, T, C_q)``; K = min(topk, S)."""
        with torch.no_grad():  # a choice, not a function to differentiate
            score = self.scores(x, q_latent, positions, cache, mask=mask)
            best, indices = score.topk(min(self.topk, score.shape[-1]), dim=-1)
            indices = indices.masked_fill(best == float("-inf"), -1)
        if self.keep_selection:
            self.selection = (indices, positions, tuple(x.shape[:2]))
        return indices


class SharedIndexer(nn.Module):
    """The indexer part of a GLM-5 ``"shared"`` layer: it returns the selection that
    ``source`` (the last ``"full"`` layer's indexer) made for these queries.

    ``source`` is held as a reference, not a submodule (its weights belong to the
    earlier layer), and is told to keep its last selection. Call the layers in order
    with the same positions, as a decoder does; anything else raises.
    """

    def __init__(self, source: LightningIndexer) -> None:
        super().__init__()
        if not isinstance(source, LightningIndexer):
            raise TypeError(
                f"source must be the LightningIndexer of an earlier full layer, got "
                f"{type(source).__name__}"
            )
        source.keep_selection = True
        object.__setattr__(self, "source", source)  # not registered: no shared weights
        self.topk = source.topk

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """No cache: the selection comes from the full layer, which caches its keys."""
        return None

    def layer_cache(self, latent: LatentCache) -> LatentCache:
        """The cache of the MLA layer this serves: its latents alone."""
        return latent

    def own_cache(self, cache: nn.Module | None) -> None:
        """Nothing of the layer's cache is this indexer's."""
        return None

    def forward(
        self,
        x: Tensor,
        q_latent: Tensor | None = None,
        positions: Tensor | None = None,
        cache: None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """The source's selection ``(B, T, K)`` for the queries of ``x (B, T, d)``."""
        kept = self.source.selection
        if kept is None:
            raise ValueError(
                "a shared indexer found no selection: the full layer it reuses must run "
                "first, in the same forward pass"
            )
        indices, at, shape = kept
        same = at is positions or (
            at is not None and positions is not None and torch.equal(at, positions)
        )
        if shape != tuple(x.shape[:2]) or not same:
            raise ValueError(
                f"a shared indexer got queries of shape {tuple(x.shape[:2])} at other "
                f"positions than its full layer's last call ({shape}); run the layers "
                "in order with the same positions"
            )
        return indices


def check_indexer(
    indexer: nn.Module,
    q_lora_rank: int,
    causal: bool,
    window: int | None,
    dropout: float,
) -> None:
    """Raise an error naming ``indexer`` unless it fits the MLA layer it is given to
    (:class:`companion.layers.mla.MultiHeadLatentAttention`)."""
    if not isinstance(indexer, (LightningIndexer, SharedIndexer)):
        raise TypeError(
            f"indexer must be a LightningIndexer or a SharedIndexer, got "
            f"{type(indexer).__name__}"
        )
    if isinstance(indexer, LightningIndexer) and indexer.q_lora_rank != q_lora_rank:
        raise ValueError(
            f"indexer reads the query latent: its q_lora_rank ({indexer.q_lora_rank}) "
            f"must equal the layer's q_lora_rank ({q_lora_rank}), which must be > 0"
        )
    if not causal or window is not None or dropout:
        raise ValueError(
            f"an indexer needs causal=True, window=None and dropout=0 (the selection is "
            f"the whole mask), got causal={causal}, window={window}, dropout={dropout}"
        )


DSAIndexer = LightningIndexer | SharedIndexer  # what an MLA layer's ``indexer`` may be
