"""The BERT-style encoder: bidirectional, padding-blind, MLM masking rule and tied head."""

import pytest
import torch
import torch.nn.functional as F

from companion.models.config import ModelConfig
from companion.models.encoder import (
    IGNORE_INDEX,
    Encoder,
    mask_tokens,
    mean_pool,
    mlm_loss,
)


def small(**kw) -> ModelConfig:
    base = {
        "vocab_size": 41,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 24,
    }
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_every_position_sees_the_future(placement):
    torch.manual_seed(0)
    enc = Encoder(small(norm_placement=placement)).eval()
    x = torch.randint(0, 41, (2, 10))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 41  # change only the last token
    h_x, h_y = enc(x), enc(y)
    assert h_x.shape == (2, 10, 32)
    assert (h_x[:, 0] - h_y[:, 0]).abs().max() > 1e-4  # the first position noticed


def test_padding_is_invisible_to_real_tokens():
    torch.manual_seed(0)
    enc = Encoder(small(attn_impl="reference")).eval()
    x = torch.randint(1, 41, (1, 7))
    junk = torch.randint(0, 41, (1, 5))
    padded = torch.cat([x, junk], dim=1)
    mask = torch.tensor([[1] * 7 + [0] * 5])
    torch.testing.assert_close(
        enc(padded, attention_mask=mask)[:, :7], enc(x), atol=1e-5, rtol=1e-5
    )


def test_backends_agree_with_a_padding_mask():
    torch.manual_seed(0)
    ref = Encoder(small(attn_impl="reference")).eval()
    fast = Encoder(small(attn_impl="sdpa")).eval()
    fast.load_state_dict(ref.state_dict())
    x = torch.randint(0, 41, (3, 9))
    mask = torch.tensor([[1] * 9, [1] * 4 + [0] * 5, [1] * 7 + [0] * 2])
    torch.testing.assert_close(fast(x, mask), ref(x, mask), atol=1e-5, rtol=1e-4)


def test_mean_pool_ignores_padding():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    pooled = mean_pool(h, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(pooled, torch.tensor([[2.0, 3.0]]))
    torch.testing.assert_close(mean_pool(h), h.mean(1))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        mean_pool(h, torch.ones(1, 2))


def test_token_types_change_the_output_and_are_checked():
    torch.manual_seed(0)
    enc = Encoder(small(), type_vocab_size=2).eval()
    x = torch.randint(0, 41, (1, 6))
    types = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert not torch.allclose(enc(x, token_type_ids=types), enc(x))
    torch.testing.assert_close(enc(x, token_type_ids=torch.zeros_like(x)), enc(x))
    with pytest.raises(ValueError, match="token_type_ids must lie in"):
        enc(x, token_type_ids=torch.full_like(x, 2))


def test_mask_tokens_follows_the_bert_proportions():
    ids = torch.randint(0, 1000, (400, 500))
    inputs, labels = mask_tokens(
        ids, mask_id=1000, vocab_size=1000, generator=torch.Generator().manual_seed(0)
    )
    sel = labels != IGNORE_INDEX
    assert abs(sel.float().mean().item() - 0.15) < 0.003
    masked = (inputs == 1000)[sel].float().mean().item()
    random = ((inputs != ids) & (inputs != 1000))[sel].float().mean().item()
    kept = (inputs == ids)[sel].float().mean().item()
    assert (
        abs(masked - 0.8) < 0.01 and abs(random - 0.1) < 0.01 and abs(kept - 0.1) < 0.01
    )
    assert torch.equal(labels[sel], ids[sel])  # labels hold the originals
    assert torch.equal(inputs[~sel], ids[~sel])  # unselected tokens are untouched


def test_mask_tokens_is_deterministic_per_seed_and_skips_special_positions():
    ids = torch.randint(0, 50, (8, 64))

    def run(seed, **kw):
        return mask_tokens(
            ids,
            mask_id=50,
            vocab_size=50,
            generator=torch.Generator().manual_seed(seed),
            **kw,
        )

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, 0] = special[:, -1] = True  # e.g. [CLS] and [SEP]
    inputs, labels = run(0, special=special, select_prob=1.0)
    assert (labels[:, 0] == IGNORE_INDEX).all() and (
        labels[:, -1] == IGNORE_INDEX
    ).all()
    assert (labels[:, 1:-1] != IGNORE_INDEX).all()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"select_prob": 0.0}, "select_prob"),
        ({"mask_frac": 0.9, "random_frac": 0.2}, "mask_frac and random_frac"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"special": torch.zeros(3, dtype=torch.bool)}, "special must have the shape"),
    ],
)
def test_mask_tokens_rejects_bad_arguments(kw, match):
    args = {"mask_id": 9, "vocab_size": 9, **kw}
    with pytest.raises(ValueError, match=match):
        mask_tokens(torch.zeros(2, 4, dtype=torch.long), **args)


def test_mlm_head_is_tied_and_its_loss_skips_unselected_positions():
    torch.manual_seed(0)
    enc = Encoder(small(), mlm_head=True)
    assert enc.mlm_head.decoder.weight is enc.tok_emb.weight
    untied = sum(
        p.numel() for p in enc.mlm_head.parameters() if p is not enc.tok_emb.weight
    )
    assert (
        enc.num_params() == Encoder(small()).num_params() + untied
    )  # the table counts once
    x = torch.randint(0, 40, (2, 12))
    inputs, labels = mask_tokens(
        x,
        mask_id=40,
        vocab_size=40,
        generator=torch.Generator().manual_seed(0),
        select_prob=0.5,
    )
    loss = mlm_loss(enc, inputs, labels)
    logits = enc.mlm_logits(inputs)
    sel = labels != IGNORE_INDEX
    torch.testing.assert_close(loss, F.cross_entropy(logits[sel], labels[sel]))
    loss.backward()
    assert (
        enc.tok_emb.weight.grad.abs().sum() > 0
    )  # reached through the tied decoder too


def test_encoder_errors_name_the_problem():
    enc = Encoder(small())
    with pytest.raises(ValueError, match="no MLM head"):
        enc.mlm_logits(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len=24"):
        enc(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match=r"vocab_size=41"):
        enc(torch.full((1, 3), 41))
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        enc(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="position must be one of"):
        Encoder(small(position="rope"))
    with pytest.raises(ValueError, match="type_vocab_size"):
        Encoder(small(), type_vocab_size=-1)
