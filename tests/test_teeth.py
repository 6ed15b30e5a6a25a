"""Tests written to kill mutations that `make mutants` (tools/mutants.py) found alive:
each compares a mechanism with transformers' own module, not with our formula."""

import pytest
import torch


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_eps_matters_like_transformers(offset, dtype):
    """Inputs whose mean square (1e-6) is the size of eps: dropping eps or using
    another changes the output by ~30 %, on the fused and on the upcast path."""
    modeling = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from companion.layers.norms import RMSNorm

    torch.manual_seed(0)
    ours = RMSNorm(16, eps=1e-6, offset=offset).to(dtype)
    if offset:
        theirs = modeling.Gemma3RMSNorm(16, eps=1e-6)
    else:
        theirs = llama.LlamaRMSNorm(16, eps=1e-6)
    theirs = theirs.to(dtype)
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.5)
        ours.weight.copy_(theirs.weight)
    x = (1e-3 * torch.randn(4, 16)).to(dtype)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(ours(x), theirs(x), **tol)


@pytest.mark.parametrize("name", ["yarn", "yarn-mscale"])
def test_rope_cos_sin_carry_the_attention_scale_like_transformers(name):
    """YaRN multiplies cos and sin by its attention scale (1 + 0.1 ln s): our cos/sin
    equal transformers' rotary module's, scale included."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from companion.ops.rope import RopeScaling, rope_cos_sin, rope_frequencies

    scaling = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    }
    if name == "yarn-mscale":
        scaling |= {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )
    rotary = LlamaRotaryEmbedding(cfg)
    positions = torch.arange(0, 500, 7)
    cos_t, sin_t = rotary(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    inv, attn = rope_frequencies(
        32, 10000.0, RopeScaling.from_mapping(scaling), 1.0, 512
    )
    assert attn != pytest.approx(1.0)  # the case where the scale matters
    cos, sin = rope_cos_sin(positions, inv, attn)
    torch.testing.assert_close(cos, cos_t[0, :, :16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, sin_t[0, :, :16], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("temperature", "top_k"), [(0.5, None), (2.0, None), (0.7, 5)])
def test_sampling_draws_like_transformers_warpers(temperature, top_k):
    """``sample`` draws what multinomial draws, with the same generator, from the
    distribution transformers' temperature and top-k warpers make of the logits."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    from companion.models.generation import sample

    torch.manual_seed(0)
    logits = 3.0 * torch.randn(6, 40)
    warped = lp.TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        warped = lp.TopKLogitsWarper(top_k)(None, warped)
    probs = torch.softmax(warped, dim=-1)
    for seed in range(5):
        want = torch.multinomial(
            probs, 1, generator=torch.Generator().manual_seed(seed)
        )
        got = sample(logits, temperature, top_k, torch.Generator().manual_seed(seed))
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("t", "s", "block_q", "block_k"),
    [(17, 17, 16, 16), (9, 9, 4, 1), (6, 11, 2, 3), (8, 8, 3, 5)],
    ids=["T17-b16", "bk1", "S>T", "uneven"],
)
def test_tiled_causal_reads_every_visible_key(t, s, block_q, block_k):
    """Causal tiled attention, tiles ending anywhere relative to the diagonal (a query
    block whose last visible key starts a key tile included), against a brute-force
    softmax per query over keys 0..i + S - T, forward and gradients."""
    from companion.ops.tiled import tiled_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (t, s, s))
    q.requires_grad_(True)
    out = tiled_attention(q, k, v, causal=True, block_q=block_q, block_k=block_k)
    want = torch.empty_like(out)
    for i in range(t):
        last = i + s - t
        scores = (q[:, :, i, None] * k[:, :, : last + 1]).sum(-1) / 8**0.5  # (1, 2, L)
        w = torch.softmax(scores, dim=-1)
        want[:, :, i] = (w[..., None] * v[:, :, : last + 1]).sum(-2)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    (ga,) = torch.autograd.grad((out * g).sum(), q)
    (gb,) = torch.autograd.grad((want * g).sum(), q)
    torch.testing.assert_close(ga, gb)
