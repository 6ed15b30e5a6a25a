"""Linear attention, the delta rule and Gated DeltaNet (chapter 11): the chunked forms equal the
recurrent references (outputs, states and gradients), the layer equals transformers' Qwen3-Next
Gated DeltaNet, and cached decoding equals the full forward."""

import argparse

import pytest
import torch
import torch.nn.functional as F

from companion.bench import deltanet as bench_deltanet_module
from companion.layers.gated_deltanet import RULES, GatedDeltaNet
from companion.ops.delta_rule import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
)
from companion.ops.linear_attention import (
    chunk_linear_attention,
    l2norm,
    parallel_linear_attention,
    recurrent_linear_attention,
)

B, HK, H, DK, DV = 2, 1, 2, 8, 4  # two value heads share one query/key head

# name -> (chunk form, recurrent form, per-head gate arguments, extra keyword arguments)
OPS = {
    "linear": (chunk_linear_attention, recurrent_linear_attention, (), {}),
    "delta": (
        chunk_delta_rule,
        recurrent_delta_rule,
        ("beta",),
        {"use_qk_l2norm_in_kernel": True},
    ),
    "gated": (
        chunk_gated_delta_rule,
        recurrent_gated_delta_rule,
        ("g", "beta"),
        {"use_qk_l2norm_in_kernel": True},
    ),
}


def _inputs(
    t: int, dtype=torch.float64, seed: int = 0, hk: int = HK, h: int = H
) -> dict:
    """Leaf tensors that require grad: q, k (B, T, H_k, D_k), v (B, T, H, D_v), g, beta, s0."""
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, t, hk, DK, generator=gen),
        "k": 0.3 * torch.randn(B, t, hk, DK, generator=gen),
        "v": torch.randn(B, t, h, DV, generator=gen),
        "g": F.logsigmoid(torch.randn(B, t, h, generator=gen) + 2),
        "beta": torch.rand(B, t, h, generator=gen),
        "s0": 0.5 * torch.randn(B, h, DK, DV, generator=gen),
    }
    return {n: v.to(dtype).requires_grad_() for n, v in x.items()}


def _call(fn, x: dict, gates, state=None, keep=True, **kw):
    return fn(x["q"], x["k"], x["v"], *(x[n] for n in gates), state, keep, **kw)


def _loss_grads(out, state, x: dict, names) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    loss = (
        loss
        + (state * torch.randn(state.shape, generator=gen, dtype=state.dtype)).sum()
    )
    return torch.autograd.grad(loss, [x[n] for n in names])


@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("t", [1, 5, 64, 100, 130], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("op", list(OPS))
def test_chunk_equals_recurrent_forward_and_backward(op, t, chunk_size):
    chunk, recurrent, gates, kw = OPS[op]
    x = _inputs(t)
    names = ["q", "k", "v", *gates, "s0"]
    o_c, s_c = _call(chunk, x, gates, x["s0"], chunk_size=chunk_size, **kw)
    o_r, s_r = _call(recurrent, x, gates, x["s0"], **kw)
    assert o_c.shape == (B, t, H, DV) and s_c.shape == (B, H, DK, DV)
    torch.testing.assert_close(o_c, o_r)
    torch.testing.assert_close(s_c, s_r)
    for name, gc, gr in zip(
        names,
        _loss_grads(o_c, s_c, x, names),
        _loss_grads(o_r, s_r, x, names),
        strict=True,
    ):
        torch.testing.assert_close(gc, gr, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("op", list(OPS))
def test_chunked_prefill_then_recurrent_steps_equals_one_pass(op):
    chunk, recurrent, gates, kw = OPS[op]
    x = {n: v.detach() for n, v in _inputs(50).items()}
    want, want_state = _call(recurrent, x, gates, **kw)
    head = {n: v[:, :37] if n != "s0" else v for n, v in x.items()}
    outs, state = _call(chunk, head, gates, chunk_size=16, **kw)
    outs = [outs]
    for i in range(37, 50):
        step = {n: v[:, i : i + 1] if n != "s0" else v for n, v in x.items()}
        o, state = _call(recurrent, step, gates, state, **kw)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), want)
    torch.testing.assert_close(state, want_state)
    assert _call(chunk, x, gates, keep=False, **kw)[1] is None


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_delta_rule_is_gated_delta_rule_without_decay(form):
    x = _inputs(70)
    zero = torch.zeros_like(x["g"])
    kw = {"chunk_size": 16} if form == "chunk" else {}
    plain = chunk_delta_rule if form == "chunk" else recurrent_delta_rule
    gated = chunk_gated_delta_rule if form == "chunk" else recurrent_gated_delta_rule
    o1, s1 = plain(x["q"], x["k"], x["v"], x["beta"], x["s0"], True, **kw)
    o2, s2 = gated(x["q"], x["k"], x["v"], zero, x["beta"], x["s0"], True, **kw)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2)


