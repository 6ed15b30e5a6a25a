"""FlexAttention: same outputs as the reference (forward only on CPU), masks built once."""

import pytest
import torch

from companion.layers.kv_cache import position_mask
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops import flex
from companion.ops.attention import naive_attention
from companion.ops.masks import padding_mask

pytestmark = pytest.mark.skipif(
    not flex.available(), reason="torch without FlexAttention"
)


@pytest.mark.parametrize(
    "window", [None, 5, 200], ids=["causal", "window5", "window200"]
)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_block_mask_matches_reference(window, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 150, 16)
    k, v = torch.randn(2, kv_heads, 150, 16), torch.randn(2, kv_heads, 150, 16)
    pos = torch.arange(150)
    block = flex.causal_window_block_mask(150, window=window)
    got = flex.flex_attention_forward(q, k, v, mask=block)
    groups = 4 // kv_heads
    want = naive_attention(
        q,
        k.repeat_interleave(groups, 1),
        v.repeat_interleave(groups, 1),
        mask=position_mask(pos, pos, window),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bool_mask_and_padding():
    """Left padding across a 128-wide block: the fully masked rows (the padded
    queries see no key) are zeros in both forms, and every other row agrees."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 150, 8) for _ in range(3))
    pad = padding_mask(torch.tensor([[1] * 150, [0] * 130 + [1] * 20]))
    got = flex.flex_attention_forward(q, k, v, mask=pad, causal=True)
    want = naive_attention(q, k, v, mask=pad, causal=True)
    assert not want[1, :, :130].any()  # rows with no visible key
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_model_with_flex_equals_sdpa_and_reuses_masks():
    torch.manual_seed(0)
    kw = dict(
        vocab_size=31,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=3,
        position="rope",
        sliding_window=6,
        layer_types=("sliding", "full", "sliding"),
        max_seq_len=64,
    )
    ref = DecoderLM(ModelConfig(**kw, attn_impl="sdpa")).eval()
    fl = DecoderLM(ModelConfig(**kw, attn_impl="flex")).eval()
    fl.load_state_dict(ref.state_dict())
    x = torch.randint(0, 31, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(fl(x), ref(x), atol=1e-5, rtol=1e-4)
        fl(x)
    # each layer builds its BlockMask once per length and reuses it
    assert [len(b.attn._block_masks) for b in fl.blocks] == [1] * len(fl.blocks)
    assert torch.equal(fl.generate(x[:, :5], 6), ref.generate(x[:, :5], 6))


def test_cpu_backward_is_a_clear_error():
    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward pass on the CPU"):
        flex.flex_attention_forward(q, q, q, causal=True)
