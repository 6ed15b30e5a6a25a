"""The decoder-only LM: shapes, causality, backends agree, generation, input errors."""

import pytest
import torch

from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.rope import RopeScaling


def small(**kw) -> ModelConfig:
    return ModelConfig(
        **{
            "vocab_size": 37,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 24,
            **kw,
        }
    )


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("position", ["learned", "sinusoidal", "none"])
def test_logits_shape_and_causality(placement, position):
    torch.manual_seed(0)
    model = DecoderLM(small(norm_placement=placement, position=position)).eval()
    x = torch.randint(0, 37, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 37)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 37  # change the future: the past logits must not move
    torch.testing.assert_close(model(y)[:, :6], logits[:, :6])


def test_backends_give_the_same_logits_and_gradients():
    torch.manual_seed(0)
    ref = DecoderLM(small(attn_impl="reference"))
    x = torch.randint(0, 37, (3, 17))
    out = {}
    for impl in ("reference", "sdpa", "tiled"):
        m = DecoderLM(small(attn_impl=impl))
        m.load_state_dict(ref.state_dict())
        logits = m(x)
        logits.square().mean().backward()
        out[impl] = (logits.detach(), m.tok_emb.weight.grad.clone())
    for impl in ("sdpa", "tiled"):
        torch.testing.assert_close(
            out[impl][0], out["reference"][0], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            out[impl][1], out["reference"][1], atol=1e-6, rtol=1e-4
        )


