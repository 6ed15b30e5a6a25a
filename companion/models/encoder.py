"""A BERT-style bidirectional encoder, its masked-LM head and masking rule (chapter 04).

Shape legend: B batch, T tokens, V vocabulary, d model width, L blocks.
``Encoder.forward(input_ids (B, T), attention_mask (B, T), token_type_ids (B, T))``
returns hidden states ``(B, T, d)``; :meth:`Encoder.mlm_logits` adds the masked-LM head,
``(B, T, V)``. The blocks are :class:`companion.layers.block.TransformerBlock` built
with ``causal=False`` (:func:`companion.models.builders.build_block`): every token sees
every other (non-padding) token.

BERT's own layout is Post-LN, GELU, separate q/k/v projections with biases and a
LayerNorm on the embeddings; :func:`companion.checkpoints.minilm.bert_config` builds
that config. The encoder also accepts the other placements (then a final norm follows
the last block); positions are absolute (learned, sinusoidal or none).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_int
from companion.layers.embedding import embed_tokens, embedding_params, normal_init
from companion.layers.ffn import ACTIVATIONS
from companion.layers.norms import build_norm
from companion.layers.positions import LearnedPositions, SinusoidalPositions
from companion.models.builders import build_block
from companion.models.config import ModelConfig
from companion.models.inputs import check_mask, check_token_ids
from companion.ops.masks import padding_mask

__all__ = ["IGNORE_INDEX", "Encoder", "MLMHead", "mask_tokens", "mean_pool", "mlm_loss"]

IGNORE_INDEX = (
    -100
)  # label of positions the masked-LM loss skips (as F.cross_entropy's default)


class MLMHead(nn.Module):
    """dense → activation → norm → decoder tied to the token embeddings, plus a bias.

    ``(B, T, d) -> (B, T, V)``. ``decoder.weight`` *is* the embedding table (BERT ties
    them).
    """

    def __init__(self, cfg: ModelConfig, tok_emb: nn.Embedding) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation]
        self.norm = build_norm(
            cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset
        )
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.decoder.weight = (
            tok_emb.weight
        )  # tied: one (V, d) matrix reads and writes tokens
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        h = self.norm(self.act(self.dense(hidden)))  # (B, T, d)
        return self.decoder(h) + self.bias  # (B, T, V)


class Encoder(nn.Module):
    """Token + position (+ token-type) embeddings, a norm, L bidirectional blocks.

    ``type_vocab_size`` is the number of segment ids (BERT: 2; 0 drops the table);
    ``mlm_head=True`` adds :class:`MLMHead`.
    """

    def __init__(
        self, cfg: ModelConfig, *, type_vocab_size: int = 2, mlm_head: bool = False
    ) -> None:
        super().__init__()
        check_int("type_vocab_size", type_vocab_size, 0)
        if cfg.position not in ("learned", "sinusoidal", "none"):
            raise ValueError(
                f"the encoder adds absolute positions: position must be one of "
                f"('learned', 'sinusoidal', 'none'), got {cfg.position!r}"
            )
        if "sliding" in cfg.layer_types:
            raise ValueError(
                "the encoder attends to the whole input: set sliding_window=None"
            )
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Module | None = None
        if cfg.position == "learned":
            self.pos_emb = LearnedPositions(cfg.d_model, cfg.max_seq_len)
        elif cfg.position == "sinusoidal":
            self.pos_emb = SinusoidalPositions(cfg.d_model, cfg.max_seq_len)
        self.type_emb = (
            nn.Embedding(type_vocab_size, cfg.d_model) if type_vocab_size else None
        )
        self.emb_norm = build_norm(
            cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            build_block(cfg, i, causal=False) for i in range(cfg.n_layers)
        )
        self.final_norm = (  # Post-LN blocks end in a norm; other placements leave the stream raw
            nn.Identity()
            if cfg.norm_placement == "post"
            else build_norm(
                cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset
            )
        )
        self.mlm_head = MLMHead(cfg, self.tok_emb) if mlm_head else None
        self.apply(functools.partial(normal_init, std=cfg.init_std))

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, tied weights once; optionally without the three embedding
        tables."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= embedding_params(self.tok_emb, self.pos_emb, self.type_emb)
        return n

    def _check_inputs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
    ) -> None:
        check_token_ids(
            input_ids,
            "input_ids",
            self.cfg.vocab_size,
            self.cfg.max_seq_len,
            device=self.tok_emb.weight.device,
        )
        if attention_mask is not None:
            check_mask(attention_mask, "attention_mask", input_ids)
        if token_type_ids is not None:
            n_types = 0 if self.type_emb is None else self.type_emb.num_embeddings
            check_token_ids(
                token_type_ids,
                "token_type_ids",
                n_types,
                self.cfg.max_seq_len,
                vocab_name="type_vocab_size",
            )
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"token_type_ids must have the shape of input_ids "
                    f"{tuple(input_ids.shape)}, got {tuple(token_type_ids.shape)}"
                )

    def embed(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Sum of token, position and token-type embeddings, normed: ``(B, T, d)``."""
        scale = math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else None
        x = embed_tokens(
            self.tok_emb, self.pos_emb, input_ids, scale=scale
        )  # (B, T, d)
        if self.type_emb is not None:  # BERT adds segment 0 when no ids are given
            types = (
                torch.zeros_like(input_ids)
                if token_type_ids is None
                else token_type_ids
            )
            x = x + self.type_emb(types)
        return self.dropout(self.emb_norm(x))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Hidden states ``(B, T, d)``; ``attention_mask (B, T)`` is 1 on real
        tokens."""
        self._check_inputs(input_ids, attention_mask, token_type_ids)
        mask = (
            None if attention_mask is None else padding_mask(attention_mask)
        )  # (B, 1, 1, T)
        x = self.embed(input_ids, token_type_ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.final_norm(x)  # (B, T, d)

    def mlm_logits(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Masked-LM logits ``(B, T, V)`` (needs ``mlm_head=True``)."""
        if self.mlm_head is None:
            raise ValueError(
                "this encoder has no MLM head: build it with mlm_head=True"
            )
        return self.mlm_head(self(input_ids, attention_mask, token_type_ids))


