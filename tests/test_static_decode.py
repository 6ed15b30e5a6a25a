"""The static-shape decode step (chapter 08) equals the reference cached decoding."""

from __future__ import annotations

import pytest
import torch

from companion.config import ModelConfig
from companion.model import DecoderLM
from companion.static_decode import StaticDecoder, unsupported_fields

LLAMA_LIKE = dict(
    vocab_size=61,
    d_model=48,
    n_layers=3,
    n_heads=6,
    n_kv_heads=2,
    d_ff=80,
    max_seq_len=40,
    norm="rmsnorm",
    position="rope",
    ffn="glu",
    activation="silu",
    bias=False,
    rope_theta=500.0,
)


def _model(**changes: object) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**{**LLAMA_LIKE, **changes})).eval()
    with torch.no_grad():  # random norm gains, so that a wrong norm shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"n_kv_heads": 6, "tie_embeddings": False},
        {"qkv_bias": True, "attn_scale": 0.3},
        {"qk_norm": "head", "partial_rotary_factor": 0.5},
    ],
    ids=["gqa", "mha-untied", "qkv-bias-scale", "qk-norm-partial-rope"],
)
def test_static_step_generates_the_reference_tokens(changes):
    model = _model(**changes)
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, 20)
    assert torch.equal(StaticDecoder(model).generate(ids, 20), want)


def test_static_step_logits_equal_the_cached_forward():
    model = _model()
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    static = StaticDecoder(model)
    cache = model.new_cache(1, 9)
    with torch.no_grad():
        model(ids[:, :5], cache=cache)
        keys = [layer.k for layer in cache.layers]
        values = [layer.v for layer in cache.layers]
        cos, sin = model.rope_tables(torch.arange(9))["global"]
        full = model(ids)
        for p in range(5, 9):
            got = static._step_eager(ids[:, p : p + 1], torch.tensor([p]), keys, values, cos, sin)
            torch.testing.assert_close(got, full[:, p], atol=1e-5, rtol=1e-5)


def test_unsupported_configs_are_named():
    assert unsupported_fields(_model()) == []
    model = _model(attn_sinks=True, sliding_window=4)
    bad = unsupported_fields(model)
    assert "attn_sinks=True" in bad
    assert any(b.startswith("layer_types=") for b in bad)
    with pytest.raises(ValueError, match=r"attn_sinks=True.*Use model.generate"):
        StaticDecoder(model)
    with pytest.raises(ValueError, match="max_seq_len=40"):
        StaticDecoder(_model()).generate(torch.zeros(1, 30, dtype=torch.long), 11)


def test_compiled_static_step_generates_the_reference_tokens():
    """The opt-in torch.compile path (one layer, to keep compilation to a few seconds). A
    second call with other shapes must not reuse the first graph: only the steps after a
    call's first one skip the guard checks."""
    model = _model(n_layers=1)
    gen = torch.Generator().manual_seed(1)
    static = StaticDecoder(model, compile=True)
    for batch, prompt, new in ((1, 5, 6), (2, 3, 4)):
        ids = torch.randint(0, 61, (batch, prompt), generator=gen)
        assert torch.equal(static.generate(ids, new), model.generate(ids, new))
