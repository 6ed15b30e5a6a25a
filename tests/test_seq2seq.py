"""The 2017 encoder-decoder: shapes, causality, padding, tied weights, backends, base size."""

import math

import pytest
import torch

from companion.models.config import ModelConfig
from companion.models.seq2seq import (
    PAPER_BASE_PARAMS,
    Seq2SeqTransformer,
    base_param_breakdown,
    transformer_base_config,
)

V = 29


def small(**kw) -> ModelConfig:
    base = {
        "vocab_size": V,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "d_ff": 64,
        "max_seq_len": 16,
        "norm_placement": "post",
        "activation": "relu",
        "position": "sinusoidal",
        "scale_embeddings": True,
    }
    return ModelConfig(**{**base, **kw})


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("position", ["sinusoidal", "learned", "none"])
def test_logits_shape_and_decoder_causality(placement, position):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(
        small(norm_placement=placement, position=position)
    ).eval()
    src, tgt = ids(2, 7), ids(2, 9, seed=1)
    logits = model(src, tgt)
    assert logits.shape == (2, 9, V)
    changed = tgt.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % V  # change the future target tokens
    torch.testing.assert_close(model(src, changed)[:, :5], logits[:, :5])
    assert not torch.allclose(model(src, changed)[:, 5:], logits[:, 5:])


def test_encoder_is_bidirectional():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(small()).eval()
    src, tgt = ids(2, 7), ids(2, 4, seed=1)
    changed = src.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V  # the last source token
    memory, memory2 = model.encode(src), model.encode(changed)
    assert not torch.allclose(memory[:, 0], memory2[:, 0])  # reaches the first position
    assert not torch.allclose(model(src, tgt)[:, 0], model(changed, tgt)[:, 0])


def test_source_padding_is_ignored_when_masked():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(small()).eval()
    src, tgt = ids(1, 5), ids(1, 6, seed=1)
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    ref = model(src, tgt)
    torch.testing.assert_close(
        model(padded, tgt, src_mask=mask), ref, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        model.encode(padded, mask)[:, :5], model.encode(src), atol=1e-5, rtol=1e-5
    )
    assert not torch.allclose(
        model(padded, tgt), ref, atol=1e-3
    )  # unmasked pads leak in


def test_target_padding_and_mask():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(small(position="none")).eval()
    src, tgt = ids(1, 5), ids(1, 4, seed=1)
    ref = model(src, tgt)
    right = torch.cat([tgt, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    torch.testing.assert_close(model(src, right)[:, :4], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        model(src, right, tgt_mask=mask)[:, :4], ref, atol=1e-5, rtol=1e-5
    )
    # with no positions, left padding hidden by the mask is invisible too
    left = torch.cat([torch.zeros(1, 3, dtype=torch.long), tgt], dim=1)
    out = model(src, left, tgt_mask=mask.flip(1))[:, 3:]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_one_table_for_source_target_and_output():
    torch.manual_seed(0)
    tied = Seq2SeqTransformer(small())
    untied = Seq2SeqTransformer(small(tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == V * 32
    assert tied.num_params(include_embeddings=False) == tied.num_params() - V * 32
    # a token that appears only in the source gets a gradient through the encoder
    src = torch.tensor([[5, 6, 7]])
    tgt = torch.tensor([[8, 9]])
    tied(src, tgt).logsumexp(-1).sum().backward()
    assert tied.tok_emb.weight.grad[5].abs().sum() > 0


def test_embeddings_are_scaled_by_sqrt_d():
    model = Seq2SeqTransformer(small(position="none")).eval()
    x = ids(2, 5)
    torch.testing.assert_close(model.embed(x), model.tok_emb(x) * math.sqrt(32))
    std = model.tok_emb.weight.std().item()
    assert abs(std * math.sqrt(32) - 1) < 0.1  # √d·E has unit-variance entries at init
    plain = Seq2SeqTransformer(small(position="none", scale_embeddings=False)).eval()
    torch.testing.assert_close(plain.embed(x), plain.tok_emb(x))


@pytest.mark.parametrize("impl", ["sdpa", "tiled"])
def test_backends_agree_with_the_reference(impl):
    torch.manual_seed(0)
    ref = Seq2SeqTransformer(small(attn_impl="reference"))
    fast = Seq2SeqTransformer(small(attn_impl=impl))
    fast.load_state_dict(ref.state_dict())
    src, tgt = ids(3, 7), ids(3, 5, seed=1)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    out = {}
    for name, m in (("ref", ref), ("fast", fast)):
        logits = m(src, tgt, src_mask=mask)
        logits.square().mean().backward()
        out[name] = (logits.detach(), m.tok_emb.weight.grad.clone())
    torch.testing.assert_close(out["fast"][0], out["ref"][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["fast"][1], out["ref"][1], atol=1e-6, rtol=1e-4)


def test_cross_attention_maps():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(small())
    src, tgt = ids(2, 6), ids(2, 4, seed=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    maps = model.cross_attention_maps(src, tgt, mask)
    assert model.training  # the mode is restored
    assert len(maps) == 2 and maps[0].shape == (2, 4, 4, 6)
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(2, 4, 4))
    assert maps[0][1, :, :, 3:].abs().max() == 0  # no weight on padded source tokens


def test_base_model_size():
    parts = base_param_breakdown()
    d, ff, v, n = 512, 2048, 37_000, 6
    attn, ffn, ln = 4 * (d * d + d), 2 * d * ff + ff + d, 2 * d
    assert (
        parts["embeddings"] == v * d
    )  # one table: source, target and output projection
    assert parts["encoder"] == n * (attn + ffn + 2 * ln)
    assert parts["decoder"] == n * (2 * attn + ffn + 3 * ln)
    total = sum(parts.values())
    assert abs(total / PAPER_BASE_PARAMS - 1) < 0.05
    cfg = transformer_base_config()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff) == (512, 6, 8, 2048)
    assert cfg.norm_placement == "post" and cfg.tie_embeddings and cfg.scale_embeddings
    assert transformer_base_config(dropout=0.3).dropout == 0.3


def test_errors():
    model = Seq2SeqTransformer(small())
    src, tgt = ids(2, 5), ids(2, 4)
    with pytest.raises(ValueError, match="src must have shape"):
        model(src[0], tgt)
    with pytest.raises(ValueError, match="tgt_in must lie"):
        model(src, tgt + V)
    with pytest.raises(ValueError, match="src must lie"):
        model(src - 5, tgt)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(ids(2, 17), tgt)
    with pytest.raises(TypeError, match="int64 or int32"):
        model(src.float(), tgt)
    with pytest.raises(ValueError, match="share the batch size"):
        model(src, ids(3, 4))
    with pytest.raises(ValueError, match="src_mask must have the shape"):
        model(src, tgt, src_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="tgt_mask must have the shape"):
        model(src, tgt, tgt_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="memory must have shape"):
        model.decode(tgt, torch.zeros(2, 5, 8))
    with pytest.raises(ValueError, match="src_mask must have shape"):
        model.decode(tgt, torch.zeros(2, 5, 32), torch.ones(2, 3))
