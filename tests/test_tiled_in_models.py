"""Tiled attention inside the model: sequences that cross several key tiles, where the
online softmax must rescale what it has summed (one tile would be a plain softmax)."""

from __future__ import annotations

import pytest
import torch

from companion.models.config import ModelConfig
from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecoderLM

BASE = dict(
    vocab_size=53,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=48,
    max_seq_len=256,
    norm="rmsnorm",
    position="rope",
    ffn="glu",
    activation="silu",
    bias=False,
    init_std=0.3,  # large enough that scores differ widely between tiles
)
LAYOUTS = {
    "gqa": {},
    "sliding": {"sliding_window": 70, "layer_types": ("sliding", "full")},
    "mla": {
        "n_kv_heads": 4,
        "mla": MLAConfig(
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
        ),
    },
}


@pytest.mark.parametrize("changes", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_tiled_model_equals_the_reference_across_key_tiles(changes):
    """150 tokens: three 64-wide key tiles; logits and every gradient agree."""
    torch.manual_seed(0)
    ref = DecoderLM(ModelConfig(**{**BASE, **changes, "attn_impl": "reference"}))
    tiled = DecoderLM(ModelConfig(**{**BASE, **changes, "attn_impl": "tiled"}))
    tiled.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 53, (2, 150), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (ref, tiled):
        logits = model(ids)
        (logits.square().mean()).backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_g), (got, got_g) = outs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-3, atol=1e-5, msg=name)
