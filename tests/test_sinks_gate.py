"""Attention sinks and the output gate (chapter 12): the reference formula, the SDPA rewrite
(an extra zero-valued key), gpt-oss's eager attention, and the gate's effect."""

from __future__ import annotations

import pytest
import torch

from companion.layers.mha import MultiHeadAttention
from companion.ops.dispatch import attention
from companion.ops.masks import causal_mask
from companion.ops.sinks import (
    sink_attention_weights,
    sink_naive_attention,
    sink_sdpa_attention,
)


def _qkv(b=2, h=4, h_kv=2, t=5, s=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h_kv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h_kv, s, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    return q, k, v, sinks


def test_sink_weights_sum_to_one_minus_the_sink_share():
    q, k, v, sinks = _qkv()
    w = sink_attention_weights(q, k, sinks)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) / 8**0.5
    lse = torch.logsumexp(scores, dim=-1)
    expected = torch.sigmoid(lse - sinks.view(1, -1, 1))  # mass left for the real keys
    torch.testing.assert_close(w.sum(-1), expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_sink_key_equals_the_reference_forward_and_backward(causal, masked):
    q, k, v, sinks = _qkv()
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    mask = mask if masked else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = sink_naive_attention(*leaves, mask=mask, causal=causal)
    grads_ref = torch.autograd.grad(ref.square().sum(), leaves)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    fast = sink_sdpa_attention(*leaves2, mask=mask, causal=causal)
    grads_fast = torch.autograd.grad(fast.square().sum(), leaves2)
    torch.testing.assert_close(fast, ref)
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_sinks_match_gpt_oss_eager_attention():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, sinks = (t.float() for t in _qkv(t=6, s=6))
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    additive = torch.zeros(6, 6).masked_fill(~causal_mask(6, 6), float("-inf"))
    theirs, _ = gpt_oss.eager_attention_forward(
        module, q, k, v, additive, scaling=8**-0.5
    )
    ours = attention(q, k, v, impl="sdpa", causal=True, sinks=sinks)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, atol=1e-6, rtol=1e-5)


def test_bad_sinks_and_unsupported_impls_are_named():
    q, k, v, sinks = _qkv()
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
        sink_naive_attention(q, k, v, sinks[:3])
    with pytest.raises(ValueError, match="impl='tiled' has no attention sinks"):
        attention(q, k, v, impl="tiled", sinks=sinks)


def test_mha_with_sinks_and_gate_decodes_like_the_full_forward():
    from companion.layers.kv_cache import KVCache

    torch.manual_seed(0)
    mha = MultiHeadAttention(
        32, 4, n_kv_heads=2, sinks=True, output_gate=True, causal=True
    ).eval()
    torch.nn.init.normal_(mha.sinks)
    x = torch.randn(1, 6, 32)
    full = mha(x)
    cache = KVCache(1, 2, 6, 8)
    steps = [mha(x[:, i : i + 1], torch.tensor([i]), cache) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=1e-5)
    assert mha.qkv.weight.shape == (2 * 32 + 2 * 16, 32)  # q and its gate, then k, v


def test_output_gate_scales_each_channel_by_a_sigmoid():
    torch.manual_seed(0)
    gated = MultiHeadAttention(16, 2, output_gate=True, bias=False, causal=True).eval()
    plain = MultiHeadAttention(16, 2, bias=False, causal=True).eval()
    w = gated.qkv.weight.detach().view(-1, 16)
    q_and_gate, kv = (
        w[:32].view(2, 16, 16),
        w[32:],
    )  # per head: [q_h (8 rows), gate_h (8 rows)]
    plain.qkv.weight.data = torch.cat([q_and_gate[:, :8].reshape(16, 16), kv])
    plain.out_proj.weight.data = gated.out_proj.weight.data
    x = torch.randn(1, 3, 16)
    gate = torch.sigmoid(x @ q_and_gate[:, 8:].reshape(16, 16).T)
    inner = {}
    plain.out_proj.register_forward_hook(lambda m, a, o: inner.setdefault("o", a[0]))
    plain(x)
    expected = gated.out_proj(inner["o"] * gate)
    torch.testing.assert_close(gated(x), expected)
