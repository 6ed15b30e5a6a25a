"""Multi-token prediction: one extra module that predicts the token after next (chapter
12).

Shape legend: B batch, T tokens, d model width, V vocabulary.

DeepSeek-V3's MTP module at depth 1, for a :class:`~companion.models.decoder.DecoderLM`
trunk: at position i it takes the trunk's last hidden state ``h_i`` and the embedding of
the *next* token ``t_{i+1}``, normalises both, concatenates them, projects ``2d -> d``,
runs one more causal Transformer block and a final norm, and predicts ``t_{i+2}``
through the trunk's own output head (the embedding table and the head are shared, not
copied). In training the next token is the true one (teacher forcing); at inference it
is the trunk's own prediction, so the module drafts a second token for speculative
decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.layers.norms import RMSNorm, build_norm
from companion.models.builders import build_block
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM

__all__ = ["MTPModule", "mtp_losses", "trunk_forward"]


def trunk_forward(model: DecoderLM, input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(hidden (B, T, d), logits (B, T, V))``: the residual stream entering the final
    norm (caught by a hook, so the model's own forward runs unchanged) and the
    logits."""
    caught: list[Tensor] = []
    handle = model.final_norm.register_forward_pre_hook(
        lambda _m, args: caught.append(args[0])
    )
    try:
        logits = model(input_ids)
    finally:
        handle.remove()
    return caught[0], logits


class MTPModule(nn.Module):
    """One DeepSeek-V3-style MTP depth: [norm(h_i); norm(emb(t_{i+1}))] -> block ->
    t_{i+2}."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.position != "rope":
            raise ValueError(
                f"MTPModule expects a RoPE trunk (position='rope'), got {cfg.position!r}"
            )
        d = cfg.d_model
        self.h_norm, self.e_norm = (
            RMSNorm(d, eps=cfg.norm_eps),
            RMSNorm(d, eps=cfg.norm_eps),
        )
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = build_block(cfg, 0)
        self.norm = build_norm(cfg.norm, d, cfg.norm_eps, cfg.bias, cfg.norm_offset)
        for p in self.parameters():  # the trunk's initialisation scale
            if p.ndim == 2:
                nn.init.normal_(p, std=cfg.init_std)

    def forward(self, model: DecoderLM, hidden: Tensor, next_ids: Tensor) -> Tensor:
        """Logits ``(B, T, V)`` for the token after ``next_ids``, from ``hidden (B, T,
        d)``."""
        if hidden.shape[:2] != next_ids.shape:
            raise ValueError(
                f"hidden (B, T, d) and next_ids (B, T) must share B and T; got "
                f"{tuple(hidden.shape)} and {tuple(next_ids.shape)}"
            )
        e = model.tok_emb(next_ids)  # the trunk's embedding table, shared
        x = self.proj(
            torch.cat([self.h_norm(hidden), self.e_norm(e)], dim=-1)
        )  # (B, T, d)
        x = self.block(x)  # positions 0..T-1, the trunk's RoPE table
        return model.lm_head(self.norm(x))  # the trunk's output head, shared


def mtp_losses(
    model: DecoderLM, mtp: MTPModule, x: Tensor, y: Tensor
) -> tuple[Tensor, Tensor]:
    """``(next-token loss, token-after-next loss)`` on ``x (B, T)`` with targets ``y =
    x`` shifted by one. The MTP module at position i sees ``y_i = t_{i+1}`` and predicts
    ``y_{i+1} = t_{i+2}``, so it scores T − 1 positions. Train on ``main + λ·extra``."""
    hidden, logits = trunk_forward(model, x)
    main = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    extra_logits = mtp(model, hidden[:, :-1], y[:, :-1])  # (B, T-1, V)
    extra = F.cross_entropy(extra_logits.flatten(0, 1).float(), y[:, 1:].flatten())
    return main, extra
