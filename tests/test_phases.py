"""Prefill and decode costs (companion.analysis.phases) against hand counts, their
ordering on the roofline, MLA's two forms in both phases, and the phases benchmark."""

from __future__ import annotations

import pytest
import torch

from companion.analysis.phases import (
    decode_step_cost,
    latent_attention_flops,
    meta_model,
    phase_cost,
    prefill_cost,
)
from companion.analysis.scaling import count_flops
from companion.bench import main
from companion.bench.mla import bench_mla_phases, format_mla_phases, matmul_rate
from companion.models.config import MoEConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import preset, tiny

CFG = tiny(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=80)
H100 = (989e12, 3.35e12)  # dense bf16 FLOP/s, HBM3 bytes/s (H100 SXM datasheet)


def hand_flops(cfg, tokens: int, context: int, batch: int = 1) -> int:
    """Matmul FLOPs of a forward of ``tokens`` new tokens attending to ``context``
    positions (the last position's logits only), from the config's widths: per token
    and layer the q, k, v, o projections and the three GLU matrices; per query and key
    the scores and the weighted values of every head; the output layer once."""
    d, h, h_kv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    projections = d * h * dh + 2 * d * h_kv * dh + h * dh * d + 3 * d * f
    attention = 2 * h * dh * context  # q·k and weights·v, one query
    per_layer = tokens * (2 * projections + 2 * attention)
    return batch * (cfg.n_layers * per_layer + 2 * d * cfg.vocab_size)


def cache_bytes(cfg, positions: int, batch: int, size: int) -> int:
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * positions * batch * size


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_prefill_flops_and_bytes_equal_a_hand_count(tokens, batch):
    cost = prefill_cost(CFG, tokens, batch=batch, dtype_bytes=2)
    assert cost.flops == hand_flops(CFG, tokens, tokens, batch)
    n_params = sum(p.numel() for p in DecoderLM(CFG).parameters())  # tied: once
    assert cost.weight_bytes == 2 * n_params
    assert cost.cache_bytes == cache_bytes(CFG, tokens, batch, 2)
    assert (cost.phase, cost.tokens, cost.context) == ("prefill", tokens, tokens)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("context", [1, 7, 33])
def test_decode_step_flops_and_bytes_equal_a_hand_count(context, batch):
    cost = decode_step_cost(CFG, context, batch=batch, dtype_bytes=4)
    assert cost.flops == hand_flops(CFG, 1, context, batch)
    assert cost.cache_bytes == cache_bytes(CFG, context, batch, 4)
    assert cost.nbytes == cost.weight_bytes + cost.cache_bytes


def test_a_prefill_chunk_after_cached_tokens_is_between_the_phases():
    chunk = phase_cost(CFG, 4, 10, batch=2, dtype_bytes=2)
    assert chunk.flops == hand_flops(CFG, 4, 10, batch=2)
    assert chunk.cache_bytes == cache_bytes(CFG, 10, 2, 2)  # the whole context
    assert (chunk.phase, decode_step_cost(CFG, 10).phase) == ("chunk", "decode")


def test_the_meta_count_is_the_real_forwards_count():
    torch.manual_seed(0)
    model = DecoderLM(CFG.replace(attn_impl="reference")).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    cache = model.new_cache(2, 9)
    with torch.no_grad():
        real = count_flops(lambda: model(ids, cache=cache, last_only=True))
    assert prefill_cost(model, 9, batch=2).flops == real
    # a model's own element size by default; a config counts as built (fp32)
    assert prefill_cost(model.to(torch.bfloat16), 9).weight_bytes * 2 == (
        prefill_cost(CFG, 9).weight_bytes
    )


def test_an_untied_input_table_counts_only_the_rows_looked_up():
    cfg = CFG.replace(tie_embeddings=False)
    n_params = sum(p.numel() for p in DecoderLM(cfg).parameters())
    cost = prefill_cost(cfg, 4, batch=2, dtype_bytes=1)
    assert cost.weight_bytes == n_params - (cfg.vocab_size - 8) * cfg.d_model


def test_sliding_layers_read_at_most_their_window():
    cfg = CFG.replace(layer_types=("full", "sliding", "sliding"), sliding_window=4)
    cost = decode_step_cost(cfg, 10, dtype_bytes=1)
    assert cost.cache_bytes == 2 * 2 * 8 * (10 + 4 + 4)


def test_prefill_intensity_grows_with_tokens_and_decode_stays_under_a_ceiling():
    prefill = [prefill_cost(CFG, t, dtype_bytes=2).intensity for t in (4, 16, 64)]
    decode = [decode_step_cost(CFG, s, dtype_bytes=2).intensity for s in (4, 64, 1024)]
    assert prefill[0] < prefill[1] < prefill[2]
    # in bf16 a decode step mixes the weights' 1 FLOP per byte (a little under: norms
    # are read, not multiplied) with attention's n_heads / n_kv_heads (chapter 08):
    # however long the context, it stays between the two
    ceiling = CFG.n_heads / CFG.n_kv_heads
    assert all(0.95 < i < ceiling for i in decode)
    assert prefill[2] > 4 * ceiling
    step = decode_step_cost(CFG, 1, dtype_bytes=2)  # batch 1, one position
    assert step.intensity == pytest.approx(1.0, abs=0.05)


