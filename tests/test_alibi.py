"""ALiBi (companion.layers.alibi): BLOOM's slopes, the biased attention against an eager
reference written here, and cached decoding equal to the full pass."""

from __future__ import annotations

import math

import pytest
import torch

from companion.layers.alibi import alibi_bias, alibi_slopes, biased_attention
from companion.layers.mha import MultiHeadAttention
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.validation import ConfigError


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 112])
def test_slopes_match_bloom(n_heads: int) -> None:
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    # position 1's bias in BLOOM's tensor is the slope itself: (H, 1, S) for one sequence
    table = bloom.build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)
    assert torch.allclose(alibi_slopes(n_heads), table[:, 0, 1], rtol=1e-6, atol=0)


def test_slopes_power_of_two_closed_form() -> None:
    h = torch.arange(1, 9, dtype=torch.float64)
    assert torch.allclose(alibi_slopes(8).double(), 2 ** (-8 * h / 8))
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(0)


def eager(q, k, v, slopes, q_pos, k_pos, visible):
    """softmax(q·k/√D − m_h |i − j|) v over the visible keys, one head at a time."""
    b, h, t, d = q.shape
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                keys = [j for j in range(k.shape[2]) if visible[bi, i, j]]
                if not keys:
                    continue
                scores = torch.stack(
                    [
                        q[bi, hi, i].double() @ k[bi, hi, j].double() / math.sqrt(d)
                        - slopes[hi].double() * abs(int(q_pos[i]) - int(k_pos[j]))
                        for j in keys
                    ]
                )
                w = torch.softmax(scores, 0)
                out[bi, hi, i] = (w[:, None] * v[bi, hi, keys].double()).sum(0)
    return out


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
def test_biased_attention_matches_eager_reference(impl: str) -> None:
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 7, 8
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    slopes = alibi_slopes(h)
    pos = torch.arange(5, 5 + t)  # positions need not start at 0
    pad = torch.ones(b, t, dtype=torch.bool)
    pad[1, :2] = False  # the second sequence is left-padded
    mask = pad[:, None, None, :]
    bias = alibi_bias(slopes, pos, pos, mask, causal=True)
    assert bias.shape == (b, h, t, t)
    got = biased_attention(q, k, v, bias, impl=impl)
    visible = torch.tril(torch.ones(t, t, dtype=torch.bool))[None] & pad[:, None, :]
    want = eager(q, k, v, slopes, pos, pos, visible)
    assert (got.double() - want).abs().max() < 1e-5
    weights = biased_attention(q, k, v, bias, weights=True)
    rows = visible.any(-1, keepdim=True).float()[:, None, :, 0]  # (B, 1, T): 0 if empty
    assert torch.allclose(weights.sum(-1), rows.expand(b, h, t))


def test_bias_falls_linearly_with_distance() -> None:
    slopes = alibi_slopes(4)
    pos = torch.arange(6)
    bias = alibi_bias(slopes, pos, pos, causal=True)  # (H, T, S)
    assert torch.equal(bias[:, 5, :], -slopes[:, None] * torch.arange(5, -1, -1.0))
    assert torch.isinf(bias[:, 0, 1:]).all()  # the future is hidden
    both_ways = alibi_bias(slopes, pos, pos)  # an encoder's: |i - j| either way
    assert torch.equal(both_ways, both_ways.transpose(1, 2)) and both_ways.max() == 0
    assert torch.equal(both_ways[:, 0, 5], -5 * slopes)
    # equal scores: the weights decay as exp(-m·distance) from the query backwards
    q = torch.zeros(1, 4, 6, 2)
    w = biased_attention(q, q, q, bias, weights=True)[0, :, 5]  # (H, S)
    ratio = w[:, 4] / w[:, 3]
    assert torch.allclose(ratio, torch.exp(slopes), rtol=1e-5)


def alibi_model(**fields) -> DecoderLM:
    cfg = ModelConfig(
        vocab_size=19, d_model=24, n_layers=2, n_heads=3, position="alibi",
        max_seq_len=32, init_std=0.2, **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    return DecoderLM(cfg).eval()


@pytest.mark.parametrize(
    "fields",
    [{}, {"n_kv_heads": 1}, {"sliding_window": 4}, {"attn_impl": "reference"}],
    ids=["mha", "mqa", "window", "reference"],
)
def test_cached_decoding_equals_full_pass(fields: dict) -> None:
    model = alibi_model(**fields)
    assert model.pos_emb is None and model.rope_tables(torch.arange(3)) == {}
    ids = torch.randint(0, 19, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 12)
        steps = [model(ids[:, :5], cache=cache)]  # a prompt, then one token at a time
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(5, 12)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_the_bias_reaches_the_model() -> None:
    """Shifting the text changes nothing (only distances count), and flipping the
    bias's sign changes the logits: the layers use it."""
    model = alibi_model()
    ids = torch.randint(0, 19, (1, 10))
    with torch.no_grad():
        logits = model(ids)
        cache = model.new_cache(1, 30)
        cache.length = 20  # the same tokens read at positions 20..29
        shifted = model(ids, cache=cache)
        assert (shifted - logits).abs().max() < 1e-5
        for block in model.blocks:
            block.attn.alibi = -block.attn.alibi
        assert (model(ids) - logits).abs().max() > 1e-2


def test_unsupported_settings_raise() -> None:
    slopes = alibi_slopes(2)
    for kw in ({"impl": "flex"}, {"impl": "tiled"}, {"sinks": True}):
        with pytest.raises(ValueError, match="alibi needs impl"):
            MultiHeadAttention(8, 2, alibi=slopes, **kw)
    with pytest.raises(ValueError, match="impl must be one of"):
        biased_attention(*(torch.zeros(1, 2, 3, 4),) * 3, torch.zeros(2, 3, 3),
                         impl="tiled")  # fmt: skip
    with pytest.raises(ConfigError, match="rope_scaling"):
        from companion.ops.rope import RopeScaling

        alibi_model(rope_scaling=RopeScaling("linear", 2.0))
