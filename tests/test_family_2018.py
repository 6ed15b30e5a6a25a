"""The 2018–2020 family: exact parameter counts against transformers and arithmetic,
the papers' rounded sizes, and T5's span corruption."""

import pytest
import torch

from companion.analysis.calculator import count_params
from companion.analysis.family_2018 import (
    FAMILY,
    corrupt_spans,
    exact_params,
    family_rows,
    pooler_params,
    random_spans,
)

transformers = pytest.importorskip("transformers")


def _hf_count(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())  # tied weights once


@pytest.mark.parametrize(("name", "size"), [("BERT-base", (12, 768, 12)),
                                            ("BERT-large", (24, 1024, 16))])
def test_bert_counts_equal_transformers(name, size):
    n_layers, d, heads = size
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=d, num_hidden_layers=n_layers,
        num_attention_heads=heads, intermediate_size=4 * d,
    )
    m = FAMILY[name]
    assert exact_params(m) == _hf_count(transformers.BertModel, config)
    body = _hf_count(lambda c: transformers.BertModel(c, add_pooling_layer=False), config)
    assert exact_params(m, pooler=False) == body
    assert exact_params(m) - body == pooler_params(d)


def test_gpt1_count_equals_transformers():
    config = transformers.OpenAIGPTConfig()  # the released openai-gpt shape
    assert (config.vocab_size, config.n_positions) == (40478, 512)
    hf = _hf_count(transformers.OpenAIGPTLMHeadModel, config)
    assert exact_params(FAMILY["GPT-1"]) == hf


@pytest.mark.parametrize("name", ["GPT-2 small", "GPT-2 medium", "GPT-2 large", "GPT-2 XL"])
def test_gpt2_counts_equal_transformers(name):
    cfg = FAMILY[name].cfg
    config = transformers.GPT2Config(
        n_layer=cfg.n_layers, n_embd=cfg.d_model, n_head=cfg.n_heads
    )
    assert exact_params(FAMILY[name]) == _hf_count(transformers.GPT2LMHeadModel, config)


def _gpt_arithmetic(n_layers: int, d: int, vocab: int, ctx: int) -> int:
    """Per block: q, k, v, out (4d² + 4d), MLP (8d² + 5d), two LayerNorms (4d);
    token and position tables; a final LayerNorm; the head is the token table."""
    return n_layers * (12 * d * d + 13 * d) + (vocab + ctx) * d + 2 * d


@pytest.mark.parametrize("name", [n for n in FAMILY if n.startswith("GPT-3")])
def test_gpt3_counts_equal_arithmetic_and_round_to_their_names(name):
    cfg = FAMILY[name].cfg
    n = exact_params(FAMILY[name])
    assert n == _gpt_arithmetic(cfg.n_layers, cfg.d_model, 50257, 2048)
    assert n == count_params(cfg).total  # the calculator agrees
    # Table 2.1's names are within 2 % of the exact counts
    assert abs(n / FAMILY[name].published - 1) < 0.02


def test_published_sizes_and_where_they_differ():
    rows = {r["model"]: r for r in family_rows()}
    for row in rows.values():  # every rounded figure within 7 % of the exact count
        assert abs(row["ratio"] - 1) < 0.07, row["model"]
    # GPT-2's paper printed 117M for its smallest model: GPT-1's count, not its own
    assert round(rows["GPT-1"]["params"] / 1e6) == 117
    assert round(rows["GPT-2 small"]["params"] / 1e6) == 124
    assert round(rows["BERT-base"]["params"] / 1e6) == 109  # with the pooler
    assert round(rows["BERT-large"]["params"] / 1e6) == 335  # the paper: 340M


def test_span_corruption_on_a_fixed_example():
    words = "a b c d e f g h".split()
    inputs, target = corrupt_spans(words, [(1, 2), (5, 1)], ["<0>", "<1>", "<2>"])
    assert inputs == ["a", "<0>", "d", "e", "<1>", "g", "h"]
    assert target == ["<0>", "b", "c", "<1>", "f", "<2>"]
    with pytest.raises(ValueError, match="sentinels"):
        corrupt_spans(words, [(1, 2), (5, 1)], ["<0>", "<1>"])
    with pytest.raises(ValueError, match="sorted"):
        corrupt_spans(words, [(5, 1), (1, 2)], ["<0>", "<1>", "<2>"])


@pytest.mark.parametrize("n", [2, 10, 64, 513])
def test_random_spans_hide_the_density_and_reconstruct(n):
    gen = torch.Generator().manual_seed(n)
    spans = random_spans(n, 0.15, 3.0, generator=gen)
    hidden = sum(length for _, length in spans)
    assert hidden == min(max(round(0.15 * n), 1), n - 1)
    assert spans[0][0] >= 1  # the text starts with a kept token
    assert all(a + la < b for (a, la), (b, _) in zip(spans, spans[1:], strict=False))
    tokens = list(range(n))
    sentinels = [-(i + 1) for i in range(len(spans) + 1)]
    inputs, target = corrupt_spans(tokens, spans, sentinels)
    # filling each sentinel of the input with what follows it in the target
    # gives back the text
    fill, key = {}, None
    for t in target:
        if t < 0:
            key = t
            fill[key] = []
        else:
            fill[key].append(t)
    rebuilt = [x for t in inputs for x in (fill[t] if t < 0 else [t])]
    assert rebuilt == tokens
    assert len(inputs) + len(target) == n + 2 * len(spans) + 1
