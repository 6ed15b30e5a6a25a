"""companion.checkpoints.transformers: five transformers families, converted, give the same
logits and greedy tokens."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from companion.checkpoints.transformers import (  # noqa: E402
    convert_state_dict,
    from_hf,
    load_state_dict_strict,
)
from companion.checkpoints.transformers_config import config_from_hf  # noqa: E402
from companion.models.decoder import DecoderLM  # noqa: E402
from companion.models.generation import decode_one_token, prefill  # noqa: E402

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, max_position_embeddings=64
)
FAMILIES = {
    "llama-gqa": (
        transformers.LlamaConfig,
        dict(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2),
    ),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-yarn-mqa": (
        transformers.LlamaConfig,
        dict(
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral-window": (
        transformers.MistralConfig,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=5,
        ),
    ),
    "mistral-no-window": (
        transformers.MistralConfig,
        dict(
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            sliding_window=None,
        ),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=20,
        ),
    ),
    "qwen3-tied-mqa": (
        transformers.Qwen3Config,
        dict(
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=8,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "gemma3-linear-global": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=24,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "linear",
                    "rope_theta": 1000000.0,
                    "factor": 8.0,
                },
            },
        ),
    ),
    "olmo3": (
        transformers.Olmo3Config,
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=6,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
        ),
    ),
    "olmo3-gqa": (
        transformers.Olmo3Config,
        dict(
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "olmo3-yarn": (  # YaRN on the full layers only: the sliding ones keep plain RoPE
        transformers.Olmo3Config,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}
MODELS = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.Gemma3TextConfig: transformers.Gemma3ForCausalLM,
    transformers.Olmo3Config: transformers.Olmo3ForCausalLM,
}


def make(name: str):
    cfg_cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    cfg = cfg_cls(**BASE, **kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = MODELS[cfg_cls](cfg).eval()
    with torch.no_grad():  # random norm gains, so that wrong norm wiring shows up
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(
                    1.0 if cfg_cls is not transformers.Gemma3TextConfig else 0.0, 0.2
                )
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    hf = make(request.param)
    return hf, from_hf(hf)


def test_logits_match(pair):
    hf, ours = pair
    x = torch.randint(3, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
    got = ours(x)
    assert (got - want).abs().max().item() <= 1e-4


def test_cached_greedy_generation_matches(pair):
    hf, ours = pair
    x = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(x, max_new_tokens=14, do_sample=False, min_new_tokens=14)
    got = ours.generate(x, 14)
    assert torch.equal(got, want)


def test_converter_names_missing_unexpected_and_misshaped_tensors():
    hf = make("qwen3")
    cfg = config_from_hf(hf.config)
    sd = convert_state_dict(hf.state_dict(), cfg)
    model = DecoderLM(cfg)
    bad = dict(sd)
    del bad["blocks.1.ffn.up.weight"]
    bad["blocks.0.extra.weight"] = torch.zeros(3)
    bad["blocks.0.attn.out_proj.weight"] = torch.zeros(48, 7)
    with pytest.raises(ValueError) as err:
        load_state_dict_strict(model, bad)
    msg = str(err.value)
    assert "missing tensors: ['blocks.1.ffn.up.weight']" in msg
    assert "unexpected tensors: ['blocks.0.extra.weight']" in msg
    assert "blocks.0.attn.out_proj.weight: expected (48, 80), got (48, 7)" in msg
    hf_sd = dict(hf.state_dict())
    del hf_sd["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(
        ValueError,
        match=r"missing tensors: \['model.layers.0.self_attn.k_proj.weight'\]",
    ):
        convert_state_dict(hf_sd, cfg)
    hf_sd = dict(hf.state_dict())
    hf_sd["model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(2)
    with pytest.raises(ValueError, match="unexpected tensors: .*rotary.inv_freq"):
        load_state_dict_strict(model, convert_state_dict(hf_sd, cfg))


def test_unsupported_options_are_named():
    cfg = transformers.LlamaConfig(
        **BASE,
        num_hidden_layers=1,
        num_attention_heads=4,
        attention_bias=True,
        mlp_bias=True,
    )
    with pytest.raises(
        ValueError, match=r"does not support attention_bias=True, mlp_bias=True"
    ):
        config_from_hf(cfg)
    cfg = transformers.Gemma3TextConfig(
        **BASE, num_hidden_layers=1, num_attention_heads=4, final_logit_softcapping=30.0
    )
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        config_from_hf(cfg)
    with pytest.raises(ValueError, match="unsupported model"):
        config_from_hf(transformers.GPT2Config())


@torch.no_grad()
def _decode_gap(hf, ours: DecoderLM, x: torch.Tensor, new: int) -> float:
    """Largest logit difference over ``new`` greedy steps: transformers generates, ours
    prefills ``x`` and decodes the same tokens one at a time from its cache."""
    out = hf.generate(
        x,
        max_new_tokens=new,
        do_sample=False,
        min_new_tokens=new,
        output_logits=True,
        return_dict_in_generate=True,
    )
    want = torch.stack(out.logits, dim=1)  # (1, new, V): each step's logits
    t = x.shape[1]
    cache = ours.new_cache(1, t + new)
    got = [prefill(ours, x, cache)]
    for p in range(t, t + new - 1):  # the generated tokens, fed back one at a time
        step = out.sequences[:, p : p + 1]
        got.append(decode_one_token(ours, step, torch.tensor([p]), cache))
    return (torch.stack(got, dim=1) - want).abs().max().item()


def test_cached_decoding_matches_transformers_step_by_step(pair):
    """Logits at every decode step, not only the tokens: greedy text from a random
    model often repeats one token, which a wrong cache could reproduce."""
    hf, ours = pair
    x = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    assert _decode_gap(hf, ours, x, 14) <= 1e-4


def test_dynamic_rope_grows_past_the_trained_length_like_transformers():
    """Dynamic ("NTK") RoPE: transformers' Llama trained at 16 positions, read to 40.
    Prefill (24 positions, one grown base for all) and each decode step (the base grown
    for that step's length, the cached keys left as they were) give the same logits;
    and they differ from plain RoPE, so the growth is what is being compared."""
    torch.manual_seed(0)
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    kw = dict(BASE, max_position_embeddings=16, num_hidden_layers=2)
    hf_cfg = transformers.LlamaConfig(
        **kw, num_attention_heads=4, rope_parameters=rope, initializer_range=0.2
    )  # weights large enough that attention, and so position, matters
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = dataclasses.replace(config_from_hf(hf_cfg), max_seq_len=48)
    assert cfg.rope_scaling.original_max_position_embeddings == 16
    ours = DecoderLM(cfg).eval()
    load_state_dict_strict(ours, convert_state_dict(hf.state_dict(), cfg))
    plain = DecoderLM(dataclasses.replace(cfg, rope_scaling=None)).eval()
    plain.load_state_dict(ours.state_dict())
    x = torch.randint(3, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # first: transformers keeps the longest base it has grown to, ours is per call
        full = hf(x).logits
        assert (ours(x) - full).abs().max().item() <= 1e-4  # every prefill position
        assert (plain(x) - full).abs().max().item() > 1e-2  # the growth shows
    assert _decode_gap(hf, ours, x, 16) <= 1e-4
