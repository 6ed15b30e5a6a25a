"""Squared ReLU (Primer), the ungated activation of chapter 07: value, slope, and an MLP
of width 4d at the parameters of a SwiGLU of width 8d/3."""

import pytest
import torch

from companion.layers.ffn import ACTIVATIONS, FeedForward, GatedFeedForward
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import spec_row, tiny


def test_value_and_slope_match_the_formula():
    x = torch.linspace(-3, 3, 601, dtype=torch.float64, requires_grad=True)
    y = ACTIVATIONS["relu2"](x)
    (slope,) = torch.autograd.grad(y.sum(), x)
    xd = x.detach()
    # written out without relu: x² where x > 0, else 0; the slope 2x where x > 0
    expected = torch.where(xd > 0, xd * xd, torch.zeros_like(xd))
    torch.testing.assert_close(y.detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(slope, torch.where(xd > 0, 2 * xd, 0 * xd))
    assert ACTIVATIONS["relu2"](torch.tensor(2.5)).item() == 6.25  # not relu's 2.5


def test_slope_is_continuous_at_zero_unlike_relu():
    h = 1e-6
    x = torch.tensor([-h, 0.0, h], dtype=torch.float64, requires_grad=True)
    for name, jump in (("relu2", 0.0), ("relu", 1.0)):
        (slope,) = torch.autograd.grad(ACTIVATIONS[name](x).sum(), x)
        assert (slope[2] - slope[0]).item() == pytest.approx(jump, abs=1e-5)


def test_odd_part_is_z_abs_z_not_z():
    z = torch.linspace(-4, 4, 801, dtype=torch.float64)
    act = ACTIVATIONS["relu2"]
    torch.testing.assert_close(act(z) - act(-z), z * z.abs(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [24, 48, 96])
def test_relu2_mlp_has_the_parameters_of_a_swiglu(d):
    mlp = FeedForward(d, 4 * d, "relu2", bias=False)
    glu = GatedFeedForward(d, 8 * d // 3, "silu")
    n = [sum(p.numel() for p in m.parameters()) for m in (mlp, glu)]
    assert n[0] == n[1] == 8 * d * d
    x = torch.randn(5, d)
    manual = mlp.down(torch.relu(mlp.up(x)) ** 2)
    torch.testing.assert_close(mlp(x), manual)


def test_a_decoder_takes_relu2():
    cfg = tiny(ffn="mlp", activation="relu2", d_ff=128)
    assert isinstance(cfg, ModelConfig) and cfg.activation == "relu2"
    model = DecoderLM(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert logits.shape == (2, 8, cfg.vocab_size)
    assert spec_row(cfg)["ffn"].startswith("ReLU² MLP")
    assert "GLU" in spec_row(cfg.replace(ffn="glu"))["ffn"]
