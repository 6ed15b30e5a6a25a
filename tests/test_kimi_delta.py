"""Kimi Delta Attention (chapter 11): the chunked per-channel-gate rule equals its recurrent
reference (outputs, states, gradients) and transformers' KDA functions; a gate equal across
channels is transformers' gated delta rule; the layer equals transformers'
``KimiLinearDeltaAttention`` and ``BailingHybridDeltaAttention``; cached decoding equals the
full forward and transformers' cache."""

import pytest
import torch
import torch.nn.functional as F

from companion.layers.kimi_delta import KimiDeltaAttention
from companion.ops.delta_rule import (
    chunk_gated_delta_rule,
    chunk_kda,
    recurrent_gated_delta_rule,
    recurrent_kda,
)
from companion.ops.linear_attention import l2norm

B, DK, DV = 2, 6, 4
FORMS = {"chunk": chunk_kda, "recurrent": recurrent_kda}


def _inputs(
    t: int, hk: int = 1, h: int = 2, dtype=torch.float64, seed: int = 0
) -> dict:
    """Leaf tensors: q, k (B, T, H_k, D_k), v (B, T, H, D_v), g (B, T, H, D_k), beta, s0."""
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, t, hk, DK, generator=gen),
        "k": torch.randn(B, t, hk, DK, generator=gen),
        "v": torch.randn(B, t, h, DV, generator=gen),
        # channels from nearly no decay to a strong one, so a mixed-up channel shows
        "g": F.logsigmoid(torch.randn(B, t, h, DK, generator=gen) + 2)
        * torch.linspace(0.1, 3, DK),
        "beta": torch.rand(B, t, h, generator=gen),
        "s0": 0.5 * torch.randn(B, h, DK, DV, generator=gen),
    }
    return {n: v.to(dtype).requires_grad_() for n, v in x.items()}


def _run(fn, x: dict, **kw):
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"], True)
    return fn(*args, use_qk_l2norm_in_kernel=True, **kw)


