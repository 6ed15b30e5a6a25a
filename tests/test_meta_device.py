"""Device-following: whole models run on the meta device, so any tensor a forward
creates on the CPU instead of on its input's device (a missing ``device=``) raises, as it
would on CUDA or MPS; tables built in float64 (which MPS lacks) are built on the CPU and
land on the default device."""

from __future__ import annotations

import pytest
import torch

import companion.layers.positions as positions
import companion.models.decoder as decoder
from companion.layers.positions import SinusoidalPositions, sinusoidal_table
from companion.models.decoder import DecoderLM
from companion.models.presets import preset, tiny

META = torch.device("meta")
CONFIGS = {  # dense configs (routed experts choose by value, which meta has not)
    "gpt2": lambda: preset("gpt2"),
    "llama3-8b": lambda: preset("llama3-8b"),
    "gemma3-27b": lambda: preset("gemma3-27b"),  # sliding layers, scaled embeddings
    "smollm3-3b": lambda: preset("smollm3-3b"),  # NoPE layers
    "sinusoidal": lambda: tiny(position="sinusoidal", scale_embeddings=True),
    "alibi": lambda: tiny(position="alibi"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_on_meta_creates_nothing_on_the_cpu(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the id and position range checks read values, which meta tensors have not
    monkeypatch.setattr(decoder, "check_token_ids", lambda *a, **k: None)
    monkeypatch.setattr(positions, "_check_range", lambda *a, **k: None)
    with META:
        model = DecoderLM(CONFIGS[name]())
    ids = torch.zeros(2, 8, dtype=torch.long, device=META)
    logits = model(ids)
    assert logits.device == META
    assert logits.shape == (2, 8, model.cfg.vocab_size)


def test_sinusoidal_table_is_computed_on_the_cpu_and_lands_on_the_default_device() -> (
    None
):
    table = sinusoidal_table(16, 8)
    assert table.dtype == torch.float32 and table.device.type == "cpu"
    pos = torch.arange(16, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert torch.equal(table[:, 0::2], torch.sin(pos * freq).float())
    with META:
        assert sinusoidal_table(16, 8).device == META
        assert SinusoidalPositions(8, 16).table.device == META