def test_padding_mask_hides_left_padding():
    torch.manual_seed(0)
    model = DecoderLM(small(position="none")).eval()
    x = torch.randint(1, 37, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(
        model(padded, attention_mask=mask)[:, 3:], model(x), atol=1e-5, rtol=1e-5
    )


def test_tied_embeddings_are_counted_once():
    tied = DecoderLM(small(tie_embeddings=True))
    untied = DecoderLM(small(tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 37 * 32
    assert (
        tied.num_params(include_embeddings=False)
        == tied.num_params() - 37 * 32 - 24 * 32
    )


def test_greedy_generate_is_argmax_of_the_forward():
    torch.manual_seed(0)
    # init 0.2: at the default 0.02 greedy output repeats the last prompt token, which a
    # generate that never ran the model would reproduce
    model = DecoderLM(small(init_std=0.2)).eval()
    prompt = torch.randint(0, 37, (2, 5))
    out = model.generate(prompt, max_new_tokens=6)
    assert out.shape == (2, 11)
    assert torch.equal(out[:, :5], prompt)
    assert len(set(out[:, 5:].flatten().tolist())) > 4  # not a repeat
    for t in range(5, 11):
        assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_sampling_is_seeded_and_top_k_restricts():
    torch.manual_seed(0)
    model = DecoderLM(small()).eval()
    prompt = torch.randint(0, 37, (1, 4))
    a = model.generate(
        prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    b = model.generate(
        prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(a, b)
    one = model.generate(prompt, 8, temperature=1.0, top_k=1)
    assert torch.equal(one, model.generate(prompt, 8))


def test_generation_runs_past_the_context_by_sliding():
    model = DecoderLM(small(max_seq_len=8)).eval()
    with pytest.warns(UserWarning, match="re-reads the last max_seq_len tokens"):
        out = model.generate(torch.zeros(1, 8, dtype=torch.long), 5)
    assert out.shape == (1, 13)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        pytest.param(
            torch.zeros(5, dtype=torch.long),
            r"input_ids must have shape \(B, T\)",
            id="1d",
        ),
        pytest.param(
            torch.zeros(1, 25, dtype=torch.long),
            "max_seq_len=24; shorten the prompt",
            id="too-long",
        ),
        pytest.param(torch.full((1, 3), 37), r"\[0, vocab_size=37\)", id="id-too-big"),
        pytest.param(torch.full((1, 3), -1), r"\[0, vocab_size=37\)", id="id-negative"),
    ],
)
def test_bad_input_ids_are_named(ids, message):
    model = DecoderLM(small())
    with pytest.raises(ValueError, match=message):
        model(ids)


def test_bad_generation_arguments():
    model = DecoderLM(small())
    x = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        model.generate(x, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be None or an integer in"):
        model.generate(x, 2, temperature=1.0, top_k=0)
    with pytest.raises(
        ValueError, match="max_new_tokens must be a non-negative integer"
    ):
        model.generate(x, -1)


def test_attention_maps_are_causal_distributions():
    model = DecoderLM(small()).eval()
    maps = model.attention_maps(torch.randint(0, 37, (1, 9)))
    assert len(maps) == 2 and maps[0].shape == (1, 4, 9, 9)
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(1, 4, 9))
    assert maps[0].triu(1).abs().max() == 0
    assert not any(
        b.attn._forward_pre_hooks for b in model.blocks
    )  # the hooks are gone
    with torch.no_grad():  # the maps are the weights the forward pass used
        ref = model.blocks[0].attn.attention_weights(
            model.blocks[0].attn_norm(model.embed(torch.zeros(1, 9, dtype=torch.long))),
            torch.arange(9),
        )
    torch.testing.assert_close(
        model.attention_maps(torch.zeros(1, 9, dtype=torch.long))[0], ref
    )


MODERN = {
    "llama-gqa": dict(
        n_kv_heads=2, position="rope", norm="rmsnorm", ffn="glu", activation="silu"
    ),
    "mqa-yarn-interleaved": dict(
        n_kv_heads=1,
        position="rope",
        rope_layout="interleaved",
        rope_scaling=RopeScaling(
            "yarn", factor=4.0, original_max_position_embeddings=8
        ),
    ),
    "qwen3-qknorm-headsize": dict(
        n_kv_heads=2,
        head_dim=12,
        qk_norm="head",
        position="rope",
        norm="rmsnorm",
        bias=False,
    ),
    "mistral-window": dict(n_kv_heads=2, position="rope", sliding_window=5, ffn="glu"),
    "gemma3-sandwich": dict(
        norm_placement="sandwich",
        norm="rmsnorm",
        norm_offset=1.0,
        qk_norm="head",
        sliding_window=4,
        layer_types=("sliding", "full", "sliding"),
        n_layers=3,
        position="rope",
        rope_local_theta=100.0,
        rope_theta=10000.0,
        scale_embeddings=True,
        activation="gelu_tanh",
        ffn="glu",
    ),
    "olmo-post-branch-nope": dict(
        norm_placement="post_branch",
        norm="rmsnorm",
        qk_norm="full",
        position="rope",
        nope_layers=(1,),
        partial_rotary_factor=0.5,
    ),
}


@pytest.mark.parametrize("kw", MODERN.values(), ids=MODERN.keys())
def test_cached_decoding_equals_the_full_forward(kw):
    torch.manual_seed(0)
    model = DecoderLM(small(**kw)).eval()
    x = torch.randint(0, 37, (2, 17))
    full = model(x)
    cache = model.new_cache(2, 17)
    parts = [
        model(x[:, :6], cache=cache)
    ]  # a prefill longer than the window, then steps
    for t in range(6, 17):
        parts.append(model(x[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)
    for impl in ("reference", "tiled"):
        other = DecoderLM(small(**kw, attn_impl=impl)).eval()
        other.load_state_dict(model.state_dict())
        torch.testing.assert_close(other(x), full, atol=1e-5, rtol=1e-4)
    greedy = model.generate(x[:, :4], 8)
    assert torch.equal(greedy, model.generate(x[:, :4], 8, use_cache=False))


def test_rope_model_refuses_to_run_past_its_context():
    model = DecoderLM(small(position="rope", max_seq_len=8)).eval()
    with pytest.raises(ValueError, match="exceed max_seq_len=8"):
        model.generate(torch.zeros(1, 6, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="attention_mask with a cache"):
        model(
            torch.zeros(1, 2, dtype=torch.long),
            torch.ones(1, 2),
            cache=model.new_cache(1, 4),
        )


def test_generation_stops_at_eos_and_pads_finished_rows():
    torch.manual_seed(0)
    model = DecoderLM(small()).eval()
    prompt = torch.randint(0, 37, (2, 4))
    free = model.generate(prompt, 10)
    eos = int(free[0, 6])  # the token row 0 produces third
    out = model.generate(prompt, 10, eos_token_id=eos)
    assert out[0, 6] == eos and out.shape[1] <= free.shape[1]
    row1 = free[1, 4:].tolist()
    stop = row1.index(eos) if eos in row1 else None
    if stop is None:
        assert out.shape[1] == free.shape[1]
    assert (out[0, 7:] == eos).all()
