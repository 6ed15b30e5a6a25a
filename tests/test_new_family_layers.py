"""The layer pieces two 2026 families need, against transformers live (chapters 11-13):
Qwen3.5's Gated DeltaNet with split input projections, and Trinity's (AFMoE) attention
gate from a projection of its own. The whole families (with SmolLM3 and MiniMax-M2) are
matched through the converter in tests/test_hf_families.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import (  # noqa: E402
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.models.afmoe.modeling_afmoe import (  # noqa: E402
    AfmoeAttention,
    AfmoeRotaryEmbedding,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    Qwen3_5GatedDeltaNet,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeGatedDeltaNet,
)

from companion.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from companion.layers.mha import MultiHeadAttention  # noqa: E402
from companion.layers.rotary import RotaryEmbedding  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults lie outside V=97


# --- Qwen3.5: Gated DeltaNet with split projections -----------------------------------


def _split_pair(hf_cls, hk: int, hv: int, impl: str = "chunk", d: int = 32):
    """transformers' Qwen3.5 Gated DeltaNet and ours (``projections="split"``), with the
    same weights: the names are transformers', so its state dict loads as it is."""
    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=d,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        vocab_size=97,
        **IDS,
    )
    torch.manual_seed(0)
    ref = hf_cls(cfg, layer_idx=0).eval()
    with torch.no_grad():  # move the ones-initialised parameters off their defaults
        ref.dt_bias.normal_()
        ref.norm.weight.normal_(1.0, 0.3)
    ours = GatedDeltaNet(d, hk, hv, 8, 6, 4, 1e-6, impl=impl, projections="split")
    ours.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, ours


@pytest.mark.parametrize(
    "hf_cls,hk,hv,impl",
    [
        (Qwen3_5GatedDeltaNet, 2, 2, "chunk"),
        (Qwen3_5GatedDeltaNet, 1, 3, "chunk"),
        (Qwen3_5GatedDeltaNet, 2, 4, "chunk"),
        (Qwen3_5GatedDeltaNet, 2, 4, "recurrent"),
        (Qwen3_5MoeGatedDeltaNet, 1, 2, "chunk"),
    ],
    ids=["dense-r1", "dense-r3", "dense-r2", "dense-r2-recurrent", "moe-r2"],
)
def test_split_deltanet_equals_transformers(hf_cls, hk, hv, impl):
    _, ref, ours = _split_pair(hf_cls, hk, hv, impl)
    x = torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(1))  # 70 > 64
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **TOL)


@pytest.mark.parametrize("prefill", [1, 5])
def test_split_deltanet_decodes_like_transformers_and_the_full_forward(prefill):
    DynamicCache = pytest.importorskip("transformers.cache_utils").DynamicCache
    cfg, ref, ours = _split_pair(Qwen3_5GatedDeltaNet, 1, 2)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    hf_cache, cache = DynamicCache(config=cfg), ours.new_cache(2, 12)
    pieces = [(0, prefill)] + [(i, i + 1) for i in range(prefill, 12)]
    outs = []
    with torch.no_grad():
        full = ours(x)
        for lo, hi in pieces:
            outs.append(ours(x[:, lo:hi], cache=cache))
            want = ref(x[:, lo:hi], cache=hf_cache)
            torch.testing.assert_close(outs[-1], want, **TOL)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)
    torch.testing.assert_close(
        cache.recurrent_state, hf_cache.get_recurrent_state(0), **TOL
    )


def test_split_deltanet_chunk_equals_recurrent_forward_and_backward():
    torch.manual_seed(0)
    kw = dict(chunk_size=4, projections="split")
    chunk = GatedDeltaNet(16, 1, 2, 4, 4, impl="chunk", **kw).double()
    recurrent = GatedDeltaNet(16, 1, 2, 4, 4, impl="recurrent", **kw).double()
    recurrent.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 10, 16, dtype=torch.float64)  # two and a half chunks
    y_c, y_r = chunk(x), recurrent(x)
    torch.testing.assert_close(y_c, y_r, **TOL)
    y_c.square().sum().backward()
    y_r.square().sum().backward()
    for (name, p_c), p_r in zip(
        chunk.named_parameters(), recurrent.parameters(), strict=True
    ):
        torch.testing.assert_close(p_c.grad, p_r.grad, **TOL, msg=name)


def test_split_and_grouped_layouts_store_the_same_maps():
    """Regrouping the split rows by key head gives the Qwen3-Next layout, same outputs."""
    torch.manual_seed(0)
    hk, hv, dk, dv = 2, 4, 8, 4
    split = GatedDeltaNet(24, hk, hv, dk, dv, projections="split")
    grouped = GatedDeltaNet(24, hk, hv, dk, dv)
    sd, r = split.state_dict(), hv // hk
    q, k, v = sd.pop("in_proj_qkv.weight").split([hk * dk, hk * dk, hv * dv])
    z, b, a = (sd.pop(f"in_proj_{n}.weight") for n in "zba")
    per_head = [  # key head h: [q_h, k_h, v and z of its r value heads]
        t.view(hk, -1, 24) for t in (q, k, v, z)
    ]
    sd["in_proj_qkvz.weight"] = torch.cat(per_head, dim=1).reshape(-1, 24)
    sd["in_proj_ba.weight"] = torch.cat(
        [b.view(hk, r, 24), a.view(hk, r, 24)], dim=1
    ).reshape(-1, 24)
    grouped.load_state_dict(sd, strict=True)
    x = torch.randn(2, 9, 24)
    with torch.no_grad():
        torch.testing.assert_close(grouped(x), split(x), **TOL)