def mean_pool(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Average of the hidden states of the real tokens: ``(B, T, d), (B, T) -> (B,
    d)``."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    if attention_mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"attention_mask must have shape (B, T) = {tuple(hidden.shape[:2])}, "
            f"got {tuple(attention_mask.shape)}"
        )
    w = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9)  # (B, d)


def _check_masking(
    input_ids: Tensor,
    vocab_size: int,
    select_prob: float,
    mask_frac: float,
    random_frac: float,
    special: Tensor | None,
) -> None:
    """Raise a ValueError naming the first argument of :func:`mask_tokens` that is
    not allowed."""
    if not 0.0 < select_prob <= 1.0:
        raise ValueError(f"select_prob must be in (0, 1], got {select_prob}")
    if mask_frac < 0 or random_frac < 0 or mask_frac + random_frac > 1.0:
        raise ValueError(
            f"mask_frac and random_frac must be >= 0 with a sum <= 1, got {mask_frac}, "
            f"{random_frac}"
        )
    check_int("vocab_size", vocab_size, 1)
    if special is not None and special.shape != input_ids.shape:
        raise ValueError(
            f"special must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(special.shape)}"
        )


def mask_tokens(
    input_ids: Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    generator: torch.Generator | None = None,
    select_prob: float = 0.15,
    mask_frac: float = 0.8,
    random_frac: float = 0.1,
    special: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT's corruption rule: returns ``(inputs, labels)``, both shaped like
    ``input_ids``.

    Each token is selected with probability ``select_prob`` (never where ``special`` is
    True). A selected token becomes ``mask_id`` with probability ``mask_frac``, a random
    id drawn from ``[0, vocab_size)`` with probability ``random_frac``, and stays as it
    is otherwise. ``labels`` holds the original id at selected positions and
    ``IGNORE_INDEX`` (-100) elsewhere. The same ``generator`` state gives the same
    result.
    """
    _check_masking(input_ids, vocab_size, select_prob, mask_frac, random_frac, special)
    shape = input_ids.shape
    # the draws are made on the CPU, so a seed gives the same result on every device
    u_select = torch.rand(shape, generator=generator)
    u_action = torch.rand(shape, generator=generator)
    random_ids = torch.randint(0, vocab_size, shape, generator=generator)
    u_select, u_action = u_select.to(input_ids.device), u_action.to(input_ids.device)
    random_ids = random_ids.to(input_ids.device, input_ids.dtype)
    selected = u_select < select_prob
    if special is not None:
        selected &= ~special.bool()
    to_mask = selected & (u_action < mask_frac)
    to_random = selected & ~to_mask & (u_action < mask_frac + random_frac)
    inputs = input_ids.masked_fill(to_mask, mask_id)
    inputs = torch.where(to_random, random_ids, inputs)
    labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
    return inputs, labels


def mlm_loss(model: Encoder, inputs: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of the MLM head on the selected positions only (``labels !=
    -100``).

    Same ``(model, x, y)`` signature as :func:`companion.training.lm_loss`, so
    :func:`companion.training.train` and ``evaluate`` take it as ``loss_fn``.
    """
    logits = model.mlm_logits(inputs)  # (B, T, V)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )
