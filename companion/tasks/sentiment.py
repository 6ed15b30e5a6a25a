"""A small labelled task: short reviews marked positive or negative, a linear probe on
sentence vectors, and prompt classification by a language model (chapter 04).

Shape legend: N sentences, d feature width, C classes.
``data/sentiment.txt`` holds 238 one-line reviews written for this book, in pairs: a
positive one and a negative one on the same subject (soup, a film, a hotel...), so the
subject alone cannot give the label away. :func:`split_pairs` keeps both halves of a
pair on the same side of the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from companion.training import portable_adam

__all__ = [
    "fit_linear_probe",
    "LABELS",
    "LinearProbe",
    "load_sentiment",
    "prompt_label_scores",
    "split_pairs",
]

LABELS = ("negative", "positive")
DATA = Path(__file__).resolve().parent.parent / "data" / "sentiment.txt"


def load_sentiment(path: Path | str | None = None) -> tuple[list[str], Tensor]:
    """The sentences and their labels ``(N,)`` (0 negative, 1 positive), in file order."""
    texts, labels = [], []
    for line in Path(path or DATA).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        label, text = line.split("\t")
        labels.append(LABELS.index(label))
        texts.append(text)
    return texts, torch.tensor(labels)


def split_pairs(
    n: int, test_fraction: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Train and test indices of ``n`` sentences stored in consecutive pairs (2i, 2i+1);
    a random ``test_fraction`` of the pairs goes to the test side, both halves together."""
    if n % 2 or not 0 < test_fraction < 1:
        raise ValueError(
            f"need an even n and 0 < test_fraction < 1, got {n}, {test_fraction}"
        )
    order = torch.randperm(n // 2, generator=generator)
    n_test = max(1, round(test_fraction * (n // 2)))
    pick = lambda pairs: torch.stack([2 * pairs, 2 * pairs + 1], 1).flatten()  # noqa: E731
    return pick(order[n_test:].sort().values), pick(order[:n_test].sort().values)


class LinearProbe(nn.Module):
    """Logistic regression on frozen features: standardise with the training mean and
    spread, then one linear layer ``(N, d) -> (N, C)`` logits."""

    def __init__(self, mean: Tensor, std: Tensor, n_classes: int) -> None:
        super().__init__()
        self.register_buffer("mean", mean)  # (d,)
        self.register_buffer("std", std)  # (d,)
        self.linear = nn.Linear(mean.numel(), n_classes)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear((features - self.mean) / self.std)  # (N, C)


def fit_linear_probe(
    features: Tensor,
    labels: Tensor,
    *,
    n_classes: int = 2,
    steps: int = 300,
    lr: float = 0.05,
    weight_decay: float = 1e-2,
    seed: int = 0,
) -> LinearProbe:
    """Train a :class:`LinearProbe` on ``features (N, d)`` and ``labels (N,)`` with
    full-batch AdamW on the cross-entropy; the features themselves never change."""
    x = features.detach().float()
    torch.manual_seed(seed)
    probe = LinearProbe(x.mean(0), x.std(0) + 1e-6, n_classes).to(x.device)
    opt = torch.optim.AdamW(
        probe.parameters(),
        lr=lr,
        weight_decay=weight_decay,
        **portable_adam(probe.parameters()),
    )
    for _ in range(steps):
        loss = nn.functional.cross_entropy(probe(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return probe.eval()


@torch.no_grad()
def prompt_label_scores(
    model: nn.Module,
    encode: object,
    prefix: str,
    queries: Sequence[str],
    label_words: Sequence[str],
) -> Tensor:
    """Log-probabilities ``(N, C)`` of each label word's first token right after
    ``prefix + query``, for every query (the two are tokenized apart).

    ``model`` is a :class:`~companion.models.decoder.DecoderLM` and ``encode`` its
    tokenizer's ``encode`` (text to ids). The prefix (instructions, examples) is run
    once; the queries then continue from its stored keys and values, those of one
    token length together as one batch.
    """
    device = model.tok_emb.weight.device
    first = [encode(w)[0] for w in label_words]
    head = torch.tensor([encode(prefix)], device=device)  # (1, P)
    tails = [encode(q) for q in queries]
    if not all(tails):
        raise ValueError("every query needs at least one token")
    max_len = head.shape[1] + max(map(len, tails))
    one = model.new_cache(1, max_len)
    model(head, cache=one)
    out = torch.empty(len(queries), len(first), device=device)
    for n in sorted(set(map(len, tails))):  # queries of one length run as one batch
        rows = [i for i, t in enumerate(tails) if len(t) == n]
        store = model.new_cache(len(rows), max_len)
        for mine, prefix_kv in zip(store.buffers(), one.buffers(), strict=True):
            mine.copy_(prefix_kv.expand_as(mine))  # every row starts from the prefix
        store.length = head.shape[1]
        ids = torch.tensor([tails[i] for i in rows], device=device)  # (b, n)
        logits = model(ids, cache=store, last_only=True)[:, -1].float()  # (b, V)
        out[rows] = torch.log_softmax(logits, -1)[:, first]
    return out  # (N, C)
