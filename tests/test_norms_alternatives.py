"""Normalisation's alternatives (chapter 06): DyT, DeepNorm, logit soft-capping and the
z-loss, each against a formula written out independently."""

import math

import pytest
import torch
import torch.nn.functional as F

from companion.analysis.diagnostics import residual_write_weights
from companion.layers.block import TransformerBlock
from companion.layers.deepnorm import DeepNormResidual, deepnorm_, deepnorm_constants
from companion.layers.ffn import FeedForward
from companion.layers.mha import MultiHeadAttention
from companion.layers.norms import DyT, LayerNorm
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.softcap import soft_cap, z_loss

# --- DyT ------------------------------------------------------------------------------


def test_dyt_is_the_formula_with_three_kinds_of_parameter():
    torch.manual_seed(0)
    dyt = DyT(16, alpha=0.7)
    with torch.no_grad():
        dyt.weight.normal_()
        dyt.bias.normal_()
    x = 3 * torch.randn(2, 5, 16)
    want = dyt.weight * torch.tanh(0.7 * x) + dyt.bias
    torch.testing.assert_close(dyt(x), want)
    assert dyt(x).shape == x.shape
    shapes = {n: tuple(p.shape) for n, p in dyt.named_parameters()}
    assert shapes == {"alpha": (), "weight": (16,), "bias": (16,)}
    assert DyT(16, bias=False).bias is None
    assert DyT(16).alpha.item() == 0.5  # the paper's default start


def test_dyt_gradients_match_autograd_of_the_formula():
    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    dyt = DyT(8, alpha=1.3)
    dyt(x).pow(2).sum().backward()
    a = torch.tensor(1.3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    (torch.tanh(a * x2)).pow(2).sum().backward()  # weight 1, bias 0
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(dyt.alpha.grad, a.grad)
    # d/dα Σ tanh(αx)² = Σ 2 tanh(αx)(1 − tanh²(αx)) x
    t = torch.tanh(1.3 * x.detach())
    torch.testing.assert_close(dyt.alpha.grad, (2 * t * (1 - t**2) * x.detach()).sum())


def test_dyt_takes_no_statistics():
    """Unlike a norm, DyT's output for one token (or feature) ignores all the others."""
    torch.manual_seed(2)
    dyt, norm = DyT(8), LayerNorm(8)
    x = torch.randn(3, 8)
    y = x.clone()
    y[1:] *= 50  # other tokens change
    y[0, 4:] += 7  # and other features of token 0
    torch.testing.assert_close(dyt(x)[0, :4], dyt(y)[0, :4])
    assert not torch.allclose(norm(x)[0, :4], norm(y)[0, :4], atol=1e-3)
    # and the Jacobian of one token's output is diagonal
    jac = torch.autograd.functional.jacobian(dyt, x[0])
    torch.testing.assert_close(jac, torch.diag(torch.diagonal(jac)))


def test_dyt_is_a_norm_a_block_can_use():
    torch.manual_seed(3)
    d = 16
    block = TransformerBlock(
        MultiHeadAttention(d, 2, causal=True),
        FeedForward(d, 32, "gelu", True, 0.0),
        placement="pre",
        norms=(DyT(d), None, DyT(d), None),
    )
    x = torch.randn(2, 5, d)
    out = block(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.sum().backward()
    assert block.attn_norm.alpha.grad is not None and block.ffn_norm.alpha.grad != 0


# --- DeepNorm -------------------------------------------------------------------------


def test_deepnorm_constants_follow_the_papers_table():
    (alpha, beta), = deepnorm_constants(decoder_layers=64).values()
    assert alpha == pytest.approx(128**0.25) and beta == pytest.approx(512**-0.25)
    assert deepnorm_constants(encoder_layers=64) == {"encoder": (alpha, beta)}
    both = deepnorm_constants(encoder_layers=18, decoder_layers=6)
    assert both["encoder"][0] == pytest.approx(0.81 * (18**4 * 6) ** 0.0625)
    assert both["encoder"][1] == pytest.approx(0.87 * (18**4 * 6) ** -0.0625)
    assert both["decoder"] == pytest.approx(((3 * 6) ** 0.25, (12 * 6) ** -0.25))
    with pytest.raises(ValueError, match="encoder layers, decoder layers"):
        deepnorm_constants()


def _post_model(n_layers: int = 3, fused: bool = True) -> DecoderLM:
    cfg = ModelConfig(
        vocab_size=20, d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=8,
        norm_placement="post", position="learned", fused_qkv=fused, init_std=0.1,
    )  # fmt: skip
    return DecoderLM(cfg)


@pytest.mark.parametrize("fused", [True, False])
def test_deepnorm_scales_only_the_value_path_and_changes_the_residual(fused):
    torch.manual_seed(4)
    model = _post_model(fused=fused)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    alpha, beta = 2.0, 0.25
    deepnorm_(model, alpha, beta)
    for name, p in model.named_parameters():
        was = before[name]
        if name.endswith(("ffn.up.weight", "ffn.down.weight", "out_proj.weight",
                          "v_proj.weight")):  # fmt: skip
            torch.testing.assert_close(p, beta * was)
        elif name.endswith("attn.qkv.weight"):
            torch.testing.assert_close(p[:32], was[:32])  # q and k rows untouched
            torch.testing.assert_close(p[32:], beta * was[32:])  # the v rows scaled
        else:
            torch.testing.assert_close(p, was)
    # the residual rule is LN(α x + f(x)) at both sublayers of every block
    block, x = model.blocks[0], torch.randn(2, 4, 16)
    want = block.attn_norm(alpha * x + block.attn(x))
    want = block.ffn_norm(alpha * want + block.ffn(want))
    torch.testing.assert_close(block(x), want)


def test_deepnorm_keeps_the_identity_path_that_post_ln_loses_at_depth():
    """A 48-layer Post-LN stack at initialisation: the top's dependence on the bottom's
    input is mostly through the branches; with DeepNorm it is mostly the identity."""
    from companion.analysis.diagnostics import identity_path_jacobian

    x = torch.randint(0, 20, (4, 8))
    trace = {}
    for name in ("post", "deepnorm"):
        torch.manual_seed(5)
        model = _post_model(n_layers=48)
        with torch.no_grad():  # full-size writes, as in 2017
            for w in residual_write_weights(model):
                w.mul_(math.sqrt(96))
        if name == "deepnorm":
            deepnorm_(model, *deepnorm_constants(decoder_layers=48)["decoder"])
        path = identity_path_jacobian(
            model, x, n_probes=4, generator=torch.Generator().manual_seed(0)
        )
        trace[name] = float(path.trace[1])
    assert trace["post"] < 0.6 and trace["deepnorm"] > 0.8


def test_deepnorm_needs_a_plain_post_ln_stack():
    cfg = ModelConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
    with pytest.raises(ValueError, match="Post-LN blocks"):
        deepnorm_(DecoderLM(cfg), 2.0, 0.5)
    model = _post_model()
    deepnorm_(model, 2.0, 0.5)
    with pytest.raises(ValueError, match="no residual rule"):
        deepnorm_(model, 2.0, 0.5)  # not twice
    assert isinstance(model.blocks[0].residuals["attn"], DeepNormResidual)


# --- soft-capping and the z-loss ------------------------------------------------------


def test_soft_cap_is_bounded_identity_near_zero_and_has_the_tanh_gradient():
    x = torch.linspace(-1000, 1000, 2001, requires_grad=True)
    y = soft_cap(x, 50.0)
    assert y.abs().max() <= 50.0 and y.abs().max() > 49.99
    small = x.detach().abs() < 5  # |x| ≪ cap: within 1 % of x
    assert ((y.detach() - x.detach())[small].abs() <= 0.01 * x.detach()[small].abs()).all()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach() / 50) ** 2)
    assert torch.equal(soft_cap(-x.detach(), 30.0), -soft_cap(x.detach(), 30.0))
    with pytest.raises(ValueError, match="cap"):
        soft_cap(x, 0.0)


