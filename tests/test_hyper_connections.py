"""DeepSeek-V4's residual and routing: Sinkhorn, hyper-connections and their head, the
block with a residual rule, √softplus and hash routing, clamped experts; live against
transformers' modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from companion.layers.block import TransformerBlock
from companion.layers.hyper_connections import (
    HyperConnection,
    HyperHead,
    collapse_streams,
    collapse_streams_reference,
    expand_streams,
    hyper_step,
    hyper_step_reference,
    sinkhorn,
    sinkhorn_reference,
)
from companion.layers.mha import MultiHeadAttention
from companion.layers.moe import GLUExperts, MoEFeedForward
from companion.layers.norms import RMSNorm
from companion.layers.router import HashRouter, TopKRouter

D, N_STREAMS, VOCAB, E, K, F_EXPERT = 8, 3, 40, 6, 2, 6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- Sinkhorn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sinkhorn_mixing_matrix_is_doubly_stochastic(dtype):
    torch.manual_seed(0)
    logits = torch.randn(500, 4, 4, dtype=dtype)
    eps = 1e-6
    comb = sinkhorn(logits, 40, eps)  # every column was divided by its sum + eps last
    assert (comb > 0).all()
    assert (comb.sum(-1) - 1).abs().max() <= 1e-6 + 2 * eps
    assert (comb.sum(-2) - 1).abs().max() <= 1e-6 + 2 * eps
    exact = sinkhorn(logits.double(), 60, 0.0)  # without the floor: to rounding
    assert (exact.sum(-1) - 1).abs().max() <= 1e-6
    assert (exact.sum(-2) - 1).abs().max() <= 1e-9


@pytest.mark.parametrize("iters", [1, 2, 20], ids=lambda i: f"iters{i}")
@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"n{n}")
def test_sinkhorn_matches_its_loop_reference_forward_and_backward(n, iters):
    torch.manual_seed(n + iters)
    logits = (2 * torch.randn(3, 5, n, n)).requires_grad_()
    out, ref = sinkhorn(logits, iters), sinkhorn_reference(logits, iters)
    assert _rel(out, ref) < 1e-6
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    assert _rel(g, g_ref) < 1e-5


# ---------------------------------------------------------------- the forms


def _same_forward_and_backward(fast, ref, args) -> None:
    out, want = fast(*args), ref(*args)
    assert out.shape == want.shape and _rel(out, want) < 1e-6
    w = torch.randn_like(out)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    g = torch.autograd.grad((fast(*args) * w).sum(), tensors)
    g_ref = torch.autograd.grad((ref(*args) * w).sum(), tensors)
    for got, exp in zip(g, g_ref, strict=True):
        assert _rel(got, exp) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 4], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("form", ["collapse", "step"])
def test_batched_forms_match_the_stream_loops_forward_and_backward(form, n):
    torch.manual_seed(n)
    b, t, d = 2, 5, 6
    streams = torch.randn(b, t, n, d, requires_grad=True)
    pre = torch.rand(b, t, n, requires_grad=True)
    if form == "collapse":
        _same_forward_and_backward(
            collapse_streams, collapse_streams_reference, (streams, pre)
        )
        return
    post = (2 * torch.rand(b, t, n)).requires_grad_()
    comb = sinkhorn(torch.randn(b, t, n, n), 5).requires_grad_()
    proj = nn.Linear(d, d)

    def branch(h):
        return torch.tanh(proj(h))

    args = (streams, pre, post, comb, branch)
    _same_forward_and_backward(hyper_step, hyper_step_reference, args)


@pytest.mark.parametrize("module", ["connection", "head"])
def test_impl_switch_gives_the_same_module_output_and_gradients(module):
    torch.manual_seed(0)
    if module == "connection":
        layer = HyperConnection(D, N_STREAMS, sinkhorn_iters=4, init_std=0.5)
        mixer = nn.Linear(D, D)

        def run(x):
            return layer(x, RMSNorm(D), None, mixer)

    else:
        layer = HyperHead(D, N_STREAMS, init_std=0.5)
        run = layer
    x = torch.randn(2, 4, N_STREAMS, D)
    results = []
    for impl in ("reference", "batched"):
        layer.impl = impl
        layer.zero_grad()
        out = run(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, [p.grad.clone() for p in layer.parameters()]))
    (out_r, g_r), (out_b, g_b) = results
    assert _rel(out_b, out_r) < 1e-6
    for got, exp in zip(g_b, g_r, strict=True):
        assert _rel(got, exp) < 1e-5


# ---------------------------------------------------------------- live: transformers


def _v4(mlp_layer_types=("hash_moe", "moe"), **overrides):
    transformers = pytest.importorskip("transformers")
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=D,
        moe_intermediate_size=F_EXPERT,
        num_hidden_layers=len(mlp_layer_types),
        mlp_layer_types=list(mlp_layer_types),
        num_attention_heads=2,
        head_dim=8,
        q_lora_rank=4,
        o_groups=1,
        o_lora_rank=4,
        index_n_heads=2,
        index_head_dim=4,
        index_topk=2,
        sliding_window=4,
        n_routed_experts=E,
        num_experts_per_tok=K,
        routed_scaling_factor=1.5,
        hc_mult=N_STREAMS,
        hc_sinkhorn_iters=7,
        hc_eps=1e-4,  # away from rms_norm_eps, so a swap shows
        rms_norm_eps=1e-5,
        swiglu_limit=0.4,  # small, so the clamps bite
    )
    cfg = transformers.DeepseekV4Config(**(kwargs | overrides))
    cfg._experts_implementation = "eager"
    return cfg


def _modeling():
    return pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _randomise(module: nn.Module, seed: int, cfg) -> None:
    """Every parameter and buffer away from its start: norms off 1, biases off 0, a
    random hash table of distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if name.endswith("tid2eid"):
                draw = torch.rand(t.shape[0], cfg.n_routed_experts, generator=gen)
                t.copy_(draw.topk(t.shape[1], dim=-1).indices)
            elif name.endswith(("norm.weight", "scale")):
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
            elif t.is_floating_point():
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))