@pytest.mark.parametrize(
    "t,chunk_size,hk",
    [(1, 4, 2), (13, 4, 1), (13, 64, 2), (37, 16, 2), (40, 8, 1)],
    ids=["T1_C4", "T13_C4_H=2Hk", "T13_C64", "T37_C16", "T40_C8_H=2Hk"],
)
def test_chunk_kda_equals_recurrent_forward_and_backward(t, chunk_size, hk):
    x = _inputs(t, hk=hk, h=2)
    o_c, s_c = _run(chunk_kda, x, chunk_size=chunk_size)
    o_r, s_r = _run(recurrent_kda, x)
    assert o_c.shape == (B, t, 2, DV) and s_c.shape == (B, 2, DK, DV)
    torch.testing.assert_close(o_c, o_r, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(s_c, s_r, rtol=1e-7, atol=1e-9)
    gen = torch.Generator().manual_seed(1)
    w_o = torch.randn(o_c.shape, generator=gen, dtype=o_c.dtype)
    w_s = torch.randn(s_c.shape, generator=gen, dtype=s_c.dtype)
    names = ["q", "k", "v", "g", "beta", "s0"]
    grads = [
        torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), [x[n] for n in names])
        for o, s in ((o_c, s_c), (o_r, s_r))
    ]
    for name, gc, gr in zip(names, *grads, strict=True):
        torch.testing.assert_close(
            gc, gr, rtol=1e-7, atol=1e-9, msg=lambda m, n=name: f"grad of {n}: {m}"
        )


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm_in_kernel", "prenormalised"])
def test_kda_equals_transformers_functions(l2):
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    x = {n: v.detach() for n, v in _inputs(37, hk=2, h=2, dtype=torch.float32).items()}
    q, k = (x["q"], x["k"]) if l2 else (l2norm(x["q"]), l2norm(x["k"]))
    args = (q, k, x["v"], x["g"], x["beta"])
    opts = {"output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    o_hr, s_hr = hf.recurrent_kimi_delta_attention(*args, x["s0"], **opts)
    o_hc, s_hc = hf.chunk_kimi_delta_attention(
        *args, chunk_size=16, initial_state=x["s0"], **opts
    )
    for fn, kw in ((chunk_kda, {"chunk_size": 16}), (recurrent_kda, {})):
        o, s = fn(*args, x["s0"], True, use_qk_l2norm_in_kernel=l2, **kw)
        for want_o, want_s in ((o_hr, s_hr), (o_hc, s_hc)):
            torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", list(FORMS))
def test_gate_equal_across_channels_is_the_gated_delta_rule(form):
    # checked against transformers' Qwen3-Next functions, which know only a per-head gate
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x = {n: v.detach() for n, v in _inputs(29, hk=2, dtype=torch.float32).items()}
    g_head = x["g"][..., 0]  # (B, T, H)
    x["g"] = g_head[..., None].expand(-1, -1, -1, DK)
    kw = {"chunk_size": 8} if form == "chunk" else {}
    o, s = _run(FORMS[form], x, **kw)
    args = (x["q"], x["k"], x["v"], g_head, x["beta"])
    opts = {"initial_state": x["s0"], "output_final_state": True}
    o_h, s_h = hf.torch_recurrent_gated_delta_rule(
        *args, use_qk_l2norm_in_kernel=True, **opts
    )
    torch.testing.assert_close(o, o_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_h, atol=1e-5, rtol=1e-5)
    ours = chunk_gated_delta_rule if form == "chunk" else recurrent_gated_delta_rule
    o2, s2 = ours(*args, x["s0"], True, use_qk_l2norm_in_kernel=True, **kw)
    torch.testing.assert_close(o, o2, atol=1e-6, rtol=1e-6)


def test_kda_bad_gates_raise():
    x = {n: v.detach() for n, v in _inputs(5).items()}
    args = (x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match=r"g must have shape \(B, T, H, D_k\)"):
        chunk_kda(*args, x["g"][..., 0], x["beta"])
    with pytest.raises(ValueError, match="g must be finite and <= 0"):
        recurrent_kda(*args, -x["g"] + 0.1, x["beta"])
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_kda(*args, x["g"], x["beta"][..., :1])


# --- the layer against transformers ----------------------------------------------------------

D, H, HD = 32, 2, 8  # model width, heads, head width


def _hf_layer(family: str, safe: bool = True):
    """transformers' KDA module from a tiny config, random weights off their defaults."""
    transformers = pytest.importorskip("transformers")
    common = {
        "hidden_size": D,
        "num_hidden_layers": 1,
        "layer_types": ["linear_attention"],
    }
    if family == "kimi":
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            KimiLinearDeltaAttention as cls,
        )

        cfg = transformers.KimiLinearConfig(
            linear_num_heads=H,
            linear_head_dim=HD,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-5,
            **common,
        )
    else:
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
            BailingHybridDeltaAttention as cls,
        )

        cfg = transformers.BailingHybridConfig(
            num_attention_heads=H,
            head_dim=HD,
            short_conv_kernel_size=3,
            kda_safe_gate=safe,
            kda_lower_bound=-2.0,
            rms_norm_eps=1e-6,
            **common,
        )
    torch.manual_seed(0)
    ref = cls(cfg, layer_idx=0)
    gate = ref.forget_gate
    with torch.no_grad():  # A_log and dt_bias are uninitialised; o_norm is ones
        gate.A_log.copy_(torch.randn(gate.A_log.shape) * 0.3)
        gate.dt_bias.normal_(-2.0 if family == "kimi" or not safe else -3.0, 0.5)
        ref.o_norm.weight.normal_(1.0, 0.3)
    return cfg, ref


def companion_args(cfg) -> dict:
    """KimiDeltaAttention's arguments from a transformers KimiLinearConfig or
    BailingHybridConfig (the linear_* fields both set; Bailing derives them from
    num_attention_heads, its own head_dim and short_conv_kernel_size)."""
    assert cfg.hidden_act == "silu"  # the conv's activation
    bailing = cfg.model_type == "bailing_hybrid"
    bound = cfg.kda_lower_bound if bailing and cfg.kda_safe_gate else None
    return {
        "d_model": cfg.hidden_size,
        "n_heads": cfg.linear_num_heads,
        "head_dim": cfg.linear_head_dim,
        "conv_kernel": cfg.linear_conv_kernel_dim,
        "norm_eps": cfg.rms_norm_eps,
        "layout": "bailing" if bailing else "kimi",
        "gate_lower_bound": bound,
    }


CASES = {
    "kimi": ("kimi", True),
    "bailing": ("bailing", True),
    "bailing_softplus": ("bailing", False),
}


