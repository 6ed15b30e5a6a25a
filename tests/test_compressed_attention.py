"""DeepSeek-V4 attention: the pooling's reference and blocked forms agree (outputs and
gradients); the layer equals transformers' DeepseekV4Attention for each layer kind
(sliding, CSA, HCA), forward and backward; cached decoding, token by token and in
chunks across block boundaries, equals the full forward; bad input leaves a cache
unchanged.
"""

import pytest
import torch

from companion.layers.compressed_attention import (
    HF_LAYER_TYPES,
    CompressedAttention,
    convert_hf_state_dict,
)
from companion.layers.rotary import RotaryEmbedding
from companion.ops.compressed_attention import (
    blocked_compress,
    naive_compress,
    visible_entries,
)
from companion.ops.rope import RopeScaling


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes run fastest on one thread (and far faster on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- the pooling op


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference of a from the reference b."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _pool_inputs(blocks: int, ratio: int, width: int, prev: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, blocks * ratio, width)
    kv = torch.randn(shape, generator=g)
    gate = 2 * torch.randn(shape, generator=g)
    bias = torch.randn(ratio, width, generator=g)
    extra = {}
    if prev:
        extra = {
            "prev_kv": torch.randn(2, ratio, width, generator=g),
            "prev_gate": 2 * torch.randn(2, ratio, width, generator=g),
        }
    return kv, gate, bias, extra


POOL_CASES = {
    "hca-1block": (1, 4, False, False),
    "hca-3blocks": (3, 4, False, False),
    "hca-ratio1": (5, 1, False, False),
    "csa-3blocks": (3, 4, True, False),
    "csa-1block-prev": (1, 4, True, True),
    "csa-4blocks-prev-ratio3": (4, 3, True, True),
}


@pytest.mark.parametrize("case", POOL_CASES.values(), ids=POOL_CASES.keys())
def test_blocked_compress_equals_naive(case):
    blocks, ratio, overlap, prev = case
    width = 2 * 6 if overlap else 6
    kv, gate, bias, extra = _pool_inputs(blocks, ratio, width, prev)
    leaves = [kv, gate, bias, *extra.values()]
    for t in leaves:
        t.requires_grad_(True)
    outs = []
    for form in (naive_compress, blocked_compress):
        out = form(kv, gate, bias, ratio, overlap=overlap, **extra)
        grads = torch.autograd.grad(out.sin().sum(), leaves)
        outs.append((out, grads))
    (ref, ref_grads), (fast, fast_grads) = outs
    assert fast.shape == (2, blocks, 6)
    assert _rel(fast, ref) < 1e-6
    names = ["kv", "gate", "bias", "prev_kv", "prev_gate"][: len(leaves)]
    for name, gf, gr in zip(names, fast_grads, ref_grads, strict=True):
        assert _rel(gf, gr) < 1e-6, name


@pytest.mark.parametrize(
    "form", [naive_compress, blocked_compress], ids=["naive", "blocked"]
)
def test_prev_rows_continue_a_sequence(form):
    """Pooling blocks 2.. with block 1's rows as prev gives the entries of one call."""
    kv, gate, bias, _ = _pool_inputs(5, 4, 12, prev=False)
    whole = form(kv, gate, bias, 4, overlap=True)
    rest = form(
        kv[:, 8:],
        gate[:, 8:],
        bias,
        4,
        overlap=True,
        prev_kv=kv[:, 4:8],
        prev_gate=gate[:, 4:8],
    )
    assert _rel(rest, whole[:, 2:]) < 1e-6
    alone = form(
        kv[:, 8:], gate[:, 8:], bias, 4, overlap=True
    )  # as if block 2 came first
    assert _rel(alone, whole[:, 2:]) > 1e-3


def test_compress_bad_input():
    kv, gate, bias, extra = _pool_inputs(2, 4, 12, prev=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        blocked_compress(kv[:, :7], gate[:, :7], bias, 4)
    with pytest.raises(ValueError, match="position_bias"):
        naive_compress(kv, gate, bias[:3], 4)
    with pytest.raises(ValueError, match="only read with overlap"):
        blocked_compress(kv, gate, bias, 4, **extra)
    with pytest.raises(ValueError, match="together"):
        blocked_compress(kv, gate, bias, 4, overlap=True, prev_kv=extra["prev_kv"])


def test_visible_entries():
    seen = visible_entries(torch.tensor([0, 2, 3, 4, 7, 8]), 3, 4)
    assert seen.sum(-1).tolist() == [0, 0, 1, 1, 2, 2]


# ---------------------------------------------------------------- the layer vs transformers

DIMS = {"d_model": 32, "n_heads": 4, "head_dim": 16}
WINDOW, RATIOS, T = (
    6,
    {"csa": 4, "hca": 8},
    40,
)  # T > W, > m, and T/4 = 10 > index_topk = 3
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
KIND_OF = {v: k for k, v in HF_LAYER_TYPES.items()}


def _hf_config(rope_parameters=None):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=DIMS["d_model"],
        num_hidden_layers=3,
        num_attention_heads=DIMS["n_heads"],
        head_dim=DIMS["head_dim"],
        q_lora_rank=24,
        partial_rotary_factor=0.5,
        layer_types=list(HF_LAYER_TYPES),
        compress_rates={KIND_OF[k]: m for k, m in RATIOS.items()},
        sliding_window=WINDOW,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=12,
        index_topk=3,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        hc_mult=2,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _ours_from_config(cfg, kind: str, impl: str = "reference") -> CompressedAttention:
    """The builder's mapping from transformers' config fields."""
    rp = cfg.rope_parameters["main" if kind == "sliding" else "compress"]
    scaling = {
        k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")
    }
    rope = RotaryEmbedding(
        cfg.head_dim,
        theta=rp["rope_theta"],
        scaling=RopeScaling.from_mapping(scaling),
        partial_rotary_factor=rp["partial_rotary_factor"],
        max_len=128,
    )
    return CompressedAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        window=cfg.sliding_window,
        rope=rope,
        kind=kind,
        compress_ratio=RATIOS.get(kind, 0),
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        norm_eps=cfg.rms_norm_eps,
        impl=impl,
    )


def _pair(kind: str, impl: str = "reference", rope_parameters=None, seed: int = 0):
    """transformers' attention with random weights (norms away from 1, sinks and position
    biases away from 0) and ours with the same tensors."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    cfg = _hf_config(rope_parameters)
    torch.manual_seed(seed)
    hf = DeepseekV4Attention(cfg, list(HF_LAYER_TYPES.values()).index(kind))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if p.ndim == 1 or "position_bias" in name else 0.3)
    ours = _ours_from_config(cfg, kind, impl)
    ours.load_state_dict(
        convert_hf_state_dict(hf.state_dict())
    )  # strict: names and shapes
    return cfg, hf, ours


def _hf_forward(cfg, hf, x):
    """As DeepseekV4Model and its decoder layer call it: both RoPE tables, the sliding
    causal mask, position ids."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4RotaryEmbedding,
    )

    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    rotary = DeepseekV4RotaryEmbedding(cfg)
    emb = {k: rotary(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos
    )
    return hf(
        x, position_embeddings=emb, position_ids=pos, attention_mask=mask, cache=None
    )[0]


def _assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


HF_CASES = {
    "sliding": ("sliding", "reference", None),
    "hca": ("hca", "reference", None),
    "csa": ("csa", "reference", None),
    "hca-sdpa": ("hca", "sdpa", None),
    "csa-sdpa": ("csa", "sdpa", None),
    "hca-yarn": ("hca", "reference", YARN),
    "csa-yarn": ("csa", "sdpa", YARN),
}


@pytest.mark.parametrize("case", HF_CASES.values(), ids=HF_CASES.keys())
def test_equals_transformers(case):
    kind, impl, rope_parameters = case
    cfg, hf, ours = _pair(kind, impl, rope_parameters)
    x = torch.randn(2, T, DIMS["d_model"], generator=torch.Generator().manual_seed(1))
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref, out = _hf_forward(cfg, hf, x_hf), ours(x_ours)
    _assert_close(out, ref)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * weight).sum().backward()
    (out * weight).sum().backward()
    _assert_close(x_ours.grad, x_hf.grad)
    ours_grads = dict(ours.named_parameters())
    for name, p in convert_hf_state_dict(dict(hf.named_parameters())).items():
        if p.grad is None:  # the indexer: its top-k choice passes no gradient, in both
            assert ours_grads[name].grad is None, name
            continue
        _assert_close(ours_grads[name].grad, p.grad)


