"""Greedy decoding and beam search for an encoder-decoder model (chapter 03).

Shape legend: B batch, S source tokens, L generated tokens, K beam width, V vocabulary.
Any model with ``encode(src, src_mask) -> memory`` and ``decode(tgt_in, memory,
src_mask) -> logits (B, T, V)`` works (e.g.
:class:`companion.models.seq2seq.Seq2SeqTransformer`). The source is encoded once;
without a KV cache (chapter 08) each step runs the decoder over the whole prefix again.

Both functions return a :class:`Decoded`: tokens without the leading BOS, EOS included,
PAD after it; ``scores`` are summed log-probabilities of those tokens (EOS included).
Beam search ranks its finished beams by the GNMT length penalty
``score / ((5 + length) / 6) ** alpha`` (Wu et al., 2016; the 2017 paper used K = 4,
α = 0.6); α = 0 ranks by raw log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_int, check_number

__all__ = [
    "Decoded",
    "EncoderDecoder",
    "beam_search",
    "greedy_decode",
    "length_penalty",
]


class EncoderDecoder(Protocol):
    """What the decoders need from a model: ``encode`` a source, ``decode`` a target
    prefix."""

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor: ...

    def decode(
        self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None = None
    ) -> Tensor: ...


@dataclass
class Decoded:
    """``tokens (B, L)``, ``scores (B,)`` log-probabilities, ``lengths (B,)`` up to EOS.

    Beam search also fills ``beams (B, K, L)`` and ``beam_scores (B, K)`` (raw
    log-probs, best first by the length-penalised score).
    """

    tokens: Tensor
    scores: Tensor
    lengths: Tensor
    beams: Tensor | None = None
    beam_scores: Tensor | None = None


def length_penalty(lengths: Tensor, alpha: float) -> Tensor:
    """GNMT's ((5 + length) / 6) ** alpha; 1 for alpha = 0."""
    return ((5.0 + lengths.float()) / 6.0) ** alpha


def _check(src: Tensor, max_len: int, ids: dict[str, int]) -> None:
    if src.ndim != 2:
        raise ValueError(f"src must have shape (B, S), got {tuple(src.shape)}")
    check_int("max_len", max_len, 1)
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"bos_id, eos_id and pad_id must differ, got {ids}")


def _lengths(tokens: Tensor, eos_id: int) -> Tensor:
    """Tokens up to and including the first EOS (all of them if there is none)."""
    is_eos = tokens == eos_id
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, tokens.shape[-1])
    return first


@torch.no_grad()
def greedy_decode(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None = None,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
) -> Decoded:
    """Take the most probable next token, ``max_len`` steps at most (stops when all
    end)."""
    _check(src, max_len, {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id})
    memory = model.encode(src, src_mask)  # (B, S, d)
    b = src.shape[0]
    ys = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)
    scores = torch.zeros(b, device=src.device)
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        logp = F.log_softmax(
            model.decode(ys, memory, src_mask)[:, -1].float(), dim=-1
        )  # (B, V)
        nxt = torch.where(done, pad_id, logp.argmax(-1))  # (B,)
        scores = scores + torch.where(
            done, 0.0, logp.gather(-1, nxt[:, None]).squeeze(-1)
        )
        ys = torch.cat([ys, nxt[:, None]], dim=1)
        done = done | (nxt == eos_id)
        if done.all():
            break
    tokens = ys[:, 1:]
    return Decoded(tokens, scores, _lengths(tokens, eos_id))


@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None = None,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> Decoded:
    """Keep the ``beam_size`` most probable prefixes per source; all sources in one
    batch.

    At each step every live beam is extended by every token and the K best (by summed
    log-probability) survive; a beam that has emitted EOS stays in the beam, extended by
    PAD at no cost. At the end the K beams are ranked by the length-penalised score.
    With K = 1 this is exactly :func:`greedy_decode`.
    """
    _check(src, max_len, {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id})
    check_int("beam_size", beam_size, 1)
    check_number("alpha", alpha, 0.0)  # 0: no length penalty
    b, k, dev = src.shape[0], beam_size, src.device
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)  # (B·K, S, d)
    mask = (
        None if src_mask is None else src_mask.repeat_interleave(k, dim=0)
    )  # (B·K, S)
    ys = torch.full((b * k, 1), bos_id, dtype=torch.long, device=dev)
    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = (
        0.0  # all beams start identical: keep one, so the first step fans out
    )
    done = torch.zeros(b, k, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        logp = F.log_softmax(model.decode(ys, memory, mask)[:, -1].float(), dim=-1)
        v = logp.shape[-1]
        if k > v:
            raise ValueError(
                f"beam_size ({k}) must be at most the vocabulary size ({v})"
            )
        logp = logp.view(b, k, v)
        frozen = torch.full_like(logp, float("-inf"))
        frozen[..., pad_id] = (
            0.0  # a finished beam can only be extended by PAD, for free
        )
        logp = torch.where(done[..., None], frozen, logp)
        cand = (scores[..., None] + logp).view(b, k * v)  # (B, K·V)
        scores, idx = cand.topk(k, dim=-1)  # (B, K), best first
        src_beam, tok = idx // v, idx % v
        ys = ys.view(b, k, -1).gather(
            1, src_beam[..., None].expand(-1, -1, ys.shape[-1])
        )
        ys = torch.cat([ys, tok[..., None]], dim=-1).view(b * k, -1)  # (B·K, step + 1)
        done = done.gather(1, src_beam) | (tok == eos_id)
        if done.all():
            break
    beams = ys.view(b, k, -1)[..., 1:]  # (B, K, L)
    lengths = _lengths(beams, eos_id)  # (B, K)
    order = (scores / length_penalty(lengths, alpha)).argsort(
        dim=-1, descending=True, stable=True
    )
    beams, scores, lengths = (
        t.gather(1, order if t.ndim == 2 else order[..., None].expand_as(t))
        for t in (beams, scores, lengths)
    )
    return Decoded(beams[:, 0], scores[:, 0], lengths[:, 0], beams, scores)