def _pair(case: str, impl: str = "chunk"):
    cfg, ref = _hf_layer(*CASES[case])
    ours = KimiDeltaAttention(**companion_args(cfg), impl=impl, chunk_size=4)
    ours.load_state_dict(ref.state_dict(), strict=True)  # same names and shapes
    return cfg, ref, ours


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_transformers(case, impl):
    _, ref, ours = _pair(case, impl)
    x = torch.randn(2, 13, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # as the decoder layer calls it, on an unpadded batch
        want = ref(hidden_states=x, cache=None, attention_mask=None)
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_cached_decoding_equals_transformers_cache(case):
    DynamicCache = pytest.importorskip("transformers.cache_utils").DynamicCache
    cfg, ref, ours = _pair(case)
    x = torch.randn(2, 13, D, generator=torch.Generator().manual_seed(2))
    hf_cache, cache = DynamicCache(config=cfg), ours.new_cache(2)
    with torch.no_grad():
        for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 10), (10, 11), (11, 13)):
            want = ref(hidden_states=x[:, lo:hi], cache=hf_cache, attention_mask=None)
            got = ours(x[:, lo:hi], cache=cache)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        cache.recurrent_state, hf_cache.get_recurrent_state(0), atol=1e-5, rtol=1e-5
    )


# --- the layer on its own ---------------------------------------------------------------------


def _layer(layout: str, impl: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    bound = -3.0 if layout == "bailing" else None
    layer = KimiDeltaAttention(
        24, 2, 4, 3, layout=layout, gate_lower_bound=bound, impl=impl, chunk_size=4
    )
    with torch.no_grad():  # decays of order 0.1 per token, so the state carries far
        layer.forget_gate.dt_bias.normal_(-3.0, 0.5)
        layer.forget_gate.A_log.zero_()
        layer.o_norm.weight.normal_(1.0, 0.3)
    return layer.to(dtype)


@pytest.mark.parametrize("layout", ["kimi", "bailing"])
@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
@pytest.mark.parametrize("prefill", [1, 5, 13])
def test_layer_prefill_then_steps_equals_full_forward(impl, prefill, layout):
    layer = _layer(layout, impl)
    x = torch.randn(3, 15, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = layer(x)
        cache = layer.new_cache(3, 15)  # a fixed-size state: max_len is ignored
        outs = [layer(x[:, :prefill], cache=cache)]
        outs += [layer(x[:, i : i + 1], cache=cache) for i in range(prefill, 15)]
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["kimi", "bailing"])
def test_layer_chunk_equals_recurrent_forward_and_backward(layout):
    chunk = _layer(layout, "chunk", torch.float64)
    recurrent = _layer(layout, "recurrent", torch.float64)
    recurrent.load_state_dict(chunk.state_dict())
    x = torch.randn(
        2, 11, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    y_c, y_r = chunk(x), recurrent(x)
    torch.testing.assert_close(y_c, y_r, atol=1e-9, rtol=1e-7)
    y_c.square().sum().backward()
    y_r.square().sum().backward()
    for (name, p_c), p_r in zip(
        chunk.named_parameters(), recurrent.parameters(), strict=True
    ):
        assert p_c.grad is not None, name
        torch.testing.assert_close(p_c.grad, p_r.grad, atol=1e-9, rtol=1e-7, msg=name)


def test_layer_bad_arguments_raise_and_leave_the_cache_unchanged():
    with pytest.raises(ValueError, match="layout must be one of"):
        KimiDeltaAttention(24, 2, 4, layout="qwen")
    with pytest.raises(ValueError, match="gate_lower_bound"):
        KimiDeltaAttention(24, 2, 4, layout="bailing", gate_lower_bound=0.5)
    with pytest.raises(ValueError, match="impl must be one of"):
        KimiDeltaAttention(24, 2, 4, impl="triton")
    with pytest.raises(ValueError, match="n_heads must be a positive integer"):
        KimiDeltaAttention(24, 0, 4)
    layer = _layer("kimi", "chunk")
    x = torch.randn(2, 5, 24)
    cache = layer.new_cache(2)
    with torch.no_grad():
        layer(x, cache=cache)
    before = {n: b.clone() for n, b in cache.named_buffers()}
    with pytest.raises(ValueError, match="no attention mask"):
        layer(x, mask=torch.ones(2, 1, 5, 5, dtype=torch.bool), cache=cache)
    with pytest.raises(
        ValueError, match=r"x must have shape \(B, T >= 1, d_model=24\)"
    ):
        layer(x[..., :8], cache=cache)
    with pytest.raises(ValueError, match="cache must hold conv_state"):
        layer(x[:1], cache=cache)
    with pytest.raises(ValueError, match="g must be finite"), torch.no_grad():
        layer.forget_gate.dt_bias[0] = float("nan")  # a gate gone bad fails in the op
        layer(x, cache=cache)
    for n, b in cache.named_buffers():
        torch.testing.assert_close(b, before[n], rtol=0, atol=0, msg=n)
