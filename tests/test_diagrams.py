"""The architecture diagrams draw every preset, and what they write follows the config."""

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex, to_rgb
from matplotlib.patches import FancyBboxPatch, Rectangle
from matplotlib.text import Text

from companion.analysis.diagrams import (
    COLORS,
    HIGHLIGHT,
    block_diagram,
    block_parts,
    changed_parts,
    end_parts,
    model_diagram,
)
from companion.models.config_parts import MLAConfig, MoEConfig
from companion.models.presets import PRESETS, preset, tiny

matplotlib.use("Agg")


def _text(fig) -> str:
    words = " | ".join(t.get_text() for t in fig.findobj(Text))
    plt.close(fig)
    return " ".join(words.split())  # wrapped labels read as one line


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_draws(name):
    cfg = preset(name)
    block, model = _text(block_diagram(cfg)), _text(model_diagram(cfg))
    assert f"{cfg.vocab_size:,}" in model and f"{cfg.n_layers} layers" in model
    assert ("RMSNorm" in block) == (cfg.norm == "rmsnorm")


def test_norm_kind_and_placement_follow_the_config():
    assert "LayerNorm" in _text(block_diagram(tiny(norm="layernorm")))
    assert "LayerNorm" not in _text(block_diagram(tiny()))
    kinds = {
        placement: [p.kind for p in block_parts(tiny(norm_placement=placement))]
        for placement in ("pre", "post", "sandwich", "post_branch")
    }
    assert kinds["pre"] == ["norm", "full", "add", "norm", "dense", "add"]
    assert kinds["post"] == ["full", "add", "norm", "dense", "add", "norm"]
    assert kinds["sandwich"].count("norm") == 4
    assert kinds["post_branch"][:3] == ["full", "norm", "add"]


@pytest.mark.parametrize(
    "n_kv_heads, name", [(None, "MHA 4:4"), (2, "GQA 4:2"), (1, "MQA 4:1")]
)
def test_heads_are_drawn_as_query_to_key_value_heads(n_kv_heads, name):
    assert name in _text(block_diagram(tiny(n_kv_heads=n_kv_heads)))


def test_window_and_layer_pattern():
    cfg = tiny(n_layers=4, sliding_window=16, layer_types=("sliding",) * 3 + ("full",))
    block = _text(block_diagram(cfg))
    assert (
        "window 16" in block
        and "3 of 4 layers: 0–2" in block
        and "1 of 4 layers: 3" in block
    )
    fig = model_diagram(cfg)
    cells = [
        to_hex(r.get_facecolor()) for r in fig.findobj(Rectangle) if r.get_width() < 2
    ]
    assert (
        cells.count(COLORS["sliding"].lower()) == 3
        and cells.count(COLORS["full"].lower()) == 1
    )
    assert "3 sliding window + 1 full attention" in _text(fig)
    assert "window" not in _text(block_diagram(tiny()))


def test_experts_latent_attention_and_linear_layers():
    moe = tiny(moe=MoEConfig(8, 2, shared_d_ff=32, expert_d_ff=24, dense_layers=1))
    text = _text(block_diagram(moe))
    assert "MoE 8 routed + 1 shared, top-2" in text and "expert width 24" in text
    assert "1 MoE + 1 dense FFN" in _text(model_diagram(moe))
    mla = tiny(mla=MLAConfig(16, 8, 4, 8))
    assert "latent 16" in _text(block_diagram(mla)) and "RoPE key 4" in _text(
        block_diagram(mla)
    )
    qwen = preset("qwen3-next-80b-a3b")
    text = _text(block_diagram(qwen))
    assert (
        "Gated DeltaNet" in text
        and f"{qwen.linear.key_dim}×{qwen.linear.value_dim}" in text
    )
    assert "36 Gated DeltaNet + 12 full attention" in _text(model_diagram(qwen))


def test_positions_tying_and_dropout():
    assert "NoPE" in _text(block_diagram(tiny(n_layers=2, nope_layers=(1,))))
    gpt2 = _text(model_diagram(preset("gpt2")))
    assert "learned positions" in gpt2 and "tied to the embedding" in gpt2
    assert "own weights" in _text(model_diagram(tiny(tie_embeddings=False)))
    assert "dropout 0.1" in _text(block_diagram(tiny(dropout=0.1)))
    with pytest.raises(ValueError, match=r"layer must be in \[0, n_layers=2\)"):
        block_parts(tiny(), 2)


def test_diagrams_draw_into_given_axes() -> None:
    """With ``ax`` both drawings reuse it (one frame of an animation) and make no figure."""
    fig, (a, b) = plt.subplots(1, 2)
    before = plt.get_fignums()
    assert block_diagram(PRESETS["llama3-8b"], ax=a) is fig
    assert model_diagram(PRESETS["llama3-8b"], ax=b) is fig
    assert plt.get_fignums() == before
    assert any("RMSNorm" in t.get_text() for t in a.texts)
    plt.close(fig)


def test_2026_mixers_are_named_from_the_config():
    v4 = preset("deepseek-v4-flash")
    c = v4.compression
    text = _text(model_diagram(v4))
    assert "compressed sparse" in text and "heavily compressed" in text
    block = _text(block_diagram(v4))
    assert f"pooled every {c.csa_ratio}, top-{c.index_topk}" in block
    assert f"pooled every {c.hca_ratio}" in block
    kimi = preset("kimi-linear-48b-a3b")
    assert "Kimi Delta Attention" in _text(block_diagram(kimi))
    assert "Kimi Delta Attention" in _text(model_diagram(kimi))
    glm = preset("glm-5")
    assert f"indexer top-{glm.mla.indexer.topk}" in _text(block_diagram(glm))


def test_ends_draw_embedding_position_and_head():
    """A morph's frame adds what lies outside the blocks: the positional signal is added to the
    embedding (sinusoids, a learned table) or lives in attention (RoPE, partial)."""
    sinusoids = tiny(position="sinusoidal", scale_embeddings=True)
    text = _text(block_diagram(sinusoids, changed_from=sinusoids))
    assert (
        "token embedding" in text and "× √d" in text and "sinusoidal positions" in text
    )
    assert "output head" in text and "final norm" in text
    assert "RoPE in attention" in _text(block_diagram(tiny(), changed_from=tiny()))
    parts = end_parts(tiny(partial_rotary_factor=0.25, tie_embeddings=False))
    assert parts["position"].detail == "rotates 0.25 of each head's q and k"
    assert parts["head"].detail.endswith("own weights")
    assert "final norm" not in end_parts(tiny(norm_placement="post"))
    assert "output head" not in _text(block_diagram(tiny()))  # off by default


def test_changed_parts_outline_one_step_of_a_morph():
    """What differs between two configs' drawings, box by box, outlined and tagged."""
    a = tiny(n_layers=4, position="sinusoidal")
    assert changed_parts(a, a) == []
    rope = a.replace(position="rope")
    assert changed_parts(a, rope) == [(0, "mixer"), (-1, "position")]
    pre = changed_parts(a.replace(norm_placement="post"), a)
    assert pre == [(0, "mixer norm before"), (0, "ffn norm before"), (-1, "final norm")]
    hybrid = a.replace(sliding_window=8, layer_types=("sliding",) * 3 + ("full",))
    assert changed_parts(a, hybrid) == [(0, "mixer")]  # the full column is unchanged
    assert changed_parts(a, a.replace(tie_embeddings=False)) == [(-1, "head")]
    fig = block_diagram(rope, changed_from=a, label="RoPE")
    outlined = [p for p in fig.findobj(FancyBboxPatch) if p.get_edgecolor()[:3] == (
        to_rgb(HIGHLIGHT))]  # fmt: skip
    assert len(outlined) == 2 and "RoPE" in _text(fig)