def test_z_loss_value_and_gradient_match_an_independent_formula():
    torch.manual_seed(6)
    logits = (5 * torch.randn(3, 4, 11) + 2).requires_grad_()
    loss = z_loss(logits, weight=1e-3)
    ref_logits = logits.detach().double().requires_grad_()
    log_z = ref_logits.exp().sum(-1).log()  # no logsumexp: the formula as written
    ref = 1e-3 * (log_z**2).sum() / log_z.numel()
    torch.testing.assert_close(loss.double(), ref.detach())
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-9)
    # the gradient points along the softmax: 2·w·log Z·softmax / rows
    want = 2e-3 * log_z.detach()[..., None] * ref_logits.detach().softmax(-1) / 12
    torch.testing.assert_close(logits.grad.double(), want, rtol=1e-5, atol=1e-9)


def test_z_loss_pins_the_shift_that_cross_entropy_ignores():
    torch.manual_seed(7)
    logits, targets = torch.randn(6, 10), torch.randint(0, 10, (6,))
    shifted = logits + 40.0
    ce, ce_shifted = F.cross_entropy(logits, targets), F.cross_entropy(shifted, targets)
    torch.testing.assert_close(ce, ce_shifted)
    assert z_loss(shifted) > 100 * z_loss(logits)
    assert z_loss(logits - torch.logsumexp(logits, -1, keepdim=True)) < 1e-12
    with pytest.raises(ValueError, match="weight"):
        z_loss(logits, weight=-1.0)