# transformers' DeepSeek-V4 names -> ours, by prefix (the rest of each name is kept)
HF_TO_OURS = {
    "attn_hc.": "residuals.attn.",
    "ffn_hc.": "residuals.ffn.",
    "input_layernorm.": "attn_norm.",
    "post_attention_layernorm.": "ffn_norm.",
    "self_attn.": "attn.",
    "mlp.gate.tid2eid": "ffn.router.table",
    "mlp.gate.e_score_correction_bias": "ffn.router.selection_bias",
    "mlp.gate.": "ffn.router.",
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up",
    "mlp.experts.down_proj": "ffn.experts.down",
    "mlp.shared_experts.gate_proj.": "ffn.shared.gate.",
    "mlp.shared_experts.up_proj.": "ffn.shared.up.",
    "mlp.shared_experts.down_proj.": "ffn.shared.down.",
}


def v4_layer_state_from_hf(
    hf_state: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """A ``DeepseekV4DecoderLayer``'s state dict under :class:`TransformerBlock`'s
    names."""
    ours = {}
    for name, tensor in hf_state.items():
        prefix = next((p for p in HF_TO_OURS if name.startswith(p)), None)
        if prefix is None:
            raise KeyError(f"no mapping for transformers parameter {name!r}")
        ours[HF_TO_OURS[prefix] + name[len(prefix) :]] = tensor
    return ours


def test_hyper_connection_matches_transformers():
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4HyperConnection(cfg)
    _randomise(hf, 1, cfg)
    ours = HyperConnection(
        D, N_STREAMS, sinkhorn_iters=7, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps
    )
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, N_STREAMS, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        post, comb, collapsed = hf(x)
        pre, our_post, our_comb = ours.coefficients(x)
        for impl in ("reference", "batched"):
            ours.impl = impl
            identity = ours(x, None, None, lambda h: h)  # f = identity: post·h + combᵀx
            want = post[..., None] * collapsed[..., None, :] + comb.mT @ x
            assert (identity - want).abs().max() <= 1e-5, impl
    assert (our_post - post).abs().max() <= 1e-6
    assert (our_comb - comb).abs().max() <= 1e-6
    assert (collapse_streams(x, pre) - collapsed).abs().max() <= 1e-5
    assert comb.std() > 0.05  # the mixing is far from uniform: Sinkhorn had work to do


def test_sinkhorn_equals_transformers_mixing_matrix():
    """transformers' comb, rebuilt from its own module's parameters, through our
    Sinkhorn."""
    m, cfg = _modeling(), _v4(hc_sinkhorn_iters=3)
    hf = m.DeepseekV4HyperConnection(cfg)
    _randomise(hf, 3, cfg)
    x = torch.randn(2, 4, N_STREAMS, D, generator=torch.Generator().manual_seed(4))
    n = N_STREAMS
    with torch.no_grad():
        _, comb, _ = hf(x)
        flat = hf.input_norm(x.flatten(2))
        logits = (flat @ hf.fn.T)[..., 2 * n :] * hf.scale[2] + hf.base[2 * n :]
        logits = logits.unflatten(-1, (n, n))
    for form in (sinkhorn, sinkhorn_reference):
        assert (form(logits, 3, cfg.hc_eps) - comb).abs().max() <= 1e-6


def test_hyper_head_matches_transformers():
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4HyperHead(cfg)
    _randomise(hf, 5, cfg)
    ours = HyperHead(D, N_STREAMS, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, N_STREAMS, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(x)
        for impl in ("reference", "batched"):
            ours.impl = impl
            assert (ours(x) - want).abs().max() <= 1e-5, impl


def test_embedding_expansion_and_head_wire_like_transformers_model():
    """The whole HF model: its first layer reads n copies of the embedding, and its
    output is norm(head(last layer's streams))."""
    m, cfg = _modeling(), _v4()
    torch.manual_seed(7)
    model = m.DeepseekV4Model(cfg).eval()
    _randomise(model.hc_head, 7, cfg)
    seen = {}

    def first_input(mod, args, kwargs):
        seen["in"] = args[0] if args else kwargs["hidden_states"]

    def last_output(mod, args, out):
        seen["out"] = out

    model.layers[0].register_forward_pre_hook(first_input, with_kwargs=True)
    model.layers[-1].register_forward_hook(last_output)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    head = HyperHead(D, N_STREAMS, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    head.load_state_dict(model.hc_head.state_dict())
    with torch.no_grad():
        final = model(input_ids=ids).last_hidden_state
        streams = expand_streams(model.embed_tokens(ids), N_STREAMS)
        assert torch.equal(streams, seen["in"])
        assert (model.norm(head(seen["out"])) - final).abs().max() <= 1e-5


class _Mixer(nn.Module):
    """A small causal token mixer: the running mean of a projection."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, *args, mask=None):
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        return self.proj(x).cumsum(1) / steps  # (B, T, d)


class _AsHfAttention(nn.Module):
    """The same mixer under transformers' attention call: ``(output, weights)``."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x, **kwargs):
        return self.mixer(x), None


def _v4_block(cfg, layer: int, mixer: nn.Module, impl: str) -> TransformerBlock:
    routing = "hash" if cfg.mlp_layer_types[layer] == "hash_moe" else "topk"
    hc = dict(
        sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps
    )
    ffn = MoEFeedForward(
        D,
        E,
        K,
        F_EXPERT,
        scoring=cfg.scoring_func,
        scale=cfg.routed_scaling_factor,
        selection_bias=routing == "topk",
        shared_d_ff=cfg.moe_intermediate_size,
        routing=routing,
        vocab_size=cfg.vocab_size,
        swiglu_limit=cfg.swiglu_limit,
        impl=impl,
    )
    return TransformerBlock(
        mixer,
        ffn,
        norms=(RMSNorm(D, cfg.rms_norm_eps), None, RMSNorm(D, cfg.rms_norm_eps), None),
        residuals={
            "attn": HyperConnection(D, N_STREAMS, **hc),
            "ffn": HyperConnection(D, N_STREAMS, **hc),
        },
    )


@pytest.mark.parametrize("impl", ["reference", "grouped"])
@pytest.mark.parametrize("layer", [0, 1], ids=["hash_moe", "moe"])
def test_block_with_hyper_connections_matches_transformers_decoder_layer(layer, impl):
    """The HF decoder layer with our mixer in place of its attention: HC around both
    sublayers, √softplus or hash routing, clamped experts, the token ids reaching the
    FFN."""
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4DecoderLayer(cfg, layer)
    torch.manual_seed(layer)
    mixer = _Mixer(D)
    hf.self_attn = _AsHfAttention(mixer)
    _randomise(hf, 10 + layer, cfg)
    ours = _v4_block(cfg, layer, mixer, impl)
    state = v4_layer_state_from_hf(hf.state_dict())  # attn.mixer.*: the shared mixer
    ours.load_state_dict(
        {k.replace("attn.mixer.", "attn."): v for k, v in state.items()}
    )
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 5, N_STREAMS, D, generator=gen)
    ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
    with torch.no_grad():
        want = hf(x, input_ids=ids)
        got = ours(x, token_ids=ids) if layer == 0 else ours(x)  # ids: hash layers only
    assert got.shape == (2, 5, N_STREAMS, D)
    assert (got - want).abs().max() <= 1e-5
    if layer == 0:  # the choice came from the table, by token id
        torch.testing.assert_close(
            ours.ffn.last_routing.indices, hf.mlp.gate.tid2eid[ids.reshape(-1)]
        )


def test_block_with_hyper_connections_decodes_like_one_forward():
    """Around a cached causal attention: prefill 5, then one token at a time."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, 2, causal=True, impl="sdpa")
    ffn = MoEFeedForward(
        D, E, K, F_EXPERT, scoring="sqrtsoftplus", routing="hash", vocab_size=VOCAB
    )
    block = TransformerBlock(
        attn,
        ffn,
        norms=(RMSNorm(D), None, RMSNorm(D), None),
        residuals={
            "attn": HyperConnection(D, N_STREAMS, init_std=0.5),
            "ffn": HyperConnection(D, N_STREAMS, init_std=0.5),
        },
    ).eval()
    x = torch.randn(2, 8, N_STREAMS, D)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        full = block(x, torch.arange(8), None, token_ids=ids)
        cache = attn.new_cache(2, 8)
        steps = [block(x[:, :5], torch.arange(5), cache, token_ids=ids[:, :5])]
        for t in range(5, 8):
            pos = torch.tensor([t])
            steps.append(
                block(x[:, t : t + 1], pos, cache, token_ids=ids[:, t : t + 1])
            )
    assert _rel(torch.cat(steps, dim=1), full) < 1e-5


# ---------------------------------------------------------------- routers and experts


def test_sqrtsoftplus_router_matches_transformers_topk_router():
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4TopKRouter(cfg)
    _randomise(hf, 20, cfg)
    ours = TopKRouter(D, E, K, scoring="sqrtsoftplus", scale=1.5, selection_bias=True)
    ours.load_state_dict(
        {"weight": hf.weight, "selection_bias": hf.e_score_correction_bias}
    )
    x = torch.randn(30, D, generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        logits, weights, indices = hf(x)
        our_weights, our_indices, scores = ours(x)
    order = indices.sort(-1)  # transformers leaves its top-k unsorted
    our_order = our_indices.sort(-1)
    assert torch.equal(our_order.values, order.values)
    assert (
        our_weights.gather(-1, our_order.indices) - weights.gather(-1, order.indices)
    ).abs().max() <= 1e-6
    assert (scores - torch.nn.functional.softplus(logits).sqrt()).abs().max() <= 1e-6
    unbiased = scores.topk(K, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, order.values)  # the selection bias changed choices


def test_hash_router_matches_transformers_hash_router():
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4HashRouter(cfg)
    _randomise(hf, 22, cfg)
    ours = HashRouter(D, E, K, VOCAB, scoring="sqrtsoftplus", scale=1.5)
    ours.load_state_dict({"weight": hf.weight, "table": hf.tid2eid})
    gen = torch.Generator().manual_seed(23)
    x, ids = (
        torch.randn(2, 9, D, generator=gen),
        torch.randint(0, VOCAB, (2, 9), generator=gen),
    )
    with torch.no_grad():
        _, weights, indices = hf(x, ids)
        our_weights, our_indices, _ = ours(x.reshape(-1, D), ids)
    assert torch.equal(our_indices, indices)
    assert (our_weights - weights).abs().max() <= 1e-6


def test_fresh_hash_table_spreads_distinct_experts_and_is_reproducible():
    a, b = HashRouter(D, E, K, 500, seed=3), HashRouter(D, E, K, 500, seed=3)
    assert torch.equal(a.table, b.table)
    assert (a.table[:, 0] != a.table[:, 1]).all()  # k distinct experts per id
    assert torch.bincount(a.table.reshape(-1), minlength=E).min() > 100
    assert "table" in dict(a.named_buffers()) and "table" not in dict(
        a.named_parameters()
    )


@pytest.mark.parametrize("impl", ["reference", "grouped"])
def test_clamped_experts_match_transformers(impl):
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4Experts(cfg)
    _randomise(hf, 24, cfg)
    ours = GLUExperts(E, D, F_EXPERT, limit=cfg.swiglu_limit, impl=impl)
    ours.load_state_dict({"gate_up": hf.gate_up_proj, "down": hf.down_proj})
    gen = torch.Generator().manual_seed(25)
    x = torch.randn(20, D, generator=gen)
    indices = torch.rand(20, E, generator=gen).topk(K, dim=-1).indices
    weights = torch.rand(20, K, generator=gen)
    with torch.no_grad():
        want = hf(x, indices, weights)
        assert (ours(x, weights, indices) - want).abs().max() <= 1e-5
        ours.limit = None  # unclamped, it differs: the clamps bit
        assert (ours(x, weights, indices) - want).abs().max() > 1e-2


@pytest.mark.parametrize("layer", [0, 1], ids=["hash_moe", "moe"])
def test_moe_matches_transformers_sparse_moe_block(layer):
    m, cfg = _modeling(), _v4()
    hf = m.DeepseekV4SparseMoeBlock(cfg, layer)
    _randomise(hf, 30 + layer, cfg)
    ours = _v4_block(cfg, layer, _Mixer(D), "grouped").ffn
    state = v4_layer_state_from_hf({f"mlp.{k}": v for k, v in hf.state_dict().items()})
    ours.load_state_dict({k.removeprefix("ffn."): v for k, v in state.items()})
    gen = torch.Generator().manual_seed(31)
    x, ids = (
        torch.randn(2, 7, D, generator=gen),
        torch.randint(0, VOCAB, (2, 7), generator=gen),
    )
    with torch.no_grad():
        want = hf(x, input_ids=ids)
        got = ours(x, token_ids=ids) if layer == 0 else ours(x)
    assert (got - want).abs().max() <= 1e-5


# ---------------------------------------------------------------- bad input


def test_bad_arguments_raise_clear_errors():
    mixer, ffn = _Mixer(D), nn.Linear(D, D)
    hc = {"attn": HyperConnection(D, 2), "ffn": HyperConnection(D, 2)}
    with pytest.raises(ValueError, match="n_streams must be a positive integer"):
        HyperConnection(D, 0)
    with pytest.raises(ValueError, match="sinkhorn_iters must be"):
        HyperConnection(D, 2, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        HyperHead(D, 2, impl="fast")
    with pytest.raises(
        ValueError, match=r"streams must have shape \(B, T, n_streams=2"
    ):
        hc["attn"](torch.randn(2, 3, D), None, None, mixer)
    with pytest.raises(ValueError, match="one module for each sublayer"):
        TransformerBlock(mixer, ffn, residuals={"attn": hc["attn"]})
    with pytest.raises(ValueError, match="other than 'post' and dropout=0"):
        TransformerBlock(
            mixer,
            ffn,
            placement="post",
            norms=(RMSNorm(D), None, RMSNorm(D), None),
            residuals=hc,
        )
    with pytest.raises(ValueError, match="other than 'post' and dropout=0"):
        TransformerBlock(mixer, ffn, dropout=0.1, residuals=hc)
    with pytest.raises(ValueError, match="routing must be one of"):
        MoEFeedForward(D, E, K, F_EXPERT, routing="random")
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        MoEFeedForward(D, E, K, F_EXPERT, routing="hash")
    with pytest.raises(
        ValueError, match="routing='hash' takes its experts from a table"
    ):
        MoEFeedForward(
            D, E, K, F_EXPERT, routing="hash", vocab_size=9, selection_bias=True
        )
    with pytest.raises(ValueError, match="limit must be a positive number"):
        MoEFeedForward(D, E, K, F_EXPERT, swiglu_limit=-1.0)
    with pytest.raises(ValueError, match="scoring must be one of"):
        TopKRouter(D, E, K, scoring="sqrt")
    hashed = MoEFeedForward(D, E, K, F_EXPERT, routing="hash", vocab_size=9)
    with pytest.raises(ValueError, match="token_ids must be given with routing='hash'"):
        hashed(torch.randn(2, 3, D))
    with pytest.raises(ValueError, match="token_ids must be given with routing='hash'"):
        MoEFeedForward(D, E, K, F_EXPERT)(
            torch.randn(2, 3, D), token_ids=torch.zeros(2, 3, dtype=torch.long)
        )
    with pytest.raises(
        ValueError, match=r"token_ids must have the tokens' shape \(2, 3\)"
    ):
        hashed(torch.randn(2, 3, D), token_ids=torch.zeros(2, 4, dtype=torch.long))
