"""RoPE: the complex-number reference equals the fast form; frequencies match transformers."""

import math

import pytest
import torch

from companion.ops.rope import (
    RopeScaling,
    apply_rope,
    apply_rope_reference,
    base_inv_freq,
    dynamic_ntk_theta,
    llama3_inv_freq,
    rope_cos_sin,
    rope_frequencies,
    yarn_inv_freq,
)

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "partial"])
def test_fast_rotation_equals_complex_reference(layout, partial):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 16, requires_grad=True)
    inv, scale = rope_frequencies(16, 500.0, partial_rotary_factor=partial)
    cos, sin = rope_cos_sin(torch.arange(11), inv, scale)
    a, b = apply_rope(x, cos, sin, layout), apply_rope_reference(x, cos, sin, layout)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(a)
    ga = torch.autograd.grad((a * g).sum(), x, retain_graph=True)[0]
    gb = torch.autograd.grad((b * g).sum(), x, retain_graph=True)[0]
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.norm(dim=-1), x.norm(dim=-1))  # rotations keep lengths


def test_layouts_are_the_same_rotation_on_permuted_channels():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    cos, sin = rope_cos_sin(torch.arange(5), *rope_frequencies(8))
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # half layout -> interleaved layout
    torch.testing.assert_close(
        apply_rope(x, cos, sin, "half")[:, perm],
        apply_rope(x[:, perm], cos, sin, "interleaved"),
    )


def test_logit_depends_only_on_the_offset():
    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)
    inv, _ = rope_frequencies(16)

    def logit(m: int, n: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([m]), inv)
        ck, sk = rope_cos_sin(torch.tensor([n]), inv)
        return (apply_rope(q[None], cq, sq) @ apply_rope(k[None], ck, sk).T).item()

    assert logit(7, 3) == pytest.approx(logit(104, 100), abs=1e-4)
    assert logit(7, 3) != pytest.approx(logit(8, 3), abs=1e-3)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "partial"])
def test_frequencies_match_transformers(name, partial):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    LlamaConfig = transformers.LlamaConfig

    params = {"rope_type": "default", "rope_theta": 10000.0, **(SCALINGS[name] or {})}
    params["partial_rotary_factor"] = partial
    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters=params,
    )
    kind = params["rope_type"]
    scaling = RopeScaling.from_mapping(SCALINGS[name] or {})
    ours = rope_frequencies(32, 10000.0, scaling, partial, 256, seq_len=600)
    if kind == "default":  # GPT-NeoX's rotary module: the default with partial RoPE
        neox = transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXRotaryEmbedding
        theirs = neox.compute_default_rope_parameters(cfg, None)
    elif kind == "dynamic":
        theirs = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=600)
    else:
        theirs = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    torch.testing.assert_close(ours[0], theirs[0].float(), atol=0, rtol=1e-6)
    assert ours[1] == pytest.approx(theirs[1])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="rope_type must be one of"):
        RopeScaling("ntk-by-parts")
    with pytest.raises(ValueError, match="needs a positive factor"):
        RopeScaling("linear")
    with pytest.raises(ValueError, match="must be even"):
        rope_frequencies(6, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"needs \['low_freq_factor'"):
        RopeScaling("llama3", factor=8.0)
    with pytest.raises(ValueError, match=r"unknown RoPE scaling key\(s\) \['factr'\]"):
        RopeScaling.from_mapping({"type": "linear", "factr": 2.0})
    assert RopeScaling.from_mapping({"type": "linear", "factor": 2.0}) == RopeScaling(
        "linear", 2.0
    )
    assert RopeScaling.from_mapping({"rope_type": "default"}) is None
    with pytest.raises(
        TypeError, match="scaling must be a RopeScaling or None, got dict"
    ):
        rope_frequencies(16, scaling={"rope_type": "linear", "factor": 2.0})
    cos, sin = rope_cos_sin(torch.arange(3), rope_frequencies(16)[0])
    with pytest.raises(ValueError, match="layout must be one of"):
        apply_rope(torch.randn(3, 16), cos, sin, "pairs")
    with pytest.raises(ValueError, match="cover 16 channels but x has only 8"):
        apply_rope(torch.randn(3, 8), cos, sin)
    assert math.isclose(rope_frequencies(16)[1], 1.0)


def test_the_public_scaling_functions_are_what_rope_frequencies_uses():
    inv = base_inv_freq(32, 1e4)
    assert torch.equal(rope_frequencies(32)[0], inv)
    yarn = RopeScaling("yarn", factor=8.0, original_max_position_embeddings=64)
    ours = yarn_inv_freq(inv, 1e4, 8.0, 64)
    assert torch.equal(rope_frequencies(32, scaling=yarn)[0], ours)
    llama = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    llama3 = RopeScaling("llama3", **llama, original_max_position_embeddings=64)
    assert torch.equal(
        rope_frequencies(32, scaling=llama3)[0], llama3_inv_freq(inv, 8.0, 64, 1.0, 4.0)
    )
    dynamic = RopeScaling("dynamic", factor=2.0)
    grown = base_inv_freq(32, dynamic_ntk_theta(1e4, 32, 2.0, 256, 600))
    assert torch.equal(rope_frequencies(32, 1e4, dynamic, 1.0, 256, 600)[0], grown)
    # inside the trained length the dynamic base is the plain one
    assert dynamic_ntk_theta(1e4, 32, 2.0, 256, 100) == 1e4


def test_the_scaling_schemes_keep_fast_pairs_and_slow_down_slow_ones():
    # a Llama 3 head trained on 8192 tokens, stretched 8 times
    inv = base_inv_freq(128, 5e5)
    for new in (
        yarn_inv_freq(inv, 5e5, 8.0, 8192),
        llama3_inv_freq(inv, 8.0, 8192, 1.0, 4.0),
        base_inv_freq(128, dynamic_ntk_theta(5e5, 128, 1.0, 8192, 8 * 8192)),
    ):
        ratio = new / inv
        assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / 8)
        # the slower a pair turns, the more it is slowed down
        assert bool((ratio[1:] <= ratio[:-1] + 1e-6).all())


def test_the_scaling_functions_name_a_bad_argument():
    inv = base_inv_freq(16, 1e4)
    with pytest.raises(ValueError, match="factor must be a positive number, got 0"):
        yarn_inv_freq(inv, 1e4, 0.0, 64)
    with pytest.raises(ValueError, match="beta_slow must be a finite number"):
        yarn_inv_freq(inv, 1e4, 8.0, 64, beta_slow=math.inf)
    with pytest.raises(ValueError, match="trained length must be a positive integer"):
        llama3_inv_freq(inv, 8.0, 64.0, 1.0, 4.0)
    with pytest.raises(ValueError, match="high_freq_factor must be a positive number"):
        llama3_inv_freq(inv, 8.0, 64, 1.0, -4.0)
    with pytest.raises(ValueError, match="trained length must be a positive integer"):
        dynamic_ntk_theta(1e4, 16, 2.0, 0, 100)
