"""Multi-head latent attention: equals transformers' DeepseekV3Attention; naive = absorbed,
forward and backward; cached decoding equals the full forward; the cache costs (C + R) per token.
"""

import math

import pytest
import torch

from companion.bench.mla import bench_mla, format_mla
from companion.layers.kv_cache import LatentCache, position_mask
from companion.layers.mla import (
    MultiHeadLatentAttention,
    bytes_per_token,
    softmax_scale,
)
from companion.layers.rotary import RotaryEmbedding
from companion.models.config import ModelConfig
from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import PRESETS
from companion.ops.rope import RopeScaling, apply_rope, rope_cos_sin, rope_frequencies

D, H, C, DN, R, DV = 32, 4, 16, 8, 4, 6
DIMS = {
    "kv_lora_rank": C,
    "qk_nope_head_dim": DN,
    "qk_rope_head_dim": R,
    "v_head_dim": DV,
}

# transformers' DeepseekV3Attention -> MultiHeadLatentAttention: the same tensors under these
# names, no reshape or transpose. rope_interleave=True -> rope_layout="interleaved", False ->
# "half"; scale = softmax_scale(qk_nope_head_dim + qk_rope_head_dim, config.rope_parameters);
# norm_eps = 1e-6 (transformers builds both attention RMSNorms with its default eps, not
# rms_norm_eps); q_lora_rank None -> 0.
HF_TO_COMPANION = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_layernorm": "q_a_norm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_a_norm",
    "kv_b_proj": "kv_b_proj",
    "o_proj": "out_proj",
}


