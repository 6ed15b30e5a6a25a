"""Probe tasks: their sequences against direct constructions, the scoring against
oracle models, and for each task a model that can solve it and one that cannot."""

import statistics

import pytest
import torch
from torch import nn

from companion.analysis.seeds import compare, difference, spread, t_quantile
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.tasks.probes import (
    accuracy,
    fit,
    induction_copy,
    memorisation,
    memorisation_table,
    mqar,
    mqar_vocab,
    needle,
    needle_vocab,
    position_accuracy,
)
from companion.tasks.synthetic import IGNORE
from companion.training import seed_everything


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train fastest on one thread (and far faster on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_mqar_queries_ask_every_key_once_for_its_value():
    x, y = mqar(32, 5, 12, 7, gen())
    assert x.shape == y.shape == (32, 20)
    for row, tgt in zip(x.tolist(), y.tolist(), strict=True):
        keys, values = row[0:10:2], row[1:10:2]
        assert len(set(keys)) == 5 and all(0 <= k < 12 for k in keys)
        assert all(12 <= v < 19 for v in values)
        pairs = dict(zip(keys, values, strict=True))
        queries, answers = row[10::2], row[11::2]
        assert sorted(queries) == sorted(keys)
        assert answers == [pairs[q] for q in queries]
        # scored exactly at the query positions, on the value that follows
        assert [t for t in tgt if t != IGNORE] == answers
        assert all(tgt[i] == IGNORE for i in range(20) if i < 10 or i % 2)
    assert mqar_vocab(12, 7) == 19


def test_mqar_shuffles_the_queries():
    x, _ = mqar(64, 6, 6, 6, gen())
    orders_differ = (x[:, 0:12:2] != x[:, 12::2]).any(dim=1)
    assert orders_differ.float().mean() > 0.9


def test_needle_sits_distance_tokens_before_the_query():
    x, y = needle(50, 20, (3, 9), 4, 10, gen())
    assert x.shape == y.shape == (50, 20)
    assert (x[:, -1] == 14).all() and needle_vocab(4, 10) == 15
    assert (y[:, :-1] == IGNORE).all()
    seen = set()
    for row, target in zip(x.tolist(), y[:, -1].tolist(), strict=True):
        # one needle, the rest filler
        (where,) = [i for i, t in enumerate(row) if t < 4]
        assert row[where] == target and all(4 <= t < 14 for t in row[:-1] if t >= 4)
        seen.add(19 - where)
    assert seen == set(range(3, 10))


def test_needle_rejects_a_distance_off_the_sequence():
    with pytest.raises(ValueError, match="distance"):
        needle(2, 10, 10, 4, 4)
    with pytest.raises(ValueError, match="distance"):
        needle(2, 10, (0, 3), 4, 4)
    with pytest.raises(ValueError, match="seq_len"):
        needle(2, 0, 1, 4, 4)


def test_induction_copy_scores_what_one_period_back_predicts():
    x, y = induction_copy(40, 30, (3, 7), 20, gen())
    assert x.shape == y.shape == (40, 30)
    for row, tgt in zip(x.tolist(), y.tolist(), strict=True):
        scored = [i for i in range(30) if tgt[i] != IGNORE]
        first = scored[0]
        p = first + 1  # the first predictable target is the token at position p
        assert 3 <= p <= 7 and scored == list(range(first, 30))
        for i in scored:
            assert tgt[i] == row[i + 1 - p]
            if i + 1 < 30:
                assert tgt[i] == row[i + 1]


def test_memorisation_table_is_fixed_by_its_seed_and_keys_are_distinct():
    keys, values = memorisation_table(100, 12, 9, seed=3)
    again, _ = memorisation_table(100, 12, 9, seed=3)
    other, _ = memorisation_table(100, 12, 9, seed=4)
    assert torch.equal(keys, again) and not torch.equal(keys, other)
    assert len({tuple(k) for k in keys.tolist()}) == 100
    assert keys.min() >= 0 and keys.max() < 12
    assert values.min() >= 12 and values.max() < 21
    with pytest.raises(ValueError, match="n_facts"):
        memorisation_table(145, 12, 9)
    x, y = memorisation(64, (keys, values), gen())
    lookup = {tuple(k): v for k, v in zip(keys.tolist(), values.tolist(), strict=True)}
    assert (y[:, 0] == IGNORE).all()
    assert [lookup[tuple(k)] for k in x.tolist()] == y[:, 1].tolist()


class Oracle(nn.Module):
    """Logits that put all the mass on given answers (or on one token)."""

    def __init__(self, answers: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.answers, self.vocab = answers, vocab
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(self.answers, self.vocab).float() + self.weight


def test_accuracy_of_an_oracle_a_constant_and_per_position():
    x, y = mqar(16, 4, 8, 8, gen())
    perfect = Oracle(y.clamp(min=0), 16)
    assert accuracy(perfect, x, y) == 1.0
    per = position_accuracy(perfect, x, y)
    assert torch.isnan(per[:8]).all() and (per[8::2] == 1).all()
    const = Oracle(torch.full_like(y, 8), 16)  # always the first value token
    want = ((y == 8).sum() / (y != IGNORE).sum()).item()
    assert accuracy(const, x, y) == pytest.approx(want)
    perfect.train()
    accuracy(perfect, x, y)
    assert perfect.training  # mode restored


def small_lm(vocab: int, seq_len: int, seed: int, **changes: object) -> DecoderLM:
    seed_everything(seed)
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=32,
        n_layers=2,
        n_heads=2,
        max_seq_len=seq_len,
        norm="rmsnorm",
        position="rope",
        ffn="glu",
        activation="silu",
        bias=False,
        **changes,
    )
    return DecoderLM(cfg)


def test_needle_is_found_by_full_attention_and_not_past_a_windows_reach():
    """Two sliding layers of window 3 see R = 2·2 + 1 = 5 tokens: at distance 10 the
    needle is out of reach, and the local model is at chance while full attention
    finds it."""
    t, n_needles = 16, 8
    local = {"sliding_window": 3, "layer_types": ("sliding", "sliding")}
    x, y = needle(256, t, 10, n_needles, 16, gen(99))
    scores = {}
    for name, changes in (("full", {}), ("local", local)):
        model = small_lm(needle_vocab(n_needles, 16), t, 0, **changes)
        fit(model, lambda g: needle(32, t, (1, t - 1), n_needles, 16, g), 100, 1e-2)
        scores[name] = accuracy(model, x, y)
    assert scores["full"] > 0.9
    assert scores["local"] < 0.3  # chance is 1/8


def test_memorisation_needs_both_key_tokens():
    """A model that sees both tokens learns a small table by heart; with a window of 1
    the scored position sees only the second token, which names no single fact."""
    table = memorisation_table(128, 16, 16, seed=0)
    keys, values = table
    x = keys
    y = torch.full_like(x, IGNORE)
    y[:, 1] = values
    scores = {}
    for name, changes in (
        ("both", {}),
        ("one", {"sliding_window": 1, "layer_types": ("sliding", "sliding")}),
    ):
        model = small_lm(32, 2, 0, **changes)
        fit(model, lambda g: memorisation(128, table, g), 150, 1e-2)
        scores[name] = accuracy(model, x, y)
    assert scores["both"] > 0.9
    assert scores["one"] < 0.4


def test_spread_is_the_sample_mean_and_standard_deviation():
    s = spread([1.0, 2.0, 4.0])
    assert s.mean == pytest.approx(statistics.mean([1, 2, 4]))
    assert s.sd == pytest.approx(statistics.stdev([1, 2, 4]))
    assert s.format(1) == f"{s.mean:.1f} ± {s.sd:.1f}"
    with pytest.raises(ValueError, match="at least 2"):
        spread([1.0])
    with pytest.raises(ValueError, match="finite"):
        spread([1.0, float("nan")])


@pytest.mark.parametrize(
    "df, table",
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042)],
)
def test_t_quantile_matches_the_published_table(df, table):
    # two-sided 95 % critical values of Student's t (any statistics table)
    assert t_quantile(0.95, df) == pytest.approx(table, abs=1e-3)


