"""The encoder-decoder Transformer of "Attention Is All You Need" (chapter 03).

Shape legend: B batch, S source tokens, T target tokens, V shared vocabulary, d model
width, L blocks per stack, H heads. ``forward(src (B, S), tgt_in (B, T)) -> logits (B,
T, V)``.

The parts come from ``companion``: an encoder stack of ``build_block(cfg,
causal=False)``, a decoder stack of ``build_block(cfg, cross_attention=True)`` (causal),
sinusoidal (or learned) positions and one embedding table that serves the source, the
target and, with ``cfg.tie_embeddings``, the pre-softmax projection. Masks are 1/0 (or
bool) ``(B, S)`` and ``(B, T)`` tensors, 1 on real tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from companion.layers.embedding import embed_tokens, embedding_params
from companion.layers.norms import build_norm
from companion.layers.positions import LearnedPositions, SinusoidalPositions
from companion.layers.recording import recorded_inputs
from companion.models.builders import build_block
from companion.models.config import ModelConfig
from companion.models.inputs import check_mask, check_token_ids
from companion.ops.masks import padding_mask

__all__ = [
    "PAPER_BASE_PARAMS",
    "Seq2SeqTransformer",
    "base_param_breakdown",
    "transformer_base_config",
]

PAPER_BASE_PARAMS = (
    65_000_000  # Table 3 of Vaswani et al. (2017): "65 × 10^6" for the base model
)


def transformer_base_config(vocab_size: int = 37_000, **changes: object) -> ModelConfig:
    """The 2017 base model: d 512, 6 + 6 layers, 8 heads, d_ff 2048, shared 37k
    vocabulary.

    Post-LN, ReLU, sinusoidal positions, embeddings scaled by √d and tied to the output
    projection, dropout 0.1 on every sublayer output and on embeddings + positions.
    """
    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=512,
        n_layers=6,
        n_heads=8,
        d_ff=2048,
        max_seq_len=256,
        dropout=0.1,
        norm_placement="post",
        activation="relu",
        position="sinusoidal",
        tie_embeddings=True,
        scale_embeddings=True,
    )
    return cfg.replace(**changes) if changes else cfg


class Seq2SeqTransformer(nn.Module):
    """Shared embeddings (+ positions), an encoder stack, a decoder stack, an output
    head.

    ``n_layers`` blocks in each stack. Init: Glorot-uniform matrices and zero biases
    (the paper names no init; this is what common re-implementations use); the embedding
    table is N(0, 1/d) when ``scale_embeddings`` (so √d·E has unit-variance entries,
    like the sinusoids), else N(0, ``init_std`` squared).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(
            cfg.vocab_size, cfg.d_model
        )  # source, target (and head)
        self.pos_emb: nn.Module | None = None
        if cfg.position == "sinusoidal":
            self.pos_emb = SinusoidalPositions(cfg.d_model, cfg.max_seq_len)
        elif cfg.position == "learned":
            self.pos_emb = LearnedPositions(cfg.d_model, cfg.max_seq_len)
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(
            build_block(cfg, causal=False) for _ in range(cfg.n_layers)
        )
        self.decoder = nn.ModuleList(
            build_block(cfg, causal=True, cross_attention=True)
            for _ in range(cfg.n_layers)
        )
        # Post-LN blocks end in a norm; Pre-LN stacks need one after the last block.
        pre = cfg.norm_placement == "pre"
        self.enc_norm = (
            build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias) if pre else None
        )
        self.dec_norm = (
            build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias) if pre else None
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one (V, d) matrix, counted once

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        std = self.cfg.d_model**-0.5 if self.cfg.scale_embeddings else self.cfg.init_std
        nn.init.normal_(self.tok_emb.weight, std=std)
        if isinstance(self.pos_emb, LearnedPositions):
            nn.init.normal_(self.pos_emb.table.weight, std=self.cfg.init_std)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, counting the tied table once; optionally without embedding
        tables."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= embedding_params(self.tok_emb, self.pos_emb)
        return n

    def param_breakdown(self) -> dict[str, int]:
        """Parameter counts by part: embeddings, encoder, decoder, head (untied only),
        norms."""

        def count(*mods: nn.Module | None) -> int:
            return sum(p.numel() for m in mods if m is not None for p in m.parameters())

        parts = {
            "embeddings": count(self.tok_emb, self.pos_emb),
            "encoder": count(self.encoder),
            "decoder": count(self.decoder),
            "output head (untied)": 0
            if self.cfg.tie_embeddings
            else count(self.lm_head),
            "final norms (Pre-LN)": count(self.enc_norm, self.dec_norm),
        }
        assert sum(parts.values()) == self.num_params()
        return parts

    def check_ids(self, ids: Tensor, name: str) -> None:
        """Raise a ValueError that names what is wrong with ``ids`` (``src`` or
        ``tgt_in``)."""
        check_token_ids(
            ids,
            name,
            self.cfg.vocab_size,
            self.cfg.max_seq_len,
            device=self.lm_head.weight.device,
        )

    @staticmethod
    def _key_mask(mask: Tensor | None, ids: Tensor, name: str) -> Tensor | None:
        if mask is None:
            return None
        check_mask(mask, name, ids)
        return padding_mask(mask)  # (B, 1, 1, length)

    def embed(self, ids: Tensor, name: str = "ids") -> Tensor:
        """Shared token embeddings, times √d if configured, plus positions: (B, length,
        d)."""
        self.check_ids(ids, name)
        scale = math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else None
        return self.dropout(embed_tokens(self.tok_emb, self.pos_emb, ids, scale=scale))

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """The memory ``(B, S, d)``: every source token after L bidirectional blocks."""
        key_mask = self._key_mask(src_mask, src, "src_mask")
        x = self.embed(src, "src")  # (B, S, d)
        for block in self.encoder:
            x = block(x, mask=key_mask)
        return x if self.enc_norm is None else self.enc_norm(x)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` for each next target token, reading ``memory (B, S,
        d)``."""
        if memory.ndim != 3 or memory.shape[-1] != self.cfg.d_model:
            raise ValueError(
                f"memory must have shape (B, S, {self.cfg.d_model}), "
                f"got {tuple(memory.shape)}"
            )
        if memory.shape[0] != tgt_in.shape[0]:
            raise ValueError(
                f"memory and tgt_in must share the batch size, got {memory.shape[0]} "
                f"and {tgt_in.shape[0]}"
            )
        if src_mask is not None and tuple(src_mask.shape) != tuple(memory.shape[:2]):
            raise ValueError(
                f"src_mask must have shape (B, S) = {tuple(memory.shape[:2])}, "
                f"got {tuple(src_mask.shape)}"
            )
        cross_mask = None if src_mask is None else padding_mask(src_mask)
        self_mask = self._key_mask(tgt_mask, tgt_in, "tgt_mask")
        x = self.embed(tgt_in, "tgt_in")  # (B, T, d)
        for block in self.decoder:
            x = block(x, mask=self_mask, context=memory, context_mask=cross_mask)
        if self.dec_norm is not None:
            x = self.dec_norm(x)
        return self.lm_head(x)  # (B, T, V)

    def forward(
        self,
        src: Tensor,
        tgt_in: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """Teacher forcing: logits ``(B, T, V)``, position t predicting target token t +
        1."""
        if src.ndim == 2 and tgt_in.ndim == 2 and src.shape[0] != tgt_in.shape[0]:
            raise ValueError(
                f"src and tgt_in must share the batch size, got {src.shape[0]} and "
                f"{tgt_in.shape[0]}"
            )
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask, tgt_mask)

    @torch.no_grad()
    def cross_attention_maps(
        self, src: Tensor, tgt_in: Tensor, src_mask: Tensor | None = None
    ) -> list[Tensor]:
        """Each decoder block's cross-attention weights: L tensors ``(B, H, T, S)``.

        Hooks record exactly what each cross-attention sublayer receives during one
        forward pass; the reference attention then recomputes its softmax weights.
        """
        was_training = self.training
        self.eval()  # no dropout: the maps of the model as it translates
        try:
            with recorded_inputs([b.cross_attn for b in self.decoder]) as calls:
                self(src, tgt_in, src_mask)
        finally:
            self.train(was_training)
        return [
            block.cross_attn.attention_weights(
                args[0], context=kw["context"], mask=kw["mask"]
            )
            for block, (args, kw) in zip(self.decoder, calls, strict=True)
        ]


def base_param_breakdown(vocab_size: int = 37_000) -> dict[str, int]:
    """:meth:`Seq2SeqTransformer.param_breakdown` of the base model, built on the meta
    device.

    Counted: the shared (V, d) embedding table once (it is also the output projection),
    every attention projection (q, k, v, out, with biases), every FFN matrix and bias,
    every LayerNorm gain and bias. Not counted: the sinusoids (a fixed buffer, not a
    parameter).
    """
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = Seq2SeqTransformer(transformer_base_config(vocab_size))
    return model.param_breakdown()
