"""Multi-token prediction (chapter 12): shapes, shared head and embedding, causality, and
that a few steps of training lower both losses."""

from __future__ import annotations

import pytest
import torch

from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.mtp import MTPModule, mtp_losses, trunk_forward


def _cfg(**kw):
    base = dict(
        vocab_size=23,
        d_model=32,
        n_layers=1,
        n_heads=4,
        max_seq_len=16,
        position="rope",
        norm="rmsnorm",
        ffn="glu",
        activation="silu",
        bias=False,
    )
    return ModelConfig(**{**base, **kw})


def test_trunk_forward_gives_the_models_logits():
    torch.manual_seed(0)
    model = DecoderLM(_cfg())
    ids = torch.randint(0, 23, (2, 9))
    hidden, logits = trunk_forward(model, ids)
    assert hidden.shape == (2, 9, 32)
    torch.testing.assert_close(logits, model(ids))
    torch.testing.assert_close(model.lm_head(model.final_norm(hidden)), logits)


def test_mtp_shares_head_and_embedding_and_is_causal():
    torch.manual_seed(0)
    model, mtp = DecoderLM(_cfg()), MTPModule(_cfg())
    shared = {id(p) for p in model.parameters()}
    assert not shared & {id(p) for p in mtp.parameters()}  # nothing duplicated
    ids = torch.randint(0, 23, (1, 10))
    hidden, _ = trunk_forward(model, ids)
    out = mtp(model, hidden[:, :-1], ids[:, 1:])
    assert out.shape == (1, 9, 23)
    changed = ids.clone()
    changed[0, -1] = (
        ids[0, -1] + 1
    ) % 23  # the last token: only the last position may move
    hidden2, _ = trunk_forward(model, changed)
    out2 = mtp(model, hidden2[:, :-1], changed[:, 1:])
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])


def test_training_lowers_both_losses():
    torch.manual_seed(0)
    model, mtp = DecoderLM(_cfg()), MTPModule(_cfg())
    seq = torch.arange(17) % 5  # a periodic sequence: both tokens ahead are predictable
    x, y = seq[None, :-1].repeat(4, 1), seq[None, 1:].repeat(4, 1)
    opt = torch.optim.Adam([*model.parameters(), *mtp.parameters()], lr=1e-2)
    first = [v.item() for v in mtp_losses(model, mtp, x, y)]
    for _ in range(60):
        main, extra = mtp_losses(model, mtp, x, y)
        opt.zero_grad()
        (main + extra).backward()
        opt.step()
    assert main.item() < first[0] / 3 and extra.item() < first[1] / 3


def test_errors():
    with pytest.raises(ValueError, match="position"):
        MTPModule(_cfg(position="learned"))
    model, mtp = DecoderLM(_cfg()), MTPModule(_cfg())
    with pytest.raises(ValueError, match="next_ids"):
        mtp(model, torch.zeros(1, 4, 32), torch.zeros(1, 3, dtype=torch.long))


def test_mtp_reads_both_the_trunk_state_and_the_next_token():
    """Each input moves the output at its own position and at no earlier one: a module
    that ignored either (or looked ahead) would fail."""
    torch.manual_seed(0)
    model, mtp = DecoderLM(_cfg()), MTPModule(_cfg())
    with torch.no_grad():
        for p in mtp.parameters():  # the norms' gains away from 1 as well
            p.add_(0.1 * torch.randn_like(p))
        ids = torch.randint(0, 23, (1, 10))
        hidden, _ = trunk_forward(model, ids)
        h, nxt = hidden[:, :-1], ids[:, 1:]
        out = mtp(model, h, nxt)
        other_token = nxt.clone()
        other_token[0, 4] = (nxt[0, 4] + 1) % 23
        other_state = h.clone()
        other_state[0, 4] += torch.randn(32)
        for moved in (mtp(model, h, other_token), mtp(model, other_state, nxt)):
            torch.testing.assert_close(moved[:, :4], out[:, :4])  # causal
            assert (moved[0, 4] - out[0, 4]).abs().max() > 1e-3