def test_linear_attention_is_a_masked_product():
    x = {n: v.detach() for n, v in _inputs(37).items()}
    q, k = (x[n].transpose(1, 2).repeat_interleave(H // HK, dim=1) for n in "qk")
    v = x["v"].transpose(1, 2)  # (B, H, T, D_v)
    scores = (
        q @ k.transpose(-1, -2) * DK**-0.5
    ).tril()  # no softmax: causal mask, then (q kᵀ) v
    want = (scores @ v).transpose(1, 2)
    for fn, kw in (
        (chunk_linear_attention, {"chunk_size": 16}),
        (recurrent_linear_attention, {}),
        (parallel_linear_attention, {}),
    ):
        torch.testing.assert_close(fn(x["q"], x["k"], x["v"], **kw)[0], want)
    o_p, s_p = parallel_linear_attention(x["q"], x["k"], x["v"], x["s0"], True)
    o_c, s_c = chunk_linear_attention(
        x["q"], x["k"], x["v"], x["s0"], True, chunk_size=16
    )
    torch.testing.assert_close(o_c, o_p)
    torch.testing.assert_close(s_c, s_p)


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm_in_kernel", "prenormalised"])
@pytest.mark.parametrize("hk", [1, 2], ids=["H=2Hk", "H=Hk"])
def test_gated_delta_rule_equals_transformers(l2, hk):
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x = {n: v.detach() for n, v in _inputs(100, torch.float32, seed=3, hk=hk).items()}
    q, k = (x["q"], x["k"]) if l2 else (l2norm(x["q"]), l2norm(x["k"]))
    args = (q, x["k"] if l2 else k, x["v"], x["g"], x["beta"])
    opts = {
        "initial_state": x["s0"],
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": l2,
    }
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(*args, chunk_size=64, **opts)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*args, **opts)
    for fn, kw in (
        (chunk_gated_delta_rule, {"chunk_size": 64}),
        (recurrent_gated_delta_rule, {}),
    ):
        o, s = fn(*args, x["s0"], True, use_qk_l2norm_in_kernel=l2, **kw)
        for want_o, want_s in ((o_hc, s_hc), (o_hr, s_hr)):
            torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)


