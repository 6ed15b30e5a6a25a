"""Speculative decoding: draft cheaply, verify in one forward of the target (chapters
12, 17).

Shape legend: T prompt tokens, n tokens so far, k drafts per step, V vocabulary, d
model width, N independent draws (the rule is vectorised over them).

A drafter (:class:`PromptLookupDrafter`, :class:`MTPDrafter`) proposes up to k tokens.
The target reads the last token it chose plus the k drafts in *one* forward through its
cache, at positions continuing ``cache.length``: one read of the weights scores k + 1
positions. Greedy: the longest prefix of drafts equal to the target's own argmax is
kept, and the target's next token is appended, so each step yields 1 to k + 1 tokens
and the output is the target's greedy output. Sampling: :func:`accept_or_resample`,
the rule of speculative sampling, which leaves the target's distribution unchanged.

Rejected drafts were written into the cache; rolling back is resetting
``cache.length``, which is exact for position-indexed caches (a full
:class:`~companion.layers.kv_cache.KVCache`, MLA's
:class:`~companion.layers.kv_cache.LatentCache`): a stale slot holds a future position,
masked until it is overwritten. A sliding-window ring would have lost keys to rejected
writes and a recurrent state cannot be rewound, so models with such layers are refused.
Batch 1 only: sequences of a batch accept different numbers of drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from companion.checks import check_int
from companion.layers.kv_cache import KVCache, LatentCache, SparseLatentCache
from companion.models.generation import check_generation_args
from companion.models.mtp import MTPModule

__all__ = [
    "Drafter",
    "MTPDrafter",
    "PromptLookupDrafter",
    "SpeculativeResult",
    "accept_or_resample",
    "check_rollback",
    "expected_tokens_per_step",
    "speculative_generate",
    "target_probs",
]


class Drafter(Protocol):
    """What :func:`speculative_generate` asks of a drafter."""

    needs_hidden: bool  # wants the target's final-norm inputs of positions 0..n-2

    def draft(
        self,
        tokens: Tensor,
        hidden: Tensor | None,
        limit: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Up to ``limit`` draft ids ``(m,)`` to follow ``tokens (n,)``, and the
        distributions ``q (m, V)`` they were drawn from (``None``: chosen outright)."""
        ...


class PromptLookupDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last ``n_gram`` tokens
    and propose the ``k`` tokens that followed it (a copy that reaches the end goes on
    copying itself, so a loop of period p is drafted in full). No model, no cost."""

    needs_hidden = False

    def __init__(self, n_gram: int = 3, k: int = 4) -> None:
        check_int("n_gram", n_gram, 1)
        check_int("k", k, 1)
        self.n_gram, self.k = n_gram, k

    def draft(
        self,
        tokens: Tensor,
        hidden: Tensor | None,
        limit: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The continuation of the latest earlier match of the last ``n_gram`` ids."""
        n, m = tokens.numel(), min(self.k, limit)
        if n <= self.n_gram or m == 0:
            return tokens[:0], None
        windows = tokens.unfold(0, self.n_gram, 1)[:-1]  # every earlier n-gram
        hits = (windows == tokens[-self.n_gram :]).all(dim=1).nonzero()
        if hits.numel() == 0:
            return tokens[:0], None
        start = int(hits[-1]) + self.n_gram  # what followed the latest match
        seq = tokens.tolist()
        for i in range(start, start + m):  # past the end, the copy copies itself
            seq.append(seq[i])
        return tokens.new_tensor(seq[n:]), None


