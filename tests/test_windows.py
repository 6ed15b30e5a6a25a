"""Sliding-window masks, receptive fields and input gradients
(companion.analysis.receptive_fields, chapter 09)."""

from __future__ import annotations

import pytest
import torch

from companion.analysis.receptive_fields import (
    input_gradient_norms,
    layer_masks,
    receptive_field_size,
    receptive_fields,
    visible_pairs,
)
from companion.models.decoder import DecoderLM
from companion.models.presets import tiny


@pytest.mark.parametrize("seq_len", [1, 5, 16, 33])
@pytest.mark.parametrize("window", [None, 1, 4, 16, 40])
def test_visible_pairs_counts_the_mask(seq_len: int, window: int | None) -> None:
    kinds = ("full",) if window is None else ("sliding",)
    mask = layer_masks(kinds, window, seq_len)[0]
    assert visible_pairs(seq_len, window) == int(mask.sum())


def test_layer_masks_band_and_triangle() -> None:
    masks = layer_masks(("sliding", "full"), 3, 6)
    assert masks.shape == (2, 6, 6)
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    assert torch.equal(masks[0], (j <= i) & (i - j < 3))
    assert torch.equal(masks[1], j <= i)


@pytest.mark.parametrize(
    ("kinds", "window", "match"),
    [
        (("sliding", "linear"), 4, "must be one of"),
        (("sliding",), None, "window is None"),
        (("sliding",), 0, "window must be a positive integer"),
    ],
    ids=["unknown-kind", "no-window", "zero-window"],
)
def test_layer_masks_errors(
    kinds: tuple[str, ...], window: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        layer_masks(kinds, window, 8)


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5])
@pytest.mark.parametrize("window", [2, 4, 7])
def test_local_stack_reaches_formula(n_layers: int, window: int) -> None:
    t = 48
    fields = receptive_fields(layer_masks(("sliding",) * n_layers, window, t))
    assert fields.shape == (n_layers + 1, t, t)
    assert torch.equal(fields[0], torch.eye(t, dtype=torch.bool))
    for layer in range(1, n_layers + 1):
        size = receptive_field_size(layer, window)
        row = fields[layer, t - 1]
        assert int(row.sum()) == min(size, t)
        assert bool(
            row[t - min(size, t) :].all()
        )  # a contiguous run ending at the query


@pytest.mark.parametrize("where", [0, 2, 3])
def test_one_full_layer_spans_everything(where: int) -> None:
    kinds = ["sliding"] * 4
    kinds[where] = "full"
    fields = receptive_fields(layer_masks(kinds, 3, 20))
    assert torch.equal(fields[-1], torch.ones(20, 20, dtype=torch.bool).tril())


def test_receptive_fields_rejects_bad_masks() -> None:
    with pytest.raises(ValueError, match="bool"):
        receptive_fields(torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="positive integer"):
        receptive_field_size(0, 4)


def _model(kinds: tuple[str, ...], window: int) -> DecoderLM:
    torch.manual_seed(0)
    cfg = tiny(
        vocab_size=40,
        n_layers=len(kinds),
        attn_impl="reference",
        sliding_window=window,
        layer_types=kinds,
        max_seq_len=32,
        n_kv_heads=None,
    )
    return DecoderLM(cfg)


@pytest.mark.parametrize(
    "kinds",
    [
        ("sliding",),
        ("sliding", "sliding"),
        ("sliding", "sliding", "sliding"),
        ("sliding", "full", "sliding"),
    ],
    ids=["1-local", "2-local", "3-local", "local-full-local"],
)
@pytest.mark.parametrize("query", [-1, 10])
def test_gradient_support_matches_receptive_field(
    kinds: tuple[str, ...], query: int
) -> None:
    t, window = 24, 4
    model = _model(kinds, window)
    ids = torch.randint(0, 40, (1, t), generator=torch.Generator().manual_seed(1))
    norms = input_gradient_norms(model, ids, query, torch.Generator().manual_seed(2))
    field = receptive_fields(layer_masks(kinds, window, t))[-1, query]
    assert torch.equal(norms > 0, field)
    assert all(p.grad is None for p in model.parameters())  # the weights are left alone


def test_input_gradient_needs_one_sequence() -> None:
    model = _model(("sliding",), 4)
    with pytest.raises(ValueError, match=r"\(1, T\)"):
        input_gradient_norms(model, torch.zeros(2, 5, dtype=torch.long))
