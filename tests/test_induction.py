"""The induction task, model and score (chapter 02) against direct constructions."""

import pytest
import torch

from companion.tasks.induction import (
    AttentionOnlyLM,
    induction_targets,
    prefix_matching_score,
    repeated_segments,
)


def test_repeated_segments_repeat_with_their_period():
    tokens, periods = repeated_segments(
        64, 24, (4, 8), 50, torch.Generator().manual_seed(0)
    )
    assert tokens.shape == (64, 24) and periods.shape == (64,)
    assert periods.min() >= 4 and periods.max() <= 8 and len(set(periods.tolist())) > 1
    for row, p in zip(tokens, periods.tolist(), strict=True):
        assert torch.equal(row[p:], row[:-p])


def test_repeated_segments_reject_bad_periods():
    with pytest.raises(ValueError):
        repeated_segments(2, 10, (4, 6), 8)


def test_induction_targets_by_loop():
    periods = torch.tensor([3, 5])
    target = induction_targets(periods, 12)
    for b, p in enumerate(periods.tolist()):
        for i in range(12):
            for j in range(12):
                expected = (
                    j <= i and j >= 1 and any(j == i - k * p + 1 for k in range(1, 13))
                )
                assert bool(target[b, i, j]) == expected, (p, i, j)


def test_prefix_matching_score_of_ideal_and_uniform_heads():
    t = 16
    periods = torch.tensor([4, 6])
    target = induction_targets(periods, t).float()  # (B, T, T)
    ideal = target / target.sum(-1, keepdim=True).clamp(min=1)
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
    weights = torch.stack([ideal, uniform.expand(2, t, t)], dim=1)  # (B, 2 heads, T, T)
    score = prefix_matching_score(weights, periods)
    assert score[0].item() == pytest.approx(1.0)
    # a uniform row over i + 1 keys puts (number of targets) / (i + 1) on the targets
    in_repeat = target.sum(-1) > 0
    expected = (target.sum(-1) / torch.arange(1, t + 1))[in_repeat].mean()
    assert score[1].item() == pytest.approx(expected.item(), rel=1e-6)


def test_attention_only_lm_shapes_and_causality():
    torch.manual_seed(0)
    model = AttentionOnlyLM(vocab=20, d_model=16, n_layers=2, n_heads=2, max_len=12)
    ids = torch.randint(20, (3, 12))
    logits = model(ids)
    maps = model(ids, maps=True)
    assert logits.shape == (3, 12, 20)
    assert len(maps) == 2 and maps[0].shape == (3, 2, 12, 12)
    assert torch.allclose(maps[1].sum(-1), torch.ones(3, 2, 12), atol=1e-6)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20
    assert torch.allclose(model(changed)[:, :-1], logits[:, :-1], atol=1e-6)
    assert not any(
        m.__class__.__name__.endswith("FeedForward") for m in model.modules()
    )