class MTPDrafter:
    """Self-speculation with a trained :class:`~companion.models.mtp.MTPModule`: one
    draft, the module's guess of the token after the target's last pick, from the
    target's hidden states (chapter 12)."""

    needs_hidden = True

    def __init__(self, model: nn.Module, mtp: MTPModule) -> None:
        self.model, self.mtp = model, mtp

    def draft(
        self,
        tokens: Tensor,
        hidden: Tensor | None,
        limit: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The module at position n-2 reads ``h_{n-2}`` and ``tokens[n-1]`` and
        predicts ``tokens[n]``, over the whole sequence as in training."""
        if limit == 0 or hidden is None or hidden.shape[1] == 0:
            return tokens[:0], None
        logits = self.mtp(self.model, hidden, tokens[None, 1:])[0, -1:]  # (1, V)
        q = target_probs(logits.float(), temperature)
        if temperature == 0.0:
            return q.argmax(-1), None
        return torch.multinomial(q, 1, generator=generator)[0], q


def target_probs(
    logits: Tensor, temperature: float, top_k: int | None = None
) -> Tensor:
    """The distribution ``(·, V)`` that :func:`~companion.models.generation.sample`
    draws from (one-hot on the argmax at temperature 0)."""
    if temperature == 0.0:
        return nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def accept_or_resample(
    p: Tensor, q: Tensor, draft: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Speculative sampling's rule for N drafts ``draft (N,)`` drawn from ``q (N, V)``
    with target ``p (N, V)``: keep each with probability min(1, p(x)/q(x)), else draw
    from norm(max(0, p − q)). Returns ``(accepted (N,) bool, token (N,))``; the token
    is distributed as p."""
    px = p.gather(1, draft[:, None])[:, 0]
    qx = q.gather(1, draft[:, None])[:, 0]
    u = torch.rand(px.shape, generator=generator, device=p.device)
    accepted = u * qx < px  # u < min(1, p/q), without dividing by q
    residual = (p - q).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) == 0  # p == q: never rejected
    residual = torch.where(empty, p, residual)
    resampled = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return accepted, torch.where(accepted, draft, resampled)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a step yields when each of k drafts is accepted with probability
    ``alpha`` independently: (1 − α^{k+1}) / (1 − α) (Leviathan et al.)."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class SpeculativeResult:
    """The ids ``(1, T + new)``, and per step how many drafts were proposed and kept."""

    ids: Tensor
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """New tokens per forward of the target after the prefill."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)

    @property
    def acceptance_judged(self) -> int:
        """How many drafts the target judged, the kept ones and each step's first
        rejected one (drafts after a rejection are never judged)."""
        return sum(
            a + (a < d) for a, d in zip(self.accepted, self.drafted, strict=True)
        )

    @property
    def acceptance(self) -> float:
        """The per-token acceptance rate α, kept drafts over judged drafts."""
        return sum(self.accepted) / max(self.acceptance_judged, 1)


_ROLLBACK_SAFE = (KVCache, LatentCache, SparseLatentCache)


def check_rollback(cache: nn.Module) -> None:
    """Raise unless every layer cache rolls back by resetting ``cache.length``."""
    for i, layer in enumerate(cache.layers):
        if type(layer) not in _ROLLBACK_SAFE:
            raise ValueError(
                f"speculative decoding rolls rejected drafts back by resetting "
                f"cache.length, which is exact only for the plain position-indexed "
                f"caches (KVCache, LatentCache, SparseLatentCache); layer {i} keeps "
                f"a {type(layer).__name__} (a sliding ring or a recurrent state would "
                "be corrupted by rejected writes; other kinds are not checked for it)"
            )


def _judge(
    logits: Tensor,
    drafts: Tensor,
    q: Tensor | None,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> tuple[int, Tensor]:
    """Kept drafts a, and the token after them, from the target's ``logits (m+1, V)``."""
    m = drafts.numel()
    p = target_probs(logits.float(), temperature, top_k)  # (m + 1, V)
    if temperature == 0.0:
        picks = p.argmax(-1)
        same = (picks[:m] == drafts).tolist() + [False]
        a = same.index(False)
        return a, picks[a : a + 1]
    if q is None:  # a point mass on each draft
        q = nn.functional.one_hot(drafts, p.shape[-1]).float()
    for j in range(m):
        ok, token = accept_or_resample(
            p[j : j + 1], q[j : j + 1], drafts[j : j + 1], generator
        )
        if not bool(ok):
            return j, token
    return m, torch.multinomial(p[m : m + 1], 1, generator=generator)[0]


def _check_drafts(drafts: Tensor, q: Tensor | None, limit: int, vocab: int) -> None:
    """Raise an error naming what a drafter returned that the verify cannot take."""
    if drafts.ndim != 1 or drafts.numel() > limit or drafts.is_floating_point():
        raise ValueError(
            f"a drafter must return at most limit={limit} integer ids (m,), got "
            f"{drafts.dtype} {tuple(drafts.shape)}"
        )
    if drafts.numel() and not 0 <= int(drafts.min()) <= int(drafts.max()) < vocab:
        raise ValueError(f"draft ids must be in [0, vocab_size={vocab}), got {drafts}")
    if q is not None and q.shape != (drafts.numel(), vocab):
        raise ValueError(
            f"a drafter's q must be (m, V) = ({drafts.numel()}, {vocab}), got "
            f"{tuple(q.shape)}"
        )


@torch.no_grad()
def speculative_generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    drafter: Drafter,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> SpeculativeResult:
    """Prompt ``(1, T)`` plus ``max_new_tokens`` ids from ``model``, drafted by
    ``drafter`` and verified k + 1 positions per forward. Greedy (temperature 0) equals
    ``model.generate``'s output; sampling draws from the same distribution."""
    model.check_input_ids(input_ids)
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative_generate decodes one sequence: input_ids must be (1, T), got "
            f"{tuple(input_ids.shape)}"
        )
    check_generation_args(
        model.cfg.vocab_size, max_new_tokens, temperature, top_k, None, generator
    )
    total = input_ids.shape[1] + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceed "
            f"max_seq_len={model.cfg.max_seq_len}"
        )
    result = SpeculativeResult(input_ids)
    if max_new_tokens == 0:
        return result
    cache = model.new_cache(1, total)
    check_rollback(cache)
    caught: list[Tensor] = []
    hook = model.final_norm.register_forward_pre_hook(
        lambda _m, args: caught.append(args[0])
    )
    try:
        # the prefill: every position's hidden state if the drafter reads them
        logits = model(input_ids, cache=cache, last_only=not drafter.needs_hidden)
        hidden = caught.pop() if drafter.needs_hidden else None  # (1, T, d)
        caught.clear()
        logits = logits[0, -1:]  # (1, V)
        _, first = _judge(logits, input_ids[0, :0], None, temperature, top_k, generator)
        tokens = torch.cat([input_ids[0], first])  # (n,): the last not yet in the cache
        while tokens.numel() < total:
            limit = total - tokens.numel() - 1  # never write past the cache
            drafts, q = drafter.draft(tokens, hidden, limit, temperature, generator)
            _check_drafts(drafts, q, limit, model.cfg.vocab_size)
            start = cache.length  # the verify: last pick + m drafts, one forward
            step = torch.cat([tokens[-1:], drafts])[None]  # (1, m + 1)
            logits = model.forward_at(
                step, cache.positions(step.shape[1], step.device), cache
            )[0]
            a, nxt = _judge(logits, drafts, q, temperature, top_k, generator)
            cache.length = start + a + 1  # roll back the rejected drafts
            if drafter.needs_hidden:
                hidden = torch.cat([hidden, caught.pop()[:, : a + 1]], dim=1)
            caught.clear()
            tokens = torch.cat([tokens, drafts[:a], nxt])
            result.drafted.append(drafts.numel())
            result.accepted.append(a)
    finally:
        hook.remove()
    result.ids = tokens[None]
    return result