def test_split_deltanet_names_transformers_parameters_and_bad_layouts():
    layer = GatedDeltaNet(32, 2, 4, 8, 6, projections="split")
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    conv = 2 * 2 * 8 + 4 * 6
    assert shapes == {
        "in_proj_qkv.weight": (conv, 32),
        "in_proj_z.weight": (24, 32),
        "in_proj_b.weight": (4, 32),
        "in_proj_a.weight": (4, 32),
        "conv1d.weight": (conv, 1, 4),
        "dt_bias": (4,),
        "A_log": (4,),
        "norm.weight": (6,),
        "out_proj.weight": (32, 24),
    }
    grouped = GatedDeltaNet(32, 2, 4, 8, 6)
    assert sum(p.numel() for p in layer.parameters()) == sum(
        p.numel() for p in grouped.parameters()
    )
    with pytest.raises(ValueError, match="projections must be one of"):
        GatedDeltaNet(8, 1, 1, 4, 4, projections="fused")


# --- Trinity (AFMoE): the output gate from its own projection -------------------------


def _afmoe_pair(layer: int, window: int = 4):
    cfg = transformers.AfmoeConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=window,
        global_attn_every_n_layers=2,  # layer 0 sliding (RoPE), layer 1 full (NoPE)
        rms_norm_eps=1e-5,
        **IDS,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = AfmoeAttention(cfg, layer_idx=layer).eval()
    with torch.no_grad():
        ref.q_norm.weight.normal_(1.0, 0.3)
        ref.k_norm.weight.normal_(1.0, 0.3)
    sliding = cfg.layer_types[layer] == "sliding_attention"
    ours = MultiHeadAttention(
        32,
        4,
        n_kv_heads=2,
        head_dim=8,
        bias=False,
        qk_norm="head",
        norm_eps=1e-5,
        output_gate=True,
        gate_layout="separate",
        causal=True,
        window=window if sliding else None,
        rope=RotaryEmbedding(8, 10000.0, None, 1.0, 64) if sliding else None,
    ).eval()
    w = ref.state_dict()
    qkv = [w[f"{n}_proj.weight"] for n in "qkv"]
    ours.load_state_dict(
        {
            "qkv.weight": torch.cat(qkv),
            "out_proj.weight": w["o_proj.weight"],
            "gate_proj.weight": w["gate_proj.weight"],
            "q_norm.weight": w["q_norm.weight"],
            "k_norm.weight": w["k_norm.weight"],
        },
        strict=True,
    )
    return cfg, ref, ours


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding_rope", "full_nope"])
def test_separate_gate_attention_equals_afmoe(layer):
    cfg, ref, ours = _afmoe_pair(layer)
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(11)[None]
    make = create_sliding_window_causal_mask if layer == 0 else create_causal_mask
    mask = make(
        config=cfg,
        inputs_embeds=x,
        attention_mask=None,
        cache=None,
        position_ids=pos,
        allow_is_causal_skip=False,
    )
    rope = AfmoeRotaryEmbedding(cfg)(x, pos)
    with torch.no_grad():
        want, _ = ref(x, rope, mask)
        torch.testing.assert_close(ours(x), want, **TOL)


@pytest.mark.parametrize("prefill", [1, 5])
def test_separate_gate_decodes_like_the_full_forward(prefill):
    _, _, ours = _afmoe_pair(0, window=3)  # ring buffer: the window is shorter
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(4))
    cache = ours.new_cache(2, 10)
    with torch.no_grad():
        full = ours(x)
        outs = [ours(x[:, :prefill], torch.arange(prefill), cache)]
        for i in range(prefill, 10):
            outs.append(ours(x[:, i : i + 1], torch.tensor([i]), cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)


def test_separate_gate_scales_by_a_sigmoid_of_its_projection():
    torch.manual_seed(0)
    gated = MultiHeadAttention(16, 2, output_gate=True, gate_layout="separate")
    plain = MultiHeadAttention(16, 2)
    plain.load_state_dict(
        {k: v for k, v in gated.state_dict().items() if "gate" not in k}
    )
    assert tuple(gated.qkv.weight.shape) == (48, 16)  # q is not widened
    x = torch.randn(1, 5, 16)
    seen = {}
    plain.out_proj.register_forward_hook(lambda m, i, o: seen.setdefault("o", i[0]))
    with torch.no_grad():
        plain(x)
        g = torch.sigmoid(gated.gate_proj(x))
        want = gated.out_proj(seen["o"] * g)
        torch.testing.assert_close(gated(x), want, **TOL)
    with pytest.raises(ValueError, match="gate_layout must be one of"):
        MultiHeadAttention(16, 2, output_gate=True, gate_layout="fused")
    with pytest.raises(ValueError, match="needs output_gate=True"):
        MultiHeadAttention(16, 2, gate_layout="separate")
