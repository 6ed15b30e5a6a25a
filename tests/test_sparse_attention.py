"""DeepSeek Sparse Attention: the gather form equals the masked reference, forward and
backward; selecting every key is dense causal attention; the lightning indexer and the
whole DSA layer equal transformers' DeepSeek-V3.2 and GLM-5 (with its shared layers);
cached decoding equals the full forward.
"""

import pytest
import torch
from torch import nn

from companion.layers.block import TransformerBlock
from companion.layers.kv_cache import LatentCache, SparseLatentCache
from companion.layers.lightning_indexer import LightningIndexer, SharedIndexer
from companion.layers.mla import MultiHeadLatentAttention, softmax_scale
from companion.layers.rotary import RotaryEmbedding
from companion.ops.attention import naive_attention
from companion.ops.sparse_attention import (
    gather_sparse_attention,
    masked_sparse_attention,
    selection_mask,
    sparse_attention,
)

# a tiny layer: T = 13 queries, top-5, so the indexer really drops keys. 8 indexer
# heads, not 2: a key whose q·k is negative in every head scores exactly 0 (ReLU), and
# with 2 heads such ties fall at the top-k boundary, where any choice is right.
D, H, CQ, C, R, DN, DV = 48, 4, 24, 16, 8, 8, 12
HI, DI, K, T = 8, 16, 5, 13
MLA_DIMS = {
    "kv_lora_rank": C,
    "qk_nope_head_dim": DN,
    "qk_rope_head_dim": R,
    "v_head_dim": DV,
    "q_lora_rank": CQ,
}
ROPE = RotaryEmbedding(R, 10000.0, max_len=64)

# transformers' attention -> ours: these renames, nothing reshaped; the indexer's names
# (indexer.wq_b, indexer.wk, indexer.k_norm, indexer.weights_proj) are the same in both.
HF_TO_COMPANION = {
    "q_a_layernorm": "q_a_norm",
    "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_a_norm",
    "o_proj": "out_proj",
}


