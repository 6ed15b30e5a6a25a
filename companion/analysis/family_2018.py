"""The 2018–2020 family as models: BERT, GPT-1, GPT-2, GPT-3, and T5's objective
(chapter 04).

Shape legend: L blocks, d model width, H heads, T context (positions), V vocabulary,
N parameters. Each member is a :class:`~companion.models.config.ModelConfig` written from
its paper's table (and, where one was released, its ``config.json``), with the rounded
size the paper printed. :func:`exact_params` builds the package's own model on the meta
device (no memory, no weights) and counts its parameters: BERT through
:func:`companion.checkpoints.minilm.bert_config` and
:class:`~companion.models.encoder.Encoder`, the GPTs as
:class:`~companion.models.decoder.DecoderLM`. These configs are *not* in
``companion.models.presets.PRESETS``, which later chapters iterate.

:func:`random_spans` and :func:`corrupt_spans` are T5's span corruption: spans of the
input are replaced by sentinels, and the target lists each sentinel followed by the
tokens it hid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from companion.checkpoints.minilm import bert_config
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.encoder import Encoder
from companion.models.presets import preset

__all__ = [
    "FAMILY",
    "Member",
    "bert_hf_config",
    "corrupt_spans",
    "exact_params",
    "family_rows",
    "pooler_params",
    "random_spans",
]


def bert_hf_config(n_layers: int, d_model: int, n_heads: int) -> dict[str, object]:
    """A released BERT ``config.json`` (bert-base-uncased's values) at another size."""
    return {
        "model_type": "bert",
        "vocab_size": 30522,  # WordPiece, the uncased checkpoints
        "hidden_size": d_model,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "intermediate_size": 4 * d_model,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
    }


def _gpt1() -> ModelConfig:
    """GPT-1 (Radford et al. 2018): 12 Post-LN blocks, 768 wide, 12 heads, 512
    learned positions, a 40,478-entry BPE vocabulary, the head tied to the embedding."""
    return preset("gpt2").replace(
        vocab_size=40478, max_seq_len=512, norm_placement="post", activation="gelu"
    )


def _gpt(n_layers: int, d_model: int, n_heads: int, ctx: int = 1024) -> ModelConfig:
    """GPT-2's block (Pre-LN, learned positions, V = 50,257) at another shape."""
    return preset("gpt2").replace(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, max_seq_len=ctx
    )


@dataclass(frozen=True)
class Member:
    """One model of the family: its config, the size its paper printed, its data.

    ``kind`` is ``"encoder"`` (built as :class:`~companion.models.encoder.Encoder`
    with BERT's two segment ids) or ``"decoder"``
    (:class:`~companion.models.decoder.DecoderLM`). ``cite`` is the bibliography key of
    the model's paper, which gives its shape, ``data`` and ``published`` size; GPT-1's
    paper gave no size: its 117M is the figure of the GPT-2 paper's smallest model, which that paper
    sizes like the original GPT.
    """

    name: str
    kind: str
    cfg: ModelConfig
    published: float
    data: str
    cite: str


_BERT_DATA = "BooksCorpus + English Wikipedia, 3.3B words"
_GPT3_DATA = "300B tokens (filtered Common Crawl, WebText2, books, Wikipedia)"
_GPT3 = [  # Brown et al. (2020), Table 2.1: name, L, d, H (all with T = 2,048)
    ("GPT-3 Small", 125e6, 12, 768, 12),
    ("GPT-3 Medium", 350e6, 24, 1024, 16),
    ("GPT-3 Large", 760e6, 24, 1536, 16),
    # the table prints 24 heads of width 128 for d = 2048; 16 × 128 = 2048 is used
    # here (the count does not depend on how d is split into heads)
    ("GPT-3 XL", 1.3e9, 24, 2048, 16),
    ("GPT-3 2.7B", 2.7e9, 32, 2560, 32),
    ("GPT-3 6.7B", 6.7e9, 32, 4096, 32),
    # the table prints d = 5140, which its 40 heads of width 128 do not divide;
    # 40 × 128 = 5120 is used here
    ("GPT-3 13B", 13e9, 40, 5120, 40),
    ("GPT-3 175B", 175e9, 96, 12288, 96),
]

FAMILY: dict[str, Member] = {
    m.name: m
    for m in [
        Member("BERT-base", "encoder", bert_config(bert_hf_config(12, 768, 12))[0],
               110e6, _BERT_DATA, "devlin2019bert"),
        Member("BERT-large", "encoder", bert_config(bert_hf_config(24, 1024, 16))[0],
               340e6, _BERT_DATA, "devlin2019bert"),
        Member("GPT-1", "decoder", _gpt1(), 117e6,
               "BooksCorpus (7,000 unpublished books)", "radford2018improving"),
        *(
            Member(name, "decoder", _gpt(n_layers, d, heads), published,
                   "WebText, 40 GB of text", "radford2019language")
            for name, published, n_layers, d, heads in [
                # Radford et al. (2019), Table 2
                ("GPT-2 small", 117e6, 12, 768, 12),
                ("GPT-2 medium", 345e6, 24, 1024, 16),
                ("GPT-2 large", 762e6, 36, 1280, 20),
                ("GPT-2 XL", 1542e6, 48, 1600, 25),
            ]
        ),
        *(
            Member(name, "decoder", _gpt(n_layers, d, heads, 2048), published,
                   _GPT3_DATA, "brown2020language")
            for name, published, n_layers, d, heads in _GPT3
        ),
    ]
}


def pooler_params(d_model: int) -> int:
    """BERT's pooler: a (d, d) dense layer with a bias on the ``[CLS]`` vector."""
    return d_model * d_model + d_model


def exact_params(member: Member, *, pooler: bool = True) -> int:
    """Parameters of ``member`` built by the package on the meta device, tied weights
    once.

    BERT counts the released checkpoint's body: embeddings (tokens, positions, two
    segments, a LayerNorm), the blocks and, with ``pooler=True``, the ``[CLS]`` pooler
    that :class:`~companion.models.encoder.Encoder` leaves out; not the pretraining
    heads. The GPTs count the language model, whose output layer is the token embedding.
    """
    with torch.device("meta"):
        if member.kind == "encoder":
            model = Encoder(member.cfg, type_vocab_size=2)
        else:
            model = DecoderLM(member.cfg)
    n = model.num_params()
    if member.kind == "encoder" and pooler:
        n += pooler_params(member.cfg.d_model)
    return n


def family_rows() -> list[dict[str, object]]:
    """One row per member: shape, exact count, published count and their ratio."""
    rows = []
    for m in FAMILY.values():
        n = exact_params(m)
        rows.append(
            {
                "model": m.name,
                "L": m.cfg.n_layers,
                "d": m.cfg.d_model,
                "H": m.cfg.n_heads,
                "T": m.cfg.max_seq_len,
                "V": m.cfg.vocab_size,
                "LN": m.cfg.norm_placement,
                "params": n,
                "published": m.published,
                "ratio": n / m.published,
                "data": m.data,
                "cite": m.cite,
            }
        )
    return rows


def random_spans(
    n_tokens: int,
    noise_density: float = 0.15,
    mean_length: float = 3.0,
    generator: torch.Generator | None = None,
) -> list[tuple[int, int]]:
    """T5's noise spans over ``n_tokens``: ``(start, length)`` pairs, sorted.

    About ``noise_density · n`` tokens (at least 1, at most n − 1) in
    ``round(noise / mean_length)`` spans (at least 1); the spans and the kept runs
    between them get random positive lengths, and the text starts with a kept run.
    """
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to corrupt, got {n_tokens}")
    if not 0 < noise_density < 1 or mean_length < 1:
        raise ValueError(
            f"need 0 < noise_density < 1 and mean_length >= 1, got {noise_density}, "
            f"{mean_length}"
        )
    n_noise = min(max(round(n_tokens * noise_density), 1), n_tokens - 1)
    n_spans = min(max(round(n_noise / mean_length), 1), n_noise, n_tokens - n_noise)

    def split(total: int) -> list[int]:  # total into n_spans positive parts
        cuts = torch.randperm(total - 1, generator=generator)[: n_spans - 1] + 1
        edges = [0, *sorted(cuts.tolist()), total]
        return [b - a for a, b in zip(edges, edges[1:], strict=False)]

    noise, kept = split(n_noise), split(n_tokens - n_noise)
    spans, pos = [], 0
    for keep, length in zip(kept, noise, strict=True):
        pos += keep
        spans.append((pos, length))
        pos += length
    return spans


def corrupt_spans(
    tokens: Sequence[object],
    spans: Sequence[tuple[int, int]],
    sentinels: Sequence[object],
) -> tuple[list[object], list[object]]:
    """T5's span corruption: ``(input, target)`` for ``tokens`` with ``spans`` hidden.

    The input keeps the other tokens and puts the i-th sentinel where the i-th span
    was; the target is each sentinel followed by the tokens it hid, and one more
    sentinel to end. Spans must be sorted, non-empty, non-overlapping and inside ``tokens``.
    """
    if len(sentinels) < len(spans) + 1:
        raise ValueError(
            f"{len(spans)} spans need {len(spans) + 1} sentinels, got {len(sentinels)}"
        )
    inputs, target, pos = [], [], 0
    for i, (start, length) in enumerate(spans):
        if start < pos or length < 1 or start + length > len(tokens):
            raise ValueError(
                f"spans must be sorted, non-empty, non-overlapping and within {len(tokens)} "
                f"tokens; got {list(spans)}"
            )
        inputs += [*tokens[pos:start], sentinels[i]]
        target += [sentinels[i], *tokens[start : start + length]]
        pos = start + length
    inputs += tokens[pos:]
    target.append(sentinels[len(spans)])
    return inputs, target