@pytest.mark.parametrize("kind", ["hca", "csa"])
@pytest.mark.parametrize("length", [1, 3, 9])
def test_short_sequences_equal_transformers(kind, length):
    """Fewer tokens than a block (no entry yet), and one block plus a little."""
    cfg, hf, ours = _pair(kind)
    x = torch.randn(
        2, length, DIMS["d_model"], generator=torch.Generator().manual_seed(4)
    )
    _assert_close(ours(x), _hf_forward(cfg, hf, x))


def test_every_mechanism_matters():
    """In these shapes the compressed entries, the indexer's choice and the sinks each
    change the output: the comparison above would catch a layer that skipped one."""
    x = torch.randn(1, T, DIMS["d_model"], generator=torch.Generator().manual_seed(1))
    for kind in ("hca", "csa"):
        cfg, hf, ours = _pair(kind)
        ref = _hf_forward(cfg, hf, x)
        windowed = _ours_from_config(cfg, "sliding")
        windowed.rope = ours.rope
        windowed.load_state_dict(ours.state_dict(), strict=False)  # no compressor
        assert (windowed(x) - ref).abs().max() > 1e-2, kind
        with torch.no_grad():
            ours.sinks.zero_()
        assert (ours(x) - ref).abs().max() > 1e-2, kind
    ours.load_state_dict(convert_hf_state_dict(hf.state_dict()))
    ours.compressor.indexer.topk = T  # every visible entry instead of the best 3
    assert (ours(x) - ref).abs().max() > 1e-2


# ---------------------------------------------------------------- decoding with a cache

CHUNKINGS = {
    "token-by-token": [1] * T,
    "prefill5-then-1": [5] + [1] * (T - 5),
    "prefill13-chunks3": [13] + [3] * 9,  # chunks that start and end inside blocks
    "prefill17-then-1": [17]
    + [1] * (T - 17),  # past two HCA blocks, then one at a time
}


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_cached_decoding_equals_full_forward(kind, chunks):
    _, _, ours = _pair(kind, "sdpa")
    x = torch.randn(2, T, DIMS["d_model"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(x)
        cache = ours.new_cache(2, 48)
        outs, start = [], 0
        for n in chunks:
            outs.append(
                ours(x[:, start : start + n], torch.arange(start, start + n), cache)
            )
            start += n
    assert start == T
    _assert_close(torch.cat(outs, dim=1), full)


def test_bad_calls_leave_the_cache_unchanged():
    _, _, ours = _pair("csa")
    x = torch.randn(1, 10, DIMS["d_model"])
    cache = ours.new_cache(1, 12)
    with torch.no_grad():
        ours(x[:, :6], torch.arange(6), cache)
    before = {k: v.clone() for k, v in cache.state_dict(keep_vars=True).items()}
    before_pos = cache.pos.clone()
    bad_calls = {
        "past max_len": (x, torch.arange(6, 16)),
        "not consecutive": (x[:, :2], torch.tensor([6, 8])),
        "positions shape": (x[:, :2], torch.tensor([6])),
    }
    for what, (xs, pos) in bad_calls.items():
        with pytest.raises(ValueError, match="positions"):
            ours(xs, pos, cache)
        for k, v in cache.state_dict().items():
            assert torch.equal(v, before[k]), (what, k)
        assert torch.equal(cache.pos, before_pos), what
    with pytest.raises(ValueError, match="no mask"):
        ours(x, mask=torch.ones(10, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="start at 0"):
        ours(x, torch.arange(3, 13))
    with pytest.raises(ValueError, match="kind"):
        _ours_from_config(_hf_config(), "dense")
