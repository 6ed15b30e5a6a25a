"""Generation (chapter 08): prefill, the fixed-shape decode step (eager and compiled) and the
loop equal the uncached forward, token for token and logit for logit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from companion.models.config import ModelConfig
from companion.models.config_parts import LinearAttentionConfig
from companion.models.decoder import DecoderLM
from companion.models.generation import (
    decode_n_tokens,
    decode_one_token,
    generate,
    prefill,
    sample,
)
from companion.numerics import PINNED_ENV

LLAMA_LIKE = dict(
    vocab_size=61,
    d_model=48,
    n_layers=3,
    n_heads=6,
    n_kv_heads=2,
    d_ff=80,
    max_seq_len=40,
    norm="rmsnorm",
    position="rope",
    ffn="glu",
    activation="silu",
    bias=False,
    rope_theta=500.0,
    # weights large enough that greedy decoding varies: at the default 0.02 every sequence
    # repeats its last prompt token, which any decode path would reproduce
    init_std=0.2,
)
VARIANTS = {
    "gqa": {},
    "mha-untied": {"n_kv_heads": 6, "tie_embeddings": False},
    "qkv-bias-scale": {"qkv_bias": True, "attn_scale": 0.3},
    "qk-norm-partial-rope": {"qk_norm": "head", "partial_rotary_factor": 0.5},
}
# windows and sinks (gpt-oss-like): the sliding layers decode from a ring buffer of 4 slots
SLIDING = {
    "sliding_window": 4,
    "layer_types": ("sliding", "full", "sliding"),
    "attn_sinks": True,
}
# Qwen3-Next-like: Gated DeltaNet layers (a fixed-size state) around a gated attention layer
HYBRID = {
    "layer_types": ("linear", "full", "linear"),
    "linear": LinearAttentionConfig(key_heads=2, value_heads=4, key_dim=8, value_dim=6),
    "attn_output_gate": True,
    "qk_norm": "head",
}


def _model(**changes: object) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**{**LLAMA_LIKE, **changes})).eval()
    with torch.no_grad():  # random norm gains (and sinks), so that a wrong one shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("sinks"):
                p.normal_()
    return model


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_cached_generation_equals_the_uncached_forward(changes):
    model = _model(**changes)
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, 20, use_cache=False)
    assert torch.equal(model.generate(ids, 20), want)
    assert torch.equal(generate(model, ids, 20), want)


@pytest.mark.parametrize(
    "changes", [SLIDING, HYBRID], ids=["sliding-sinks", "deltanet-hybrid"]
)
def test_windowed_and_hybrid_models_generate_the_uncached_tokens(changes):
    model = _model(**changes)
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(
        model.generate(ids, 20), model.generate(ids, 20, use_cache=False)
    )


@pytest.mark.parametrize(
    "changes", [{}, SLIDING, HYBRID], ids=["gqa", "sliding-sinks", "deltanet-hybrid"]
)
def test_decode_step_logits_equal_the_full_forward(changes):
    model = _model(**changes)
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 9)
    with torch.no_grad():
        full = model(ids)
        last = prefill(model, ids[:, :5], cache)
        torch.testing.assert_close(last, full[:, 4], atol=1e-5, rtol=1e-5)
        assert cache.length == 5
        for p in range(5, 9):
            got = decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]), cache)
            torch.testing.assert_close(got, full[:, p], atol=1e-5, rtol=1e-5)


def test_decode_n_tokens_continues_the_cache_and_stops_at_eos():
    model = _model()
    ids = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, 10, use_cache=False)[0, 5:].tolist()
    with torch.no_grad():
        cache = model.new_cache(1, 15)
        first = sample(prefill(model, ids, cache))
        rest = decode_n_tokens(model, first, cache, 9)
    assert torch.cat([first, *rest], dim=1)[0].tolist() == want
    assert cache.length == 14  # the last id is chosen, not yet read
    eos = want[4]
    assert 0 < want.index(eos) < 9  # first produced mid-way: the loop must stop there
    with torch.no_grad():
        cache = model.new_cache(1, 15)
        first = sample(prefill(model, ids, cache))
        rest = decode_n_tokens(model, first, cache, 9, eos_token_id=eos)
    assert torch.cat([first, *rest], dim=1)[0].tolist() == want[: want.index(eos) + 1]


def test_sample_is_argmax_at_zero_temperature_and_top_k_restricts():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(4))
    argmax = logits.argmax(dim=-1, keepdim=True)
    assert torch.equal(sample(logits), argmax)
    assert torch.equal(sample(logits, 1.0, top_k=1), argmax)
    top3 = logits.topk(3, dim=-1).indices
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        got = sample(logits, 2.0, top_k=3, generator=gen)
        assert got.shape == (4, 1) and (got == top3).any(dim=-1).all()
    a = sample(logits, 1.0, generator=torch.Generator().manual_seed(6))
    assert torch.equal(
        a, sample(logits, 1.0, generator=torch.Generator().manual_seed(6))
    )


def test_generation_past_the_context_is_refused():
    with pytest.raises(ValueError, match="max_seq_len=40"):
        generate(_model(), torch.zeros(1, 30, dtype=torch.long), 11)


def test_compiled_decode_step_generates_the_uncached_tokens():
    """The opt-in torch.compile path (one layer, to keep compilation to a few seconds). A
    second call with other shapes must not reuse the first graph: only the steps after a
    call's first one skip the guard checks."""
    model = _model(n_layers=1)
    gen = torch.Generator().manual_seed(1)
    for batch, prompt, new in ((1, 5, 6), (2, 3, 4)):
        ids = torch.randint(0, 61, (batch, prompt), generator=gen)
        want = model.generate(ids, new, use_cache=False)
        assert torch.equal(model.generate(ids, new, compile=True), want)


