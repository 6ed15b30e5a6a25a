"""Additive (Bahdanau) attention and its tiny encoder-decoder (chapter 01)."""

from __future__ import annotations

import pytest
import torch

from companion.layers.additive_attention import (
    AdditiveAttention,
    AttentionSeq2Seq,
    reversal_task,
)


@pytest.fixture
def attn() -> AdditiveAttention:
    torch.manual_seed(0)
    return AdditiveAttention(query_dim=6, key_dim=10, attn_dim=8)


def test_weights_sum_to_one_and_context_is_their_average(attn):
    gen = torch.Generator().manual_seed(0)
    s, h, v = (
        torch.randn(3, 6, generator=gen),
        torch.randn(3, 7, 10, generator=gen),
        None,
    )
    ctx, w = attn(s, h, v)
    assert ctx.shape == (3, 10) and w.shape == (3, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    torch.testing.assert_close(ctx, torch.einsum("bs,bsd->bd", w, h))
    # the written-out formula, pair by pair
    b, j = 2, 4
    want = attn.v(torch.tanh(attn.w_s(s[b]) + attn.w_h(h[b, j])))
    scores = torch.stack(
        [attn.v(torch.tanh(attn.w_s(s[b]) + attn.w_h(h[b, i]))) for i in range(7)]
    )
    torch.testing.assert_close(w[b, j], torch.softmax(scores.squeeze(-1), 0)[j])
    assert want.shape == (1,)


def test_separate_values_and_precomputed_keys(attn):
    gen = torch.Generator().manual_seed(1)
    s, h, v = (
        torch.randn(2, 6, generator=gen),
        torch.randn(2, 5, 10, generator=gen),
        None,
    )
    v = torch.randn(2, 5, 3, generator=gen)
    ctx, w = attn(s, h, v)
    ctx2, w2 = attn(s, h, v, projected_keys=attn.project_keys(h))
    assert ctx.shape == (2, 3)
    torch.testing.assert_close(ctx, ctx2)
    torch.testing.assert_close(w, w2)


def test_mask_zeroes_hidden_positions_and_empty_rows(attn):
    gen = torch.Generator().manual_seed(2)
    s, h = torch.randn(3, 6, generator=gen), torch.randn(3, 5, 10, generator=gen)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2] = False  # nothing to read: zero weights, zero context
    ctx, w = attn(s, h, mask=mask)
    assert (w[0, 3:] == 0).all()
    torch.testing.assert_close(w[:2].sum(-1), torch.ones(2))
    assert (w[2] == 0).all() and (ctx[2] == 0).all()
    ctx_short, w_short = attn(s[:1], h[:1, :3])  # masking = dropping those positions
    torch.testing.assert_close(w[0, :3], w_short[0])
    torch.testing.assert_close(ctx[0], ctx_short[0])
    ctx.sum().backward()  # gradients stay finite with an empty row
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())


def test_errors_name_the_argument(attn):
    s, h = torch.randn(2, 6), torch.randn(2, 5, 10)
    with pytest.raises(ValueError, match=r"keys must have shape \(B, S, 10\)"):
        attn(s, torch.randn(2, 5, 9))
    with pytest.raises(ValueError, match="query must have shape"):
        attn(torch.randn(3, 6), h)
    with pytest.raises(ValueError, match="values must have shape"):
        attn(s, h, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        attn(s, h, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        attn(s, h, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_dim must be a positive integer"):
        AdditiveAttention(6, 10, 0)


def test_seq2seq_shapes_and_reversal_task():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    src, tgt_in, tgt_out = reversal_task(4, 6, 9, generator=gen)
    assert torch.equal(tgt_out, src.flip(1))
    assert (tgt_in[:, 0] == 0).all() and torch.equal(tgt_in[:, 1:], tgt_out[:, :-1])
    assert src.min() >= 1 and src.max() <= 8
    model = AttentionSeq2Seq(9, d_embed=8, hidden=12)
    logits, weights = model(src, tgt_in)
    assert logits.shape == (4, 6, 9) and weights.shape == (4, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 6))
    with pytest.raises(ValueError, match="src must be int token ids"):
        model(src.float(), tgt_in)
    with pytest.raises(ValueError, match="need vocab_size >= 2"):
        reversal_task(2, 3, 1)
