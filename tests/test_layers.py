"""Positions, norms, the FFN and multi-head attention: reference vs fast forms, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from companion.layers.ffn import FeedForward
from companion.layers.mha import MultiHeadAttention
from companion.layers.norms import LayerNorm, build_norm, layer_norm_reference
from companion.layers.positions import (
    LearnedPositions,
    SinusoidalPositions,
    sinusoid_shift_matrix,
    sinusoidal_table,
)


def test_sinusoidal_table_matches_the_formula():
    pe = sinusoidal_table(50, 16)
    pos, i = 7, 3
    assert pe[pos, 2 * i].item() == pytest.approx(
        math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6
    )
    assert pe[pos, 2 * i + 1].item() == pytest.approx(
        math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6
    )


@pytest.mark.parametrize("k", [1, 5, 40])
def test_shift_is_a_fixed_linear_map(k):
    pe = sinusoidal_table(100, 32)
    m = sinusoid_shift_matrix(k, 32)
    torch.testing.assert_close(pe[: 100 - k] @ m, pe[k:], atol=1e-4, rtol=0)


def test_odd_width_is_rejected():
    with pytest.raises(ValueError, match="even width d"):
        sinusoidal_table(10, 7)


def test_position_tables_reject_positions_past_the_end():
    for module in (LearnedPositions(8, 16), SinusoidalPositions(8, 16)):
        assert module(torch.arange(16)).shape == (16, 8)
        with pytest.raises(ValueError, match="max_seq_len=16"):
            module(torch.arange(17))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_layernorm_matches_reference_forward_and_backward(bias):
    torch.manual_seed(0)
    ln = LayerNorm(12, bias=bias)
    with torch.no_grad():
        ln.weight.normal_()
        if bias:
            ln.bias.normal_()
    x = torch.randn(3, 5, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = ln(x)
    y_ref = layer_norm_reference(x2, ln.weight, ln.bias, ln.eps)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, F.layer_norm(x, (12,), ln.weight, ln.bias, ln.eps))


def test_build_norm_rejects_unknown_kind():
    with pytest.raises(ValueError, match="norm must be one of"):
        build_norm("batchnorm", 8, 1e-5)


def test_feedforward_shapes_and_activation_check():
    ffn = FeedForward(8, 32, "gelu")
    assert ffn(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(8, 32, "tanh")


def _copy_projections(fused: MultiHeadAttention, split: MultiHeadAttention) -> None:
    d = fused.out_proj.in_features
    with torch.no_grad():
        for i, lin in enumerate((split.q_proj, split.k_proj, split.v_proj)):
            lin.weight.copy_(fused.qkv.weight[i * d : (i + 1) * d])
            lin.bias.copy_(fused.qkv.bias[i * d : (i + 1) * d])
        split.out_proj.load_state_dict(fused.out_proj.state_dict())


@pytest.mark.parametrize("impl", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_fused_and_separate_projections_agree(impl, cross):
    causal = not cross
    torch.manual_seed(0)
    fused = MultiHeadAttention(16, 4, fused_qkv=True, impl=impl, causal=causal)
    split = MultiHeadAttention(16, 4, fused_qkv=False, impl="reference", causal=causal)
    _copy_projections(fused, split)
    x = torch.randn(2, 7, 16)
    ctx = torch.randn(2, 9, 16) if cross else None
    torch.testing.assert_close(
        fused(x, context=ctx), split(x, context=ctx), atol=1e-5, rtol=1e-5
    )
    w = fused.attention_weights(x, context=ctx)
    assert w.shape == (2, 4, 7, 9 if cross else 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 7))


def test_mha_errors_name_the_problem():
    with pytest.raises(
        ValueError, match=r"d_model \(10\) must be divisible by n_heads \(4\)"
    ):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        MultiHeadAttention(8, 2, impl="cuda")
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, 8\)"):
        MultiHeadAttention(8, 2)(torch.randn(2, 3, 6))


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_encoder_is_bidirectional_and_cross_attention_reads_context(placement):
    from companion.models.builders import build_block
    from companion.models.config import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, d_model=16, n_heads=2, norm_placement=placement)
    enc = build_block(cfg, causal=False).eval()
    x = torch.randn(1, 6, 16)
    x2 = x.clone()
    x2[:, -1] = torch.randn(16)
    assert not torch.allclose(
        enc(x)[:, 0], enc(x2)[:, 0]
    )  # the first token sees the last
    dec = build_block(cfg, causal=True, cross_attention=True).eval()
    ctx = torch.randn(1, 4, 16)
    out = dec(x, context=ctx)
    assert out.shape == (1, 6, 16)
    assert not torch.allclose(out, dec(x, context=ctx + 1.0))
    with pytest.raises(ValueError, match="pass context"):
        dec(x)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_rmsnorm_matches_reference_forward_and_backward(offset):
    from companion.layers.norms import RMSNorm, rms_norm_reference

    torch.manual_seed(0)
    norm = RMSNorm(12, eps=1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 12, requires_grad=True)
    y, y_ref = norm(x), rms_norm_reference(x, norm.weight, 1e-6, offset)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(y)
    ga = torch.autograd.grad((y * g).sum(), (x, norm.weight), retain_graph=True)
    gb = torch.autograd.grad((y_ref * g).sum(), (x, norm.weight))
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert torch.equal(RMSNorm(4, offset=offset).weight, torch.full((4,), 1.0 - offset))


def test_glu_hidden_sizes_of_released_models():
    from companion.layers.ffn import GatedFeedForward, glu_hidden_size

    assert glu_hidden_size(4096) == 11008  # Llama 2 7B
    assert (
        glu_hidden_size(4096, multiple_of=1024, multiplier=1.3) == 14336
    )  # Llama 3 8B
    glu = GatedFeedForward(8, 24, "silu")
    x = torch.randn(2, 8)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=8, intermediate_size=24, num_attention_heads=2
    )
    theirs = transformers.models.llama.modeling_llama.LlamaMLP(cfg)
    theirs.load_state_dict(
        {f"{n}_proj.weight": getattr(glu, n).weight for n in ("gate", "up", "down")}
    )
    torch.testing.assert_close(glu(x), theirs(x))
    assert sum(p.numel() for p in glu.parameters()) == 3 * 8 * 24
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedFeedForward(8, 24, "swish")