def test_low_precision_inputs_give_their_dtype_and_an_fp32_state():
    x = {
        n: v.detach().to(torch.bfloat16) for n, v in _inputs(20, torch.float32).items()
    }
    o, s = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], None, True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_bad_inputs_raise_clear_errors():
    x = {n: v.detach() for n, v in _inputs(6).items()}
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    with pytest.raises(ValueError, match="q must have shape"):
        chunk_gated_delta_rule(q[0], k, v, g, beta)
    with pytest.raises(ValueError, match="multiple of k's heads"):
        two = (x.expand(-1, -1, 2, -1) for x in (q, k))
        chunk_linear_attention(*two, v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_delta_rule(q, k, v, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        recurrent_linear_attention(q, k, v, x["s0"][:, :, :3])
    with pytest.raises(ValueError, match="at least one token"):
        recurrent_delta_rule(q[:, :0], k[:, :0], v[:, :0], beta[:, :0])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_linear_attention(q, k, v, chunk_size=0)


# --- the Gated DeltaNet layer ---------------------------------------------------------------


def hf_gated_deltanet_to_companion(state_dict: dict) -> dict:
    """transformers ``Qwen3NextGatedDeltaNet`` state dict -> :class:`GatedDeltaNet`'s.

    The names and shapes are the same, so the mapping is the identity, key by key:
    ``in_proj_qkvz.weight``, ``in_proj_ba.weight`` (fused, grouped per key head in the same
    order), ``conv1d.weight (C_conv, 1, K)``, ``dt_bias``, ``A_log``, ``norm.weight`` and
    ``out_proj.weight``; no reshape, no transpose. In a full model the keys sit under
    ``model.layers.{i}.linear_attn.``.
    """
    names = (
        "in_proj_qkvz.weight",
        "in_proj_ba.weight",
        "conv1d.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    )
    return {n: state_dict[n] for n in names}


def _hf_pair(
    hk: int, hv: int, impl: str = "chunk", dk: int = 8, dv: int = 6, d: int = 32
):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextGatedDeltaNet,
    )

    cfg = transformers.Qwen3NextConfig(
        hidden_size=d,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    ref = Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():  # move the ones-initialised parameters off their defaults
        ref.dt_bias.normal_()
        ref.norm.weight.normal_(1.0, 0.3)
    ours = GatedDeltaNet(d, hk, hv, dk, dv, conv_kernel=4, norm_eps=1e-6, impl=impl)
    ours.load_state_dict(hf_gated_deltanet_to_companion(ref.state_dict()), strict=True)
    return cfg, ref, ours


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
@pytest.mark.parametrize(
    "hk,hv", [(2, 2), (1, 2), (2, 4)], ids=["Hv=Hk", "Hv=2Hk", "Hv=2Hk_2"]
)
def test_layer_equals_transformers(hk, hv, impl):
    _, ref, ours = _hf_pair(hk, hv, impl)
    x = torch.randn(
        2, 70, 32, generator=torch.Generator().manual_seed(1)
    )  # 70: not a multiple of 64
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_layer_cached_decoding_equals_transformers_cache():
    DynamicCache = pytest.importorskip("transformers.cache_utils").DynamicCache

    cfg, ref, ours = _hf_pair(1, 2)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    hf_cache, cache = DynamicCache(config=cfg), ours.new_cache(2)
    with torch.no_grad():
        for lo, hi in ((0, 9), (9, 10), (10, 11), (11, 12)):
            want = ref(x[:, lo:hi], cache=hf_cache)
            torch.testing.assert_close(
                ours(x[:, lo:hi], cache=cache), want, atol=1e-5, rtol=1e-5
            )
    # the cache keeps no count of its own (DecodeCache does): after all 12 tokens its state
    # is transformers' state
    torch.testing.assert_close(
        cache.recurrent_state, hf_cache.get_recurrent_state(0), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
@pytest.mark.parametrize("prefill", [1, 3, 13])
def test_layer_prefill_then_steps_equals_full_forward(impl, prefill, rule):
    torch.manual_seed(0)
    layer = GatedDeltaNet(
        24, 2, 4, 8, 4, conv_kernel=4, impl=impl, chunk_size=8, rule=rule
    )
    x = torch.randn(3, 18, 24)
    with torch.no_grad():
        want = layer(x)
        cache = layer.new_cache(3, 18)  # a fixed-size state: max_len is ignored
        outs = [layer(x[:, :prefill], cache=cache)]
        outs += [layer(x[:, i : i + 1], cache=cache) for i in range(prefill, 18)]
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES)
def test_layer_chunk_equals_recurrent_forward_and_backward(rule):
    torch.manual_seed(0)
    chunk = GatedDeltaNet(24, 2, 4, 8, 4, impl="chunk", chunk_size=8, rule=rule)
    recurrent = GatedDeltaNet(24, 2, 4, 8, 4, impl="recurrent", rule=rule)
    recurrent.load_state_dict(chunk.state_dict())
    x = torch.randn(2, 19, 24, dtype=torch.float64)
    chunk.double(), recurrent.double()
    y_c, y_r = chunk(x), recurrent(x)
    torch.testing.assert_close(y_c, y_r, atol=1e-5, rtol=1e-5)
    y_c.square().sum().backward()
    y_r.square().sum().backward()
    for (name, p_c), p_r in zip(
        chunk.named_parameters(), recurrent.parameters(), strict=True
    ):
        if p_c.grad is None:  # a parameter the rule does not use (a, b, the decay)
            assert p_r.grad is None, name
            continue
        torch.testing.assert_close(p_c.grad, p_r.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_delta_rule_layer_is_the_gated_layer_with_no_decay():
    torch.manual_seed(0)
    gated = GatedDeltaNet(24, 2, 4, 8, 4, chunk_size=8)
    delta = GatedDeltaNet(24, 2, 4, 8, 4, chunk_size=8, rule="delta")
    delta.load_state_dict(gated.state_dict())
    with torch.no_grad():
        gated.A_log.fill_(-float("inf"))  # exp(A_log) = 0: g = 0, no decay
    x = torch.randn(2, 19, 24)
    with torch.no_grad():
        torch.testing.assert_close(delta(x), gated(x))


def test_linear_rule_sums_outer_products_without_correction():
    """The state a prefix leaves is Σ k̂ vᵀ over it, so two halves add up: the state of
    the whole is the sum of the states of the halves, each run from zero, which no
    delta rule satisfies (its write depends on what is stored)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 24)
    states = {}
    for rule in ("linear", "delta"):
        layer = GatedDeltaNet(24, 2, 4, 8, 4, conv_kernel=1, chunk_size=4, rule=rule)
        parts = []
        with torch.no_grad():
            for piece in (x, x[:, :9], x[:, 9:]):
                cache = layer.new_cache(2)
                layer(piece, cache=cache)
                parts.append(cache.recurrent_state.clone())
        states[rule] = parts
    whole, first, second = states["linear"]
    torch.testing.assert_close(whole, first + second, atol=1e-5, rtol=1e-5)
    whole, first, second = states["delta"]
    assert (whole - first - second).abs().max() > 1e-2


def test_layer_parameter_count_and_shapes():
    d, hk, hv, dk, dv, k = 32, 2, 4, 8, 6, 4
    layer = GatedDeltaNet(d, hk, hv, dk, dv, conv_kernel=k)
    conv = 2 * hk * dk + hv * dv
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, d),
        "in_proj_ba.weight": (2 * hv, d),
        "conv1d.weight": (conv, 1, k),
        "dt_bias": (hv,),
        "A_log": (hv,),
        "norm.weight": (dv,),
        "out_proj.weight": (d, hv * dv),
    }
    want = (
        d * (2 * hk * dk + 2 * hv * dv)
        + d * 2 * hv
        + conv * k
        + 2 * hv
        + dv
        + hv * dv * d
    )
    assert sum(p.numel() for p in layer.parameters()) == want


def test_layer_bad_arguments_raise():
    with pytest.raises(ValueError, match="impl must be one of"):
        GatedDeltaNet(8, 1, 1, 4, 4, impl="fused")
    with pytest.raises(ValueError, match="rule must be one of"):
        GatedDeltaNet(8, 1, 1, 4, 4, rule="mamba")
    with pytest.raises(ValueError, match="multiple of n_key_heads"):
        GatedDeltaNet(8, 2, 3, 4, 4)


def test_bench_deltanet_smoke():
    rows = bench_deltanet_module.bench_deltanet(
        [8], 2, 4, torch.device("cpu"), 1, chunk_size=4
    )
    assert set(rows[0]) == {"T", "chunk_ms", "hf_chunk_ms", "recurrent_ms"}
    assert "recurrent/chunk" in bench_deltanet_module.format_deltanet(rows)
    parser = argparse.ArgumentParser()
    bench_deltanet_module.add_parser(parser.add_subparsers())
    args = parser.parse_args(["deltanet", "--lengths", "8", "--repeats", "1"])
    assert args.lengths == [8] and callable(args.run)
