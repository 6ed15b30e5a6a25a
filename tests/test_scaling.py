"""FLOP counting against the 6N rule, power-law fits, Chinchilla arithmetic, span metrics."""

import math

import pytest
import torch

from companion.analysis.scaling import (
    CHINCHILLA_FIT,
    ChinchillaLoss,
    PowerLaw,
    chinchilla_tokens,
    compute_optimal,
    count_flops,
    dense_flops_per_token,
    fit_isoflop,
    fit_power_law,
    kaplan_flops_per_token,
    span_exact_match,
    training_compute,
    training_flops_per_token,
)
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM


def test_count_flops_of_one_matmul():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def lm(d: int, n_layers: int, seq: int, vocab: int = 37) -> DecoderLM:
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=n_layers,
        n_heads=4,
        max_seq_len=seq,
        attn_impl="reference",
    )
    torch.manual_seed(0)
    return DecoderLM(cfg)


@pytest.mark.parametrize(
    ("d", "n_layers", "seq"), [(16, 1, 8), (64, 2, 32), (128, 3, 64)]
)
def test_measured_flops_equal_the_full_count(d, n_layers, seq):
    model = lm(d, n_layers, seq)
    x = torch.randint(0, 37, (2, seq))
    measured = training_flops_per_token(model, x, x)
    n_matrix = sum(p.numel() for p in model.blocks.parameters() if p.ndim == 2)
    expected = dense_flops_per_token(
        n_matrix, n_layers=n_layers, seq_len=seq, d_model=d, vocab_size=37
    )
    assert measured == pytest.approx(expected, rel=1e-9)
    assert all(
        p.grad is None for p in model.parameters()
    )  # the count leaves no gradients


def test_six_n_is_close_for_a_wide_model_with_a_short_context():
    model = lm(256, 2, 32)
    x = torch.randint(0, 37, (1, 32))
    n = model.num_params(include_embeddings=False)
    assert training_flops_per_token(model, x, x) == pytest.approx(
        kaplan_flops_per_token(n), rel=0.15
    )


def test_fit_power_law_recovers_the_exponent():
    x = [1e3, 3e3, 1e4, 3e4, 1e5]
    law = PowerLaw(coef=7.0, exponent=-0.076)
    fit = fit_power_law(x, law(x).tolist())
    assert fit.exponent == pytest.approx(-0.076, abs=1e-9)
    assert fit.coef == pytest.approx(7.0, rel=1e-9)
    with pytest.raises(ValueError, match="positive"):
        fit_power_law([1, 2], [1, 0])
    with pytest.raises(ValueError, match="same number"):
        fit_power_law([1, 2, 3], [1, 2])


def test_chinchilla_arithmetic():
    assert chinchilla_tokens(70e9) == 1.4e12  # 70B parameters x 20 tokens each
    c = training_compute(70e9, 1.4e12)
    assert c == pytest.approx(5.88e23)
    n, d = compute_optimal(c)
    assert n == pytest.approx(70e9) and d == pytest.approx(1.4e12)
    # Gopher's budget (280B on 300B tokens) buys a ~65B model at 20 tokens per parameter
    n_gopher, _ = compute_optimal(training_compute(280e9, 300e9))
    assert n_gopher == pytest.approx(math.sqrt(5.04e23 / 120), rel=1e-9)
    with pytest.raises(ValueError, match="positive"):
        compute_optimal(0.0)


def test_span_exact_match():
    correct = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    assert span_exact_match(correct, 2).tolist() == [
        [True, False, True],
        [True, True, False],
    ]
    assert span_exact_match(correct, 3, start=3).tolist() == [[True], [False]]
    assert span_exact_match(correct, 2, stride=1)[0].tolist() == [
        True,
        False,
        False,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="at least one span"):
        span_exact_match(correct, 7)
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        span_exact_match(correct[0], 2)


def test_chinchilla_loss_optimum_is_the_least_loss_on_the_budget():
    law = CHINCHILLA_FIT
    assert law(1e40, 1e40) == pytest.approx(law.E, abs=1e-6)  # the irreducible floor
    for c in (1e18, 5.76e23, 1e26):
        n_opt, d_opt = law.optimal(c)
        assert 6 * n_opt * d_opt == pytest.approx(c)
        grid = torch.logspace(math.log10(n_opt) - 1, math.log10(n_opt) + 1, 2001,
                              dtype=torch.float64).tolist()
        best = min(grid, key=lambda n: law(n, c / (6 * n)))
        assert best == pytest.approx(n_opt, rel=3e-3)
    # N_opt grows as C^(beta / (alpha + beta)): 0.28 / 0.62
    assert law.n_exponent == pytest.approx(0.28 / 0.62)
    (n1, _), (n2, _) = law.optimal(1e20), law.optimal(1e24)
    assert math.log10(n2 / n1) / 4 == pytest.approx(law.n_exponent, rel=1e-9)
    swapped = ChinchillaLoss(E=1.0, A=400.0, B=400.0, alpha=0.3, beta=0.3)
    n_eq, d_eq = swapped.optimal(6e20)
    assert n_eq == pytest.approx(d_eq)  # symmetric terms split the budget evenly
    with pytest.raises(ValueError, match="positive"):
        law.optimal(0.0)


def test_fit_isoflop_finds_the_minimum():
    n = [1e3, 3e3, 1e4, 3e4, 1e5]
    x = torch.tensor(n, dtype=torch.float64).log()
    loss = (0.2 * (x - math.log(7e3)) ** 2 + 2.5).tolist()
    fit = fit_isoflop(n, loss)
    assert fit.n_opt == pytest.approx(7e3, rel=1e-9)
    assert fit.min_loss == pytest.approx(2.5, rel=1e-9)
    assert fit(n).tolist() == pytest.approx(loss, rel=1e-9)
    with pytest.raises(ValueError, match="no minimum"):
        fit_isoflop(n, [-v for v in loss])
    with pytest.raises(ValueError, match=">= 3"):
        fit_isoflop(n[:2], loss[:2])