def convert_hf_attention(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DeepseekV3Attention state dict, renamed for MultiHeadLatentAttention."""
    out = {}
    for key, value in hf_state.items():
        module, rest = key.split(".", 1)
        out[f"{HF_TO_COMPANION[module]}.{rest}"] = value
    return out


YARN_V3 = {  # DeepSeek-V3's own choice: mscale = mscale_all_dim, so cos/sin stay unscaled
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
HF_CASES = {
    "direct-interleaved": {
        "q_lora_rank": None,
        "rope_interleave": True,
        "scaling": None,
    },
    "qlora-half": {"q_lora_rank": 12, "rope_interleave": False, "scaling": None},
    "qlora-interleaved-yarn": {
        "q_lora_rank": 12,
        "rope_interleave": True,
        "scaling": YARN_V3,
    },
    "direct-half-yarn-uneven": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "scaling": {**YARN_V3, "mscale": 1.0, "mscale_all_dim": 0.7},
    },
}


def _mla(form: str = "naive", q_lora_rank: int = 0, **kw) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(D, H, **DIMS, q_lora_rank=q_lora_rank, form=form, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    return m


def _twins(
    q_lora_rank: int = 0, **kw
) -> tuple[MultiHeadLatentAttention, MultiHeadLatentAttention]:
    naive = _mla("naive", q_lora_rank, **kw)
    absorbed = MultiHeadLatentAttention(
        D, H, **DIMS, q_lora_rank=q_lora_rank, form="absorbed", **kw
    )
    absorbed.load_state_dict(naive.state_dict())  # both forms: the same parameters
    return naive, absorbed


def _rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(positions, *rope_frequencies(R))


ROPE = RotaryEmbedding(R)  # the layers' table: the same cos/sin as _rope, bit for bit


def _hf_pair(case: dict, form: str):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    params = {"rope_type": "default", "rope_theta": 10000.0, **(case["scaling"] or {})}
    cfg = transformers.DeepseekV3Config(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=case["q_lora_rank"],
        **DIMS,
        rope_interleave=case["rope_interleave"],
        max_position_embeddings=128,
        rope_parameters=params,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    scaling = RopeScaling.from_mapping(case["scaling"] or {})
    ours = MultiHeadLatentAttention(
        D,
        H,
        **DIMS,
        q_lora_rank=case["q_lora_rank"] or 0,
        rope_layout="interleaved" if case["rope_interleave"] else "half",
        scale=softmax_scale(DN + R, scaling),
        form=form,
        causal=True,
        rope=RotaryEmbedding(R, 10000.0, scaling, max_len=128),
    )
    ours.load_state_dict(convert_hf_attention(hf.state_dict()))
    return hf, DeepseekV3RotaryEmbedding(cfg), ours


@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize("name", list(HF_CASES))
def test_matches_transformers_deepseek_v3(name, form):
    case = HF_CASES[name]
    hf, rotary, ours = _hf_pair(case, form)
    assert ours.scale == pytest.approx(hf.scaling, rel=1e-12)
    if case["scaling"] is not None:  # YaRN's mscale_all_dim sharpens the softmax
        assert ours.scale > 1.01 / math.sqrt(DN + R)
    torch.manual_seed(1)
    x = torch.randn(2, 7, D, requires_grad=True)
    positions = torch.arange(3, 10)
    cos, sin = rotary(x, positions[None].expand(2, -1))
    additive = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    want = hf(x, (cos, sin), additive)[0]
    got = ours(x, positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    (g_want,) = torch.autograd.grad((want * g).sum(), x)
    (g_got,) = torch.autograd.grad((got * g).sum(), x)
    torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)


def test_interleaved_layout_is_transformers_rope_interleave_up_to_a_permutation():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    torch.manual_seed(0)
    q, k = torch.randn(2, H, 5, R), torch.randn(2, 1, 5, R)
    cos, sin = _rope(torch.arange(5))
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    hq, hk = ds.apply_rotary_pos_emb_interleave(q, k, hf_cos, hf_sin)
    oq, ok = (
        apply_rope(q, cos, sin, "interleaved"),
        apply_rope(k, cos, sin, "interleaved"),
    )
    evens_then_odds = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
    torch.testing.assert_close(
        oq[..., evens_then_odds], hq
    )  # HF de-interleaves its output
    torch.testing.assert_close(ok[..., evens_then_odds], hk)
    torch.testing.assert_close(oq @ ok.mT, hq @ hk.mT)  # ...which no q·k can see
    hq, hk = ds.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)  # rope_interleave=False
    torch.testing.assert_close(apply_rope(q, cos, sin, "half"), hq)
    torch.testing.assert_close(apply_rope(k, cos, sin, "half"), hk)


@pytest.mark.parametrize("impl", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("q_lora_rank", [0, 8], ids=["direct-q", "latent-q"])
def test_absorbed_equals_naive_forward_and_backward(impl, q_lora_rank):
    naive, absorbed = _twins(q_lora_rank, impl=impl, causal=True, rope=ROPE)
    torch.manual_seed(1)
    x = torch.randn(2, 9, D, requires_grad=True)
    mask = torch.rand(2, 1, 9, 9) > 0.3  # arbitrary, with the causal triangle on top
    a = naive(x, mask=mask)  # positions 0..8
    b = absorbed(x, mask=mask)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(a)
    inputs_a, inputs_b = [x, *naive.parameters()], [x, *absorbed.parameters()]
    grads_a = torch.autograd.grad((a * g).sum(), inputs_a)
    grads_b = torch.autograd.grad((b * g).sum(), inputs_b)
    names = ["x", *(n for n, _ in naive.named_parameters())]
    for name, ga, gb in zip(names, grads_a, grads_b, strict=True):
        torch.testing.assert_close(
            gb, ga, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    torch.testing.assert_close(
        absorbed.attention_weights(x, mask=mask),
        naive.attention_weights(x, mask=mask),
    )


@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("chunks", [[10], [1] * 10, [4, 1, 1, 4]], ids=str)
def test_cached_decoding_equals_full_forward(form, window, chunks):
    full = _mla(
        form, q_lora_rank=8, rope=ROPE
    )  # no window, not causal: the mask says all
    m = _mla(form, q_lora_rank=8, causal=True, window=window, rope=ROPE)
    m.load_state_dict(full.state_dict())
    torch.manual_seed(1)
    x = torch.randn(2, 10, D)
    pos = torch.arange(10)
    full_mask = position_mask(pos, pos, window)
    want = full(x, mask=full_mask)
    cache, outs, start = m.new_cache(2, 10), [], 0
    for t in chunks:
        p = pos[start : start + t]
        outs.append(m(x[:, start : start + t], p, cache))
        start += t
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-5, rtol=1e-5)
    assert cache.kv.shape == (2, 10, C + R)  # per token: the latent and one RoPE key


def test_one_cache_serves_both_forms():
    naive, absorbed = _twins(causal=True, rope=ROPE)
    torch.manual_seed(1)
    x, pos = torch.randn(1, 8, D), torch.arange(8)
    want = naive(x)
    cache = naive.new_cache(1, 8)
    head = naive(x[:, :5], pos[:5], cache)  # prefill
    tail = [absorbed(x[:, i : i + 1], pos[i : i + 1], cache) for i in range(5, 8)]
    torch.testing.assert_close(
        torch.cat([head, *tail], dim=1), want, atol=1e-5, rtol=1e-5
    )


def test_cache_bytes_per_token():
    """DeepSeek-V3's latent cache, allocated layer by layer from the preset (whose
    widths are checked against the released config), weighs what the formula says."""
    mla = PRESETS["deepseek-v3"].mla
    n_layers = PRESETS["deepseek-v3"].n_layers
    one = LatentCache(
        1, 1, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype=torch.bfloat16
    )
    allocated = n_layers * one.kv.nbytes
    assert (
        bytes_per_token(mla.kv_lora_rank, mla.qk_rope_head_dim, n_layers) == allocated
    )
    cache = LatentCache(3, 20, 512, 64, dtype=torch.bfloat16)
    assert cache.kv.nbytes == 3 * 20 * bytes_per_token(512, 64)


def test_parameter_shapes():
    shapes = {n: tuple(p.shape) for n, p in _mla(q_lora_rank=0).named_parameters()}
    assert shapes == {
        "q_proj.weight": (H * (DN + R), D),
        "kv_a_proj.weight": (C + R, D),
        "kv_a_norm.weight": (C,),
        "kv_b_proj.weight": (H * (DN + DV), C),
        "out_proj.weight": (D, H * DV),
    }
    shapes = {n: tuple(p.shape) for n, p in _mla(q_lora_rank=8).named_parameters()}
    assert {k: v for k, v in shapes.items() if k.startswith("q_")} == {
        "q_a_proj.weight": (8, D),
        "q_a_norm.weight": (8,),
        "q_b_proj.weight": (H * (DN + R), 8),
    }


@pytest.mark.parametrize(
    "rope",
    [None, {"mscale_all_dim": 1.0}, {"mscale_all_dim": 0.7, "mscale": 1.0}, {}],
    ids=["plain", "v3", "uneven", "no-mscale-all-dim"],
)
def test_softmax_scale_is_transformers_deepseek_v3_scaling(rope):
    """The scale of DeepSeek-V3's attention module, built from a config at V3's head
    widths (192 = 128 + 64) and factor 40, with and without YaRN's mscale_all_dim."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope is not None:
        yarn = {"rope_type": "yarn", "factor": 40.0, **rope}
        params = {**params, **yarn, "original_max_position_embeddings": 4096}
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=16,
        rope_parameters=params,
    )  # fmt: skip
    want = ds.DeepseekV3Attention(cfg, layer_idx=0).scaling
    scaling = None if rope is None else RopeScaling.from_mapping(
        {k: v for k, v in params.items() if k != "rope_theta"}
    )  # fmt: skip
    assert softmax_scale(192, scaling) == pytest.approx(want, rel=1e-12)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="form must be one of"):
        MultiHeadLatentAttention(D, H, **DIMS, form="fused")
    with pytest.raises(ValueError, match="rope_layout must be one of"):
        MultiHeadLatentAttention(D, H, **DIMS, rope_layout="gptj")
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer"):
        MultiHeadLatentAttention(D, H, **{**DIMS, "kv_lora_rank": 0})
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer"):
        MultiHeadLatentAttention(D, H, **{**DIMS, "kv_lora_rank": 8.0})  # not a width
    with pytest.raises(ValueError, match="q_lora_rank must be a non-negative integer"):
        MultiHeadLatentAttention(D, H, **DIMS, q_lora_rank=1.5)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MultiHeadLatentAttention(D, H, **{**DIMS, "qk_rope_head_dim": 3})
    m = _mla()
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, 32\)"):
        m(torch.zeros(1, 3, 8))
    cache = m.new_cache(1, 2)
    with pytest.raises(ValueError, match="needs the query positions"):
        m(torch.zeros(1, 1, D), cache=cache)
    # a layer cache keeps no count: the model's DecodeCache names an overflow
    cfg = ModelConfig(
        vocab_size=10,
        d_model=D,
        n_heads=H,
        n_layers=1,
        position="rope",
        max_seq_len=8,
        mla=MLAConfig(**DIMS),
    )
    model = DecoderLM(cfg).eval()
    assert isinstance(model.blocks[0].attn, MultiHeadLatentAttention)
    with pytest.raises(ValueError, match=r"0 \+ 3 tokens exceed max_len=2"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=model.new_cache(1, 2))


def test_bench_smoke():
    shape = {"d_model": D, "n_heads": H, **DIMS}
    rows = bench_mla([4, 16], torch.device("cpu"), repeats=1, shape=shape)
    assert [r["S"] for r in rows] == [4, 16]
    for r in rows:
        assert r["max_diff"] < 1e-5
        assert r["full_mib"] / r["latent_mib"] == pytest.approx(
            H * (DN + R + DV) / (C + R)
        )
    assert "naive/absorbed" in format_mla(rows)