def test_compare_claims_a_difference_only_beyond_chance():
    assert compare([0.9, 0.92, 0.91], [0.5, 0.55, 0.52]) == 1
    assert compare([0.5, 0.55, 0.52], [0.9, 0.92, 0.91]) == -1
    assert compare([0.5, 0.7, 0.6], [0.55, 0.65, 0.62]) == 0  # within the scatter
    # paired: seed-to-seed scatter cancels in the differences, which all agree
    a, b = [1.0, 2.0, 3.0, 4.0], [0.9, 1.9, 2.95, 3.9]
    assert compare(a, b, paired=True) == 1 and compare(a, b, paired=False) == 0
    d = difference(a, b)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    assert d.mean == pytest.approx(statistics.mean(diffs))
    assert d.half_width == pytest.approx(3.182 * se, rel=1e-3)
    assert d.low > 0 and d.format(3).startswith("+0.")
    # two pairs against three: the interval of the differences spans zero
    a, b = [1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5, 0.5]
    assert compare(a, b, paired=True) == 0
    # unpaired: Welch, equal variances and sizes give df = 2n - 2
    a, b = [1.0, 2.0, 3.0], [3.0, 4.0, 5.0]
    w = difference(a, b, paired=False)
    assert w.mean == -2.0 and w.half_width == pytest.approx(
        2.776 * (2 / 3) ** 0.5, rel=1e-3
    )
    with pytest.raises(ValueError, match="as many seeds"):
        compare([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="level"):
        t_quantile(1.5, 3)


ONE_TOKEN = {"sliding_window": 1, "layer_types": ("sliding", "sliding")}


@pytest.mark.parametrize(
    "task,vocab,seq_len",
    [
        (lambda g, b=64: mqar(b, 2, 8, 8, g), mqar_vocab(8, 8), 8),
        (lambda g, b=64: induction_copy(b, 16, (2, 4), 8, g), 8, 16),
    ],
    ids=["mqar", "induction_copy"],
)
def test_attention_learns_recall_and_copying_a_model_blind_to_context_cannot(
    task, vocab, seq_len
):
    """Both need the earlier tokens: a window of 1 leaves chance (1/8), attention over
    the whole sequence learns them in a few hundred steps."""
    x, y = task(gen(99), 512)
    scores = {}
    for name, changes in (("full", {}), ("blind", ONE_TOKEN)):
        model = small_lm(vocab, seq_len, 0, **changes)
        fit(model, task, 200, 1e-2, warmup=20)
        scores[name] = accuracy(model, x, y)
    assert scores["full"] > 0.6
    assert scores["blind"] < 0.25
