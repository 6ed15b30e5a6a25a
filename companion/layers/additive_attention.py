"""Additive (Bahdanau) attention and a tiny encoder-decoder that uses it (chapter 01).

Shape legend: B batch, S source positions, T target positions, Dq query width, Dk key
width, Dv value width, A attention width, V vocabulary, H hidden width.

``score(s, h) = vᵀ tanh(W_s s + W_h h)``: a one-hidden-layer network scores each
(decoder state, encoder state) pair; a softmax over the source turns the scores into
weights, and the context is the weighted average of the values (the encoder states).
Masks are bool ``(B, S)``, ``True`` where the source may be read; a row with nothing to
read gets zero weights and a zero context.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.checks import check_int

__all__ = ["AdditiveAttention", "AttentionSeq2Seq", "reversal_task"]


def _check_inputs(
    query: Tensor, keys: Tensor, values: Tensor, wh: Tensor, mask: Tensor | None
) -> None:
    """Raise a ValueError naming the first input of
    :meth:`AdditiveAttention.forward` whose shape or type is not allowed."""
    if query.ndim != 2 or query.shape[0] != keys.shape[0]:
        raise ValueError(
            f"query must have shape (B={keys.shape[0]}, Dq), got {tuple(query.shape)}"
        )
    if values.ndim != 3 or values.shape[:2] != keys.shape[:2]:
        raise ValueError(
            "values must have shape (B, S, Dv) with "
            f"(B, S) = {tuple(keys.shape[:2])}, got {tuple(values.shape)}"
        )
    if wh.shape[:2] != keys.shape[:2]:
        raise ValueError(
            f"projected_keys must have shape (B, S, A), got {tuple(wh.shape)}"
        )
    if mask is not None and (mask.dtype != torch.bool or mask.shape != keys.shape[:2]):
        raise ValueError(
            "mask must be a bool tensor of shape "
            f"(B, S) = {tuple(keys.shape[:2])}, got {mask.dtype} {tuple(mask.shape)}"
        )


class AdditiveAttention(nn.Module):
    """``vᵀ tanh(W_s s + W_h h)`` scores, softmax weights, weighted-average context."""

    def __init__(self, query_dim: int, key_dim: int, attn_dim: int) -> None:
        super().__init__()
        for name, value in (
            ("query_dim", query_dim),
            ("key_dim", key_dim),
            ("attn_dim", attn_dim),
        ):
            check_int(name, value, 1)
        self.key_dim = key_dim
        self.w_s = nn.Linear(query_dim, attn_dim, bias=False)
        self.w_h = nn.Linear(key_dim, attn_dim, bias=True)
        self.v = nn.Linear(attn_dim, 1, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """``W_h h`` for every source position, ``(B, S, A)``: compute once per
        sequence."""
        if keys.ndim != 3 or keys.shape[-1] != self.key_dim:
            raise ValueError(
                f"keys must have shape (B, S, {self.key_dim}), got {tuple(keys.shape)}"
            )
        return self.w_h(keys)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        projected_keys: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``query (B, Dq)``, ``keys (B, S, Dk)``, ``values (B, S, Dv)`` (default:
        keys).

        Returns ``(context (B, Dv), weights (B, S))``. ``projected_keys`` may carry
        :meth:`project_keys` from an earlier step.
        """
        values = keys if values is None else values
        wh = self.project_keys(keys) if projected_keys is None else projected_keys
        _check_inputs(query, keys, values, wh, mask)
        # e_j = v · tanh(W_s s + W_h h_j): one score per source position, (B, S)
        scores = self.v(torch.tanh(self.w_s(query)[:, None, :] + wh)).squeeze(-1)
        if mask is not None:
            has_key = mask.any(dim=-1, keepdim=True)  # (B, 1)
            scores = scores.masked_fill(~(mask | ~has_key), float("-inf"))
            weights = torch.softmax(scores, dim=-1) * has_key  # empty rows: all zeros
        else:
            weights = torch.softmax(scores, dim=-1)  # (B, S)
        context = (weights[:, :, None] * values).sum(dim=1)  # (B, Dv)
        return context, weights


class AttentionSeq2Seq(nn.Module):
    """A GRU encoder (both directions) and a GRU decoder that attends to it at every
    step.

    The encoder's forward and backward states are concatenated into one annotation per
    source token, ``(B, S, 2H)``. Each decoder step scores all annotations against its
    previous state, reads their weighted average (the context) and feeds it, with the
    previous target token, into its GRU cell (Bahdanau, Cho and Bengio, 2015).
    """

    def __init__(self, vocab_size: int, d_embed: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.src_emb = nn.Embedding(vocab_size, d_embed)
        self.tgt_emb = nn.Embedding(vocab_size, d_embed)
        self.encoder = nn.GRU(d_embed, hidden, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(2 * hidden, hidden)
        self.attn = AdditiveAttention(hidden, 2 * hidden, hidden)
        self.cell = nn.GRUCell(d_embed + 2 * hidden, hidden)
        self.out = nn.Linear(hidden + 2 * hidden + d_embed, vocab_size)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """Annotations ``(B, S, 2H)`` and the decoder's first state ``(B, H)``."""
        ann, _ = self.encoder(self.src_emb(src))  # (B, S, 2H)
        return ann, torch.tanh(self.init_state(ann.mean(dim=1)))

    def forward(self, src: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: ``src (B, S)``, ``tgt_in (B, T)`` -> ``(logits, weights)``.

        Logits are ``(B, T, V)``. ``weights (B, T, S)`` is the alignment map:
        ``weights[b, t]`` says where output step t looked in the source.
        """
        for name, ids in (("src", src), ("tgt_in", tgt_in)):
            if ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"{name} must be int token ids of shape (B, n), got {tuple(ids.shape)}"
                )
        ann, s = self.encode(src)
        wh = self.attn.project_keys(ann)  # (B, S, A), reused at every step
        y = self.tgt_emb(tgt_in)  # (B, T, E)
        logits, weights = [], []
        for t in range(tgt_in.shape[1]):
            ctx, w = self.attn(
                s, ann, projected_keys=wh
            )  # (B, 2H), (B, S): look before writing
            s = self.cell(torch.cat([y[:, t], ctx], dim=-1), s)  # (B, H)
            logits.append(self.out(torch.cat([s, ctx, y[:, t]], dim=-1)))
            weights.append(w)
        return torch.stack(logits, dim=1), torch.stack(weights, dim=1)


def reversal_task(
    batch_size: int,
    length: int,
    vocab_size: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reverse a random sequence: returns ``src``, ``tgt_in`` and ``tgt_out``, each
    ``(B, length)``.

    Symbols are ``1 .. vocab_size - 1``; ``0`` is the start token that opens ``tgt_in``
    (``tgt_in`` is ``tgt_out`` shifted right by one).
    """
    if vocab_size < 2 or length < 1:
        raise ValueError(
            f"need vocab_size >= 2 and length >= 1, got {vocab_size}, {length}"
        )
    src = torch.randint(1, vocab_size, (batch_size, length), generator=generator)
    tgt_out = src.flip(1)
    tgt_in = torch.cat([torch.zeros_like(tgt_out[:, :1]), tgt_out[:, :-1]], dim=1)
    return src, tgt_in, tgt_out