def _rename(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in hf_state.items():
        module, rest = key.split(".", 1)
        out[f"{HF_TO_COMPANION.get(module, module)}.{rest}"] = value
    return out


def _perturb(module: nn.Module, std: float = 0.3) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.uniform_(0.5, 1.5)


def _dsa_layer(
    form: str,
    indexer: LightningIndexer | SharedIndexer | str,
    sparse_impl: str = "gather",
    topk: int = K,
) -> MultiHeadLatentAttention:
    """A DSA layer; ``indexer`` a layout name builds a LightningIndexer of that RoPE
    layout."""
    if isinstance(indexer, str):
        indexer = LightningIndexer(
            D, CQ, n_heads=HI, head_dim=DI, topk=topk, rope=ROPE, rope_layout=indexer
        )
    return MultiHeadLatentAttention(
        D,
        H,
        **MLA_DIMS,
        rope_layout="interleaved",
        scale=softmax_scale(DN + R),
        form=form,
        causal=True,
        rope=ROPE,
        indexer=indexer,
        sparse_impl=sparse_impl,
    )


def _stack(form: str, types: list[str], layout: str, sparse_impl: str = "gather"):
    """Layers as a builder wires GLM-5's indexer_types: a shared layer reuses the last
    full layer's indexer."""
    layers, last = [], None
    for kind in types:
        if kind == "full":
            layer = _dsa_layer(form, layout, sparse_impl)
            last = layer.indexer
        else:
            layer = _dsa_layer(form, SharedIndexer(last), sparse_impl)
        layers.append(layer)
    return nn.ModuleList(layers)


def _run_stack(layers, x, positions=None, caches=None, check=False):
    """What a decoder's loop does: each layer reads the stream the one before wrote
    (``check``: assert every full layer's choice is clear)."""
    outs = []
    for i, layer in enumerate(layers):
        if check and isinstance(layer.indexer, LightningIndexer):
            _assert_clear_choice(layer, x)
        out = layer(x, positions, None if caches is None else caches[i])
        outs.append(out)
        x = x + out
    return outs


def _assert_clear_choice(layer: MultiHeadLatentAttention, x: torch.Tensor) -> None:
    """The K-th best and the next visible key differ clearly for every query, so the
    selection cannot hinge on rounding (or on how topk breaks ties)."""
    with torch.no_grad():
        score = layer.indexer.scores(x, layer.q_a_norm(layer.q_a_proj(x)))
    top = score.sort(dim=-1, descending=True).values
    finite = torch.isfinite(top[..., K])  # queries with more than K visible keys
    assert finite.any()  # the indexer drops keys somewhere
    gap = (top[..., K - 1] - top[..., K])[finite]
    assert gap.min() > 1e-4, f"near-tie in the top-k: gap {gap.min():.2e}"


# ---------------------------------------------------------------- the op
def _selection(b: int, t: int, s: int, k: int, seed: int = 0) -> torch.Tensor:
    """Distinct random keys at or before each query's position (queries continue a
    cached prefix: query i sits at s - t + i), -1 in the empty slots; one row empty."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b * t):
        rows.append(torch.randperm(s, generator=g)[:k])
    idx = torch.stack(rows).view(b, t, k)
    pos = torch.arange(s - t, s)[None, :, None]
    idx = idx.masked_fill(idx > pos, -1)
    idx = idx.masked_fill(torch.rand(b, t, k, generator=g) < 0.2, -1)
    idx[0, 0] = -1  # a query with no key at all outputs zeros
    return idx


@pytest.mark.parametrize(
    "h_kv", [4, 2, 1], ids=["per-head(naive)", "grouped", "one-latent(absorbed)"]
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_gather_equals_masked_forward_and_backward(h_kv, index_dtype):
    torch.manual_seed(0)
    b, h, t, s, d, dv, k = 2, 4, 7, 11, 8, 6, 5
    q = torch.randn(b, h, t, d, requires_grad=True)
    kk = torch.randn(b, h_kv, s, d, requires_grad=True)
    v = torch.randn(b, h_kv, s, dv, requires_grad=True)
    idx = _selection(b, t, s, k).to(index_dtype)
    want = masked_sparse_attention(q, kk, v, idx, scale=0.3)
    got = gather_sparse_attention(q, kk, v, idx, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[0, :, 0].abs().max() == 0  # the empty row
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * g).sum(), (q, kk, v))
    grads_got = torch.autograd.grad((got * g).sum(), (q, kk, v))
    for name, a, bb in zip("qkv", grads_want, grads_got, strict=True):
        torch.testing.assert_close(
            bb, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}"
        )
    # unselected keys get no gradient: the selection is the whole mask
    never = ~selection_mask(idx, s).any(dim=1)  # (B, S)
    assert never.any()
    assert grads_got[1].abs().sum(dim=(1, 3))[never].max() == 0


@pytest.mark.parametrize("impl", ["masked", "gather"])
@pytest.mark.parametrize("h_kv", [4, 1], ids=["per-head", "one-latent"])
def test_selecting_every_key_is_dense_causal_attention(impl, h_kv):
    torch.manual_seed(0)
    b, h, t, d = 2, 4, 9, 8
    q = torch.randn(b, h, t, d, requires_grad=True)
    k = torch.randn(b, h_kv, t, d, requires_grad=True)
    v = torch.randn(b, h_kv, t, 6, requires_grad=True)
    every = torch.arange(t + 3).expand(b, t, -1)  # k = S + 3 >= S slots per query
    idx = every.masked_fill(every > torch.arange(t)[None, :, None], -1)
    got = sparse_attention(q, k, v, idx, impl=impl)
    rep = h // h_kv
    want = naive_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), causal=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    for a, bb in zip(
        torch.autograd.grad((want * g).sum(), (q, k, v)),
        torch.autograd.grad((got * g).sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(bb, a, rtol=1e-5, atol=1e-6)


def test_sparse_op_errors_name_the_argument():
    q, k, v = torch.zeros(1, 4, 3, 8), torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 6)
    with pytest.raises(ValueError, match="impl must be one of"):
        sparse_attention(q, k, v, torch.zeros(1, 3, 2, dtype=torch.long), impl="flash")
    with pytest.raises(ValueError, match="indices must be int64 or int32"):
        gather_sparse_attention(q, k, v, torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match=r"indices must have shape \(B, T, K\)"):
        masked_sparse_attention(q, k, v, torch.zeros(1, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        gather_sparse_attention(
            q,
            torch.zeros(1, 3, 5, 8),
            torch.zeros(1, 3, 5, 6),
            torch.zeros(1, 3, 2, dtype=torch.long),
        )


# ------------------------------------------------------ against transformers
FAMILIES = {  # model_type -> the indexer's RoPE layout there
    "deepseek_v32": "half",
    "glm_moe_dsa": "interleaved",
}


def _hf(family: str, n_layers: int = 1, indexer_types: list[str] | None = None):
    transformers = pytest.importorskip("transformers")
    if family == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

        config_cls, attn_cls, rotary_cls, extra = (
            transformers.DeepseekV32Config,
            m.DeepseekV32Attention,
            m.DeepseekV32RotaryEmbedding,
            {},
        )
    else:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        config_cls, attn_cls, rotary_cls = (
            transformers.GlmMoeDsaConfig,
            m.GlmMoeDsaAttention,
            m.GlmMoeDsaRotaryEmbedding,
        )
        extra = {"indexer_types": indexer_types or ["full"] * n_layers}
    cfg = config_cls(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H,
        num_hidden_layers=n_layers,
        index_n_heads=HI,
        index_head_dim=DI,
        index_topk=K,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **MLA_DIMS,
        **extra,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layers = [attn_cls(cfg, layer_idx=i).eval() for i in range(n_layers)]
    for layer in layers:
        _perturb(layer)
    return layers, rotary_cls(cfg)


def _hf_inputs(rotary, x: torch.Tensor):
    b, t, _ = x.shape
    cos, sin = rotary(x, torch.arange(t)[None].expand(b, -1))
    additive = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
    return (cos, sin), additive


@pytest.mark.parametrize("family", list(FAMILIES))
def test_indexer_matches_transformers(family):
    (hf,), rotary = _hf(family)
    layout = FAMILIES[family]
    ours = _dsa_layer("naive", layout)
    ours.load_state_dict(_rename(hf.state_dict()))
    torch.manual_seed(1)
    x = torch.randn(2, T, D)
    _assert_clear_choice(ours, x)
    rope, additive = _hf_inputs(rotary, x)
    q_resid = hf.q_a_layernorm(hf.q_a_proj(x))
    want = hf.indexer(x, q_resid, rope, additive[:, 0], None).long()  # (B, T, K)
    got = ours.indexer(x, ours.q_a_norm(ours.q_a_proj(x)))
    assert got.shape == want.shape == (2, T, K)
    visible = (
        want <= torch.arange(T)[None, :, None]
    )  # transformers pads with later keys
    for b in range(2):
        for t in range(T):
            assert set(got[b, t][got[b, t] >= 0].tolist()) == set(
                want[b, t][visible[b, t]].tolist()
            )
            assert (got[b, t] >= 0).sum() == min(t + 1, K)  # never a later key


@pytest.mark.parametrize("sparse_impl", ["masked", "gather"])
@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_dsa_layer_matches_transformers_deepseek_v32(form, sparse_impl):
    (hf,), rotary = _hf("deepseek_v32")
    ours = _dsa_layer(form, "half", sparse_impl)
    ours.load_state_dict(_rename(hf.state_dict()))
    torch.manual_seed(1)
    x = torch.randn(2, T, D, requires_grad=True)
    _assert_clear_choice(ours, x.detach())
    want = hf(x, *_hf_inputs(rotary, x))[0]
    got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    (g_want,) = torch.autograd.grad((want * g).sum(), x)
    (g_got,) = torch.autograd.grad((got * g).sum(), x)
    torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)
    # the selection matters: dense causal MLA with the same weights differs
    dense = _dsa_layer(form, "half", sparse_impl, topk=T)
    dense.load_state_dict(ours.state_dict())
    assert (dense(x) - want).abs().max() > 1e-3


GLM_TYPES = ["full", "shared", "full", "shared"]


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_glm_shared_layers_match_transformers(form):
    hf_layers, rotary = _hf("glm_moe_dsa", len(GLM_TYPES), GLM_TYPES)
    assert [hf.indexer is None for hf in hf_layers] == [
        t == "shared" for t in GLM_TYPES
    ]
    ours = _stack(form, GLM_TYPES, "interleaved")
    for hf, layer in zip(hf_layers, ours, strict=True):
        layer.load_state_dict(
            _rename(hf.state_dict())
        )  # a shared layer: no indexer keys
    torch.manual_seed(1)
    x = torch.randn(2, T, D)
    rope, additive = _hf_inputs(rotary, x)
    h, topk, want = x, None, []
    for hf in hf_layers:  # transformers' model loop hands the top-k on
        out, _, topk = hf(h, rope, additive, prev_topk_indices=topk)
        want.append(out)
        h = h + out
    got = _run_stack(ours, x, check=True)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            b, a, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"layer {i}: {m}"
        )
    # layer 3 reuses layer 2's choice, not layer 0's: the choices differ
    assert ours[3].indexer.source is ours[2].indexer
    assert not torch.equal(ours[0].indexer.selection[0], ours[2].indexer.selection[0])


# ------------------------------------------------------------- decoding
@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize("chunks", [[T], [5] + [1] * (T - 5), [4, 1, 8]], ids=str)
def test_cached_decoding_equals_full_forward(form, chunks):
    torch.manual_seed(0)
    layers = _stack(form, GLM_TYPES, "half")
    for layer in layers:
        _perturb(layer, std=0.15)  # outputs of order 1 through the four layers
    torch.manual_seed(1)
    x = torch.randn(2, T, D)
    want = torch.cat(_run_stack(layers, x, check=True), dim=-1)
    caches = [layer.new_cache(2, T + 2) for layer in layers]  # 2 slots stay empty
    assert [type(c) for c in caches] == [SparseLatentCache, LatentCache] * 2
    got, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        got.append(
            torch.cat(_run_stack(layers, x[:, start : start + n], pos, caches), dim=-1)
        )
        start += n
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-5)
    assert caches[0].index.k.shape == (
        2,
        T + 2,
        DI,
    )  # D_I numbers per token beside C + R


def test_blocks_pass_the_choice_on_through_a_decoders_loop():
    """TransformerBlock and the loop of DecoderLM.forward_at need nothing new: the
    shared layer finds the choice on the full layer's indexer."""
    torch.manual_seed(0)
    layers = _stack("absorbed", ["full", "shared"], "interleaved")
    for layer in layers:
        _perturb(layer)
    blocks = [
        TransformerBlock(a, nn.Identity(), norms=(nn.LayerNorm(D),) + (None,) * 3)
        for a in layers
    ]
    torch.manual_seed(1)
    x, positions = torch.randn(1, 6, D), torch.arange(6)
    full = x
    for block in blocks:
        full = block(full, positions, None, mask=None)
    caches = [layer.new_cache(1, 6) for layer in layers]
    step = []
    for i in range(6):
        h = x[:, i : i + 1]
        for block, cache in zip(blocks, caches, strict=True):
            h = block(h, positions[i : i + 1], cache, mask=None)
        step.append(h)
    torch.testing.assert_close(torch.cat(step, dim=1), full, atol=1e-5, rtol=1e-5)


def test_topk_at_least_length_is_dense_mla():
    torch.manual_seed(0)
    for form in ("naive", "absorbed"):
        sparse = _dsa_layer(form, "half", topk=T + 4)
        _perturb(sparse)
        dense = MultiHeadLatentAttention(
            D,
            H,
            **MLA_DIMS,
            rope_layout="interleaved",
            scale=softmax_scale(DN + R),
            form=form,
            causal=True,
            rope=ROPE,
        )
        dense.load_state_dict(sparse.state_dict(), strict=False)  # all but the indexer
        x = torch.randn(2, T, D)
        torch.testing.assert_close(sparse(x), dense(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            sparse.attention_weights(x),
            dense.attention_weights(x),
            atol=1e-6,
            rtol=1e-5,
        )


# ---------------------------------------------------------------- errors
def test_errors_name_the_problem_and_leave_the_caches_alone():
    with pytest.raises(ValueError, match="q_lora_rank"):
        MultiHeadLatentAttention(
            D,
            H,
            **{**MLA_DIMS, "q_lora_rank": 0},
            causal=True,
            indexer=LightningIndexer(D, CQ, n_heads=HI, head_dim=DI, topk=K),
        )
    with pytest.raises(ValueError, match="needs causal=True"):
        MultiHeadLatentAttention(
            D,
            H,
            **MLA_DIMS,
            indexer=LightningIndexer(D, CQ, n_heads=HI, head_dim=DI, topk=K),
        )
    with pytest.raises(ValueError, match="sparse_impl must be one of"):
        _dsa_layer("naive", "half", sparse_impl="flash")
    with pytest.raises(TypeError, match="source must be the LightningIndexer"):
        SharedIndexer(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="topk must be a positive integer"):
        LightningIndexer(D, CQ, n_heads=HI, head_dim=DI, topk=0)
    full, shared = _stack("naive", ["full", "shared"], "half")
    x = torch.randn(1, 4, D)
    with pytest.raises(ValueError, match="the full layer it reuses must run first"):
        shared(x)
    caches = [full.new_cache(1, 8), shared.new_cache(1, 8)]
    with pytest.raises(TypeError, match="cache must be the SparseLatentCache"):
        full(x, torch.arange(4), caches[1])
    full(x, torch.arange(4), caches[0])
    before = [b.clone() for c in caches for b in c.buffers()]
    with pytest.raises(ValueError, match="at other positions"):
        shared(x[:, :1], torch.arange(4, 5), caches[1])
    with pytest.raises(ValueError, match="its head axis must be 1"):
        full(
            x[:, :1],
            torch.arange(4, 5),
            caches[0],
            mask=torch.ones(1, 2, 1, 8, dtype=torch.bool),
        )
    after = [b for c in caches for b in c.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