def test_batching_raises_decode_intensity_up_to_the_caches_own():
    steps = [decode_step_cost(CFG, 64, batch=b, dtype_bytes=2) for b in (1, 4, 64)]
    assert steps[0].intensity < steps[1].intensity < steps[2].intensity
    assert len({s.weight_bytes for s in steps}) == 1  # the weights are read once
    # the weights' bytes vanish against the caches': FLOPs per cache byte is the cap
    cap = steps[-1].flops / steps[-1].cache_bytes
    assert steps[-1].intensity < cap


def test_smollm2_prefill_is_compute_bound_and_decode_memory_bound_on_an_h100():
    model = meta_model(preset("smollm2-135m"))
    prefill = prefill_cost(model, 2048, dtype_bytes=2)
    decode = decode_step_cost(model, 2048, dtype_bytes=2)
    peak, bandwidth = H100
    assert prefill.seconds(*H100) == prefill.flops / peak
    assert prefill.attainable(*H100) == peak
    assert decode.seconds(*H100) == decode.nbytes / bandwidth
    assert decode.attainable(*H100) == pytest.approx(decode.intensity * bandwidth)


SHAPE = {
    "d_model": 40,
    "n_heads": 3,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4,
    "v_head_dim": 5,
}


def hand_mla(form: str, tokens: int, context: int, q_lora_rank: int = 0) -> int:
    """One MLA layer's matmul FLOPs, batch 1, written out per form."""
    d, h, c = SHAPE["d_model"], SHAPE["n_heads"], SHAPE["kv_lora_rank"]
    dn, r, dv = (
        SHAPE[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    q_in = d * h * (dn + r) if not q_lora_rank else q_lora_rank * (d + h * (dn + r))
    fixed = tokens * 2 * (q_in + d * (c + r) + h * dv * d)  # queries, kv_a, out
    pairs = tokens * context * h
    if form == "naive":  # every key expanded to H heads, then ordinary attention
        return fixed + 2 * context * c * h * (dn + dv) + 2 * pairs * (dn + r + dv)
    # absorbed: W_UK into the query, scores and values in the latent, W_UV after
    return fixed + 2 * tokens * h * c * (dn + dv) + 2 * pairs * (2 * c + r)


@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize(("tokens", "context"), [(6, 6), (1, 6), (1, 17), (3, 9)])
def test_latent_attention_flops_equal_a_hand_count(form, tokens, context):
    assert latent_attention_flops(SHAPE, form, tokens, context) == (
        hand_mla(form, tokens, context)
    )
    with_q = SHAPE | {"q_lora_rank": 7}
    assert latent_attention_flops(with_q, form, tokens, context) == (
        hand_mla(form, tokens, context, q_lora_rank=7)
    )


def test_naive_is_cheaper_at_prefill_and_absorbed_at_decode():
    v3 = dict(preset("deepseek-v3").mla.__dict__)
    shape = {k: v3[k] for k in SHAPE if k in v3} | {"d_model": 2048, "n_heads": 16}
    naive, absorbed = (
        latent_attention_flops(shape, f, 512, 512) for f in ("naive", "absorbed")
    )
    assert naive < absorbed
    naive, absorbed = (
        latent_attention_flops(shape, f, 1, 512) for f in ("naive", "absorbed")
    )
    assert absorbed < naive


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: prefill_cost(CFG, 0), "tokens must be a positive integer"),
        (lambda: phase_cost(CFG, 5, 4), "context must be an integer >= 5"),
        (lambda: decode_step_cost(CFG, 8, batch=0), "batch must be a positive integer"),
        (lambda: decode_step_cost(CFG, 8, dtype_bytes=0), "dtype_bytes must be"),
        (lambda: prefill_cost("smollm2", 8), "model must be a companion DecoderLM"),
        (
            lambda: meta_model(
                CFG.replace(moe=MoEConfig(n_experts=4, experts_per_token=2))
            ),
            "routed experts",
        ),
        (lambda: latent_attention_flops(SHAPE, "fused", 1, 4), "form must be one of"),
        (lambda: latent_attention_flops(SHAPE, "naive", 5, 4), r"tokens \(5\) must be"),
        (lambda: latent_attention_flops({"d_model": 8}, "naive", 1, 4), "n_heads"),
        (
            lambda: prefill_cost(CFG, 4).seconds(0, 1.0),
            "peak_flops must be a positive number",
        ),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_the_phases_benchmark_times_both_forms_in_both_phases(capsys):
    rows = bench_mla_phases([8, 16], torch.device("cpu"), repeats=1, shape=SHAPE)
    assert [(r["phase"], r["L"]) for r in rows] == [
        ("prefill", 8), ("decode", 8), ("prefill", 16), ("decode", 16)
    ]  # fmt: skip
    for r in rows:
        tokens = r["L"] if r["phase"] == "prefill" else 1
        assert r["naive_gflop"] * 1e9 == pytest.approx(
            hand_mla("naive", tokens, r["L"])
        )
        assert r["max_diff"] < 1e-4  # the two forms compute the same layer
        assert r["naive_ms"] > 0 and r["absorbed_ms"] > 0
    assert format_mla_phases(rows).count("\n") == len(rows) + 1
    assert matmul_rate(64, repeats=1) > 0
    main(["mla", "--lengths", "8", "--repeats", "1", "--phase-lengths", "8"])
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "absorbed GFLOP" in out