COMPILED_RUN = textwrap.dedent(
    """
    from companion.numerics import pin_cpu_path

    pin_cpu_path()  # the pinned path unless COMPANION_NUMERICS=native
    import torch
    from companion.models.config import ModelConfig
    from companion.models.decoder import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**{cfg!r})).eval()
    gen = torch.Generator().manual_seed(1)
    for batch, prompt, new in ((1, 5, 6), (2, 3, 4), (1, 5, 6)):
        ids = torch.randint(0, 61, (batch, prompt), generator=gen)
        want = model.generate(ids, new, use_cache=False)
        assert torch.equal(model.generate(ids, new, compile=True), want), (batch, new)
    """
)


def test_compiled_decode_step_is_safe_on_both_numerical_paths(tmp_path):
    """Fresh processes alternate the native and the pinned path over one Inductor
    cache: code generated for one vector width must never run built for the other
    (that corrupted the heap, or left NaN in the logits)."""
    code = COMPILED_RUN.format(cfg=LLAMA_LIKE | {"n_layers": 1})
    base = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}
    base["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    for path in ("native", "pinned", "native", "pinned"):
        env = base | {"COMPANION_NUMERICS": path}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, f"{path}: {run.stderr[-2000:]}"


def _finished_at(row: list[int], eos: int, prompt: int) -> list[int]:
    """``row`` with every id after the first generated ``eos`` replaced by ``eos``."""
    new = row[prompt:]
    if eos not in new:
        return row
    stop = new.index(eos) + 1
    return row[:prompt] + new[:stop] + [eos] * (len(new) - stop)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_rows_that_finish_early_are_padded_with_eos(use_cache):
    """Both loops: one row produces EOS mid-way and is padded with it while the other
    runs on; the oracle is generation without EOS, cut by hand."""
    model = _model()
    ids = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(8))
    free = model.generate(ids, 10, use_cache=False).tolist()
    # an id that row 0 produces mid-way and row 1 never does
    eos = next(t for t in free[0][6:11] if t not in free[1][4:])
    got = model.generate(ids, 10, use_cache=use_cache, eos_token_id=eos)
    assert got.shape == (2, 14)  # row 1 never finishes: the loop runs to the end
    want = [_finished_at(free[0], eos, 4), free[1]]
    assert got.tolist() == want and want[0] != free[0]  # the padding changed row 0


def test_generation_past_the_context_reads_the_last_tokens():
    """Absolute positions past ``max_seq_len``: each step sees only the last
    ``max_seq_len`` tokens, checked token by token against the model fed them."""
    model = _model(position="learned", max_seq_len=8)
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(9))
    with pytest.warns(UserWarning, match="re-reads the last max_seq_len tokens"):
        got = model.generate(ids, 7)
    assert torch.equal(model.generate(ids, 7, use_cache=False), got)
    with torch.no_grad():
        for t in range(6, 13):
            logits = model(got[:, max(0, t - 8) : t])[:, -1]
            assert torch.equal(logits.argmax(-1), got[:, t])


def test_compile_without_the_cache_warns():
    model = _model(n_layers=1)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.warns(UserWarning, match="compile=True has no effect"):
        model.generate(ids, 2, use_cache=False, compile=True)
