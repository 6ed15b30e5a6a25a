"""Length extrapolation helpers (chapter 05): per-position loss, rescaled RoPE copies,
which RoPE table each layer receives."""

import pytest
import torch
import torch.nn.functional as F

from companion.analysis.extrapolation import (
    SCALING_METHODS,
    ntk_theta,
    per_position_loss,
    per_position_loss_scaled,
    position_config,
    rope_scaling_for,
    rope_used_per_layer,
    same_weights,
    train_short,
    with_rope,
)
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.rope import RopeScaling, rope_frequencies

V = 11
IDS = (
    torch.arange(3000) % V
)  # a periodic "text": easy to learn, long enough to sample from


def tiny(position: str = "rope", **fields) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        position_config(position, V, 8, 32, d_model=16, n_heads=2, **fields)
    )


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "none", "alibi"])
def test_config_reaches_max_len_except_the_learned_table(position):
    cfg = position_config(position, V, train_len=8, max_len=32)
    assert cfg.position == position
    assert cfg.max_seq_len == (8 if position == "learned" else 32)


def test_per_position_loss_averages_to_the_plain_cross_entropy():
    model = tiny()
    curve = per_position_loss(model, IDS, 12, n_windows=10, batch_size=4, seed=3)
    assert curve.shape == (12,)
    gen = torch.Generator().manual_seed(3)
    xs, ys = zip(
        *[
            (IDS[s : s + 12], IDS[s + 1 : s + 13])
            for s in torch.randint(0, len(IDS) - 12, (4,), generator=gen).tolist()
            + torch.randint(0, len(IDS) - 12, (4,), generator=gen).tolist()
            + torch.randint(0, len(IDS) - 12, (2,), generator=gen).tolist()
        ],
        strict=True,
    )
    with torch.no_grad():
        logits = model(torch.stack(xs))  # (10, 12, V)
    reference = F.cross_entropy(
        logits.transpose(1, 2), torch.stack(ys), reduction="none"
    ).mean(0)
    torch.testing.assert_close(curve, reference, atol=1e-5, rtol=1e-5)


def test_window_len_reads_the_same_text_at_every_length():
    model = tiny()
    long = per_position_loss(model, IDS, 24, 6, seed=1, window_len=24)
    short = per_position_loss(model, IDS, 10, 6, seed=1, window_len=24)
    torch.testing.assert_close(
        short, long[:10]
    )  # causal: the prefix is scored the same
    with pytest.raises(ValueError, match="window_len"):
        per_position_loss(model, IDS, 24, 6, window_len=10)


def test_learned_positions_refuse_to_run_past_the_table():
    model = tiny("learned")
    per_position_loss(model, IDS, 8, 2)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        per_position_loss(model, IDS, 9, 2)


@pytest.mark.parametrize("seq_len", [8, 20, 64])
def test_ntk_theta_is_dynamic_scaling(seq_len):
    dynamic, _ = rope_frequencies(
        16,
        500.0,
        RopeScaling("dynamic", factor=1.0),
        max_position_embeddings=8,
        seq_len=seq_len,
    )
    ntk, _ = rope_frequencies(16, ntk_theta(500.0, 16, 8, seq_len))
    torch.testing.assert_close(ntk, dynamic)
    assert ntk[0] == pytest.approx(1.0)  # the fastest pair keeps its speed
    base, _ = rope_frequencies(16, 500.0)
    assert (ntk[-1] / base[-1]).item() == pytest.approx(
        8 / max(seq_len, 8)
    )  # slowest: ÷ s


def test_with_rope_keeps_the_weights_and_changes_only_the_tables():
    model = tiny(init_std=0.5).eval()  # large weights: logits that depend on position
    x = IDS[:20][None]
    with torch.no_grad():
        same = with_rope(model)(x)
        other = with_rope(model, theta=50.0)(x)
        ref = model(x)
    torch.testing.assert_close(same, ref)
    assert (other - ref).abs().max() > 1e-3
    with pytest.raises(ValueError, match="RoPE model"):
        with_rope(tiny("learned"))


def test_same_weights_with_a_window_equals_full_attention_inside_the_window():
    model = tiny(init_std=0.5).eval()
    windowed = same_weights(model, sliding_window=8)
    with torch.no_grad():
        torch.testing.assert_close(windowed(IDS[:8][None]), model(IDS[:8][None]))
        assert (windowed(IDS[:20][None]) - model(IDS[:20][None])).abs().max() > 1e-4


def test_scaling_recipes():
    cfg = tiny().cfg
    base, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta)
    assert rope_scaling_for("yarn", cfg, 8, 8) == {}  # nothing to stretch at s = 1
    assert rope_scaling_for("none", cfg, 8, 64) == {}
    linear = rope_scaling_for("linear", cfg, 8, 32)["scaling"]
    torch.testing.assert_close(rope_frequencies(cfg.head_dim, 1e4, linear)[0], base / 4)
    yarn = rope_scaling_for("yarn", cfg, 8, 64)["scaling"]
    inv, scale = rope_frequencies(cfg.head_dim, 1e4, yarn)
    assert inv[-1].item() == pytest.approx(base[-1].item() / 8) and scale > 1
    assert rope_scaling_for("ntk", cfg, 8, 32)["theta"] > cfg.rope_theta
    assert set(SCALING_METHODS) == {"none", "linear", "ntk", "yarn"}
    with pytest.raises(ValueError, match="method"):
        rope_scaling_for("ntk-by-parts", cfg, 8, 32)


def test_scaled_curve_follows_the_length_band_by_band():
    model = tiny()
    plain = per_position_loss(model, IDS, 32, 4, seed=2)
    torch.testing.assert_close(
        per_position_loss_scaled(model, "none", IDS, 8, [8, 16, 32], 4, seed=2), plain
    )
    linear = per_position_loss_scaled(model, "linear", IDS, 8, [8, 16, 32], 4, seed=2)
    torch.testing.assert_close(
        linear[:8], plain[:8]
    )  # inside the trained length: untouched
    s2 = with_rope(model, **rope_scaling_for("linear", model.cfg, 8, 16))
    torch.testing.assert_close(
        linear[8:16], per_position_loss(s2, IDS, 16, 4, seed=2, window_len=32)[8:]
    )
    with pytest.raises(ValueError, match="increase"):
        per_position_loss_scaled(model, "none", IDS, 8, [16, 8], 4)


def test_rope_used_per_layer_records_local_global_and_nope():
    cfg = ModelConfig(
        vocab_size=V,
        d_model=16,
        n_layers=4,
        n_heads=2,
        position="rope",
        layer_types=("sliding", "sliding", "full", "full"),
        sliding_window=4,
        rope_theta=1e6,
        rope_local_theta=1e4,
        nope_layers=(3,),
    )
    ids = IDS[:12][None]
    assert rope_used_per_layer(DecoderLM(cfg), ids) == [
        "local",
        "local",
        "global",
        "none",
    ]
    assert rope_used_per_layer(tiny("learned"), IDS[:8][None]) == ["none", "none"]


def test_train_short_learns_a_periodic_text():
    model = tiny()
    before = per_position_loss(model, IDS, 8, 8)
    hist = train_short(model, IDS, 8, 40, batch_size=8, lr=1e-2)
    assert len(hist.loss) == 40 and not model.training
    assert per_position_loss(model, IDS, 8, 8).mean() < before.mean() - 1.0
