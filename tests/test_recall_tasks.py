"""Associative recall without training (chapter 11): the three memories behave as the
chapter says, and bad arguments raise."""

import math

import pytest
import torch

from companion.tasks.recall import RULES, recall_pairs, recall_read, recall_scores


def _pairs(n: int, d: int = 32, seed: int = 0):
    return recall_pairs(n, d, d, torch.Generator().manual_seed(seed))


def test_pairs_are_unit_vectors():
    k, v = _pairs(10)
    assert k.shape == v.shape == (10, 32) and k.dtype == torch.float64
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(10, dtype=torch.float64))


@pytest.mark.parametrize("rule", RULES)
def test_orthonormal_keys_are_recalled_exactly(rule):
    keys = torch.eye(8, dtype=torch.float64)
    values = torch.randn(8, 5, dtype=torch.float64)
    read = recall_read(keys, values, rule, softmax_scale=100.0)
    torch.testing.assert_close(read, values)


def test_linear_crosstalk_follows_sqrt_n_over_d():
    k, v = _pairs(64)
    _, err = recall_scores(k, v, recall_read(k, v, "linear"))
    assert abs(err.mean().item() / math.sqrt(63 / 32) - 1) < 0.1


def test_delta_rule_recalls_the_last_pair_exactly():
    k, v = _pairs(100)
    _, err = recall_scores(k, v, recall_read(k, v, "delta"))
    assert err[-1] < 1e-12 and err[:25].mean() > err[-25:].mean()


def test_softmax_recalls_everything():
    k, v = _pairs(128)
    correct, _ = recall_scores(k, v, recall_read(k, v, "softmax"))
    assert bool(correct.all())


def test_bad_arguments_raise():
    k, v = _pairs(4)
    with pytest.raises(ValueError, match="rule must be one of"):
        recall_read(k, v, "gated")
    with pytest.raises(ValueError, match="must share N"):
        recall_read(k, v[:3], "linear")
    with pytest.raises(ValueError, match="key_dim must be a positive int"):
        recall_pairs(4, 0, 4)
