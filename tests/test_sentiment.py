"""The labelled sentences of chapter 04, the linear probe and prompt scoring."""

from __future__ import annotations

import torch

from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.tasks.sentiment import (
    LABELS,
    fit_linear_probe,
    load_sentiment,
    prompt_label_scores,
    split_pairs,
)


def test_the_sentences_come_in_balanced_pairs():
    texts, labels = load_sentiment()
    assert len(texts) == len(labels) >= 200 and len(set(texts)) == len(texts)
    assert labels[0::2].tolist() == [1] * (len(texts) // 2)  # positive first...
    assert labels[1::2].tolist() == [0] * (len(texts) // 2)  # ...then its negative
    assert LABELS[1] == "positive"


def test_split_keeps_pairs_together_and_covers_everything():
    train, test = split_pairs(20, 0.25, torch.Generator().manual_seed(0))
    assert sorted(train.tolist() + test.tolist()) == list(range(20))
    pairs = lambda idx: set((idx // 2).tolist())  # noqa: E731
    assert not pairs(train) & pairs(test) and len(test) == 2 * round(0.25 * 10)


def test_probe_separates_separable_features_and_not_noise():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (200,), generator=g)
    x = torch.randn(200, 16, generator=g)
    x_sep = x + 3.0 * y[:, None] * torch.eye(16)[0]  # class shows in feature 0 only
    probe = fit_linear_probe(x_sep[:100], y[:100])
    acc = (probe(x_sep[100:]).argmax(-1) == y[100:]).float().mean()
    assert acc > 0.85
    noise = fit_linear_probe(x[:100], y[:100])
    acc_noise = (noise(x[100:]).argmax(-1) == y[100:]).float().mean()
    assert acc_noise < 0.7


def test_prompt_scores_match_one_full_forward():
    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=64,
        position="rope",
    )
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    encode = lambda s: [ord(ch) % 50 for ch in s]  # noqa: E731
    prefix, queries = "ab: x\ncd: y\n", ["efg:", "h:", "ijklmn:", "opq:"]
    got = prompt_label_scores(model, encode, prefix, queries, ["x", "y"])
    for q, row in zip(queries, got, strict=True):
        ids = torch.tensor([encode(prefix) + encode(q)])
        with torch.no_grad():
            want = torch.log_softmax(model(ids)[0, -1], -1)[encode("x") + encode("y")]
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-5)
