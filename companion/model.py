"""A decoder-only language model built from ``companion`` parts (chapters 02, 04).

Shape legend: B batch, T tokens, V vocabulary, d model width, L blocks.
``forward(input_ids (B, T)) -> logits (B, T, V)``. Every model family in later chapters
keeps this interface and :meth:`DecoderLM.generate`'s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .block import TransformerBlock
from .config import ModelConfig
from .masks import padding_mask
from .norms import build_norm
from .positions import LearnedPositions, SinusoidalPositions

__all__ = ["DecoderLM"]


class DecoderLM(nn.Module):
    """Embeddings (+ absolute positions), L causal blocks, a final norm, tied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Module | None = None
        if cfg.position == "learned":
            self.pos_emb = LearnedPositions(cfg.d_model, cfg.max_seq_len)
        elif cfg.position == "sinusoidal":
            self.pos_emb = SinusoidalPositions(cfg.d_model, cfg.max_seq_len)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, causal=True) for _ in range(cfg.n_layers))
        # Post-LN blocks end in a norm already; Pre-LN leaves the stream un-normed.
        self.final_norm = (
            build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
            if cfg.norm_placement == "pre"
            else nn.Identity()
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scale the residual writes by depth (GPT-2)
            if name.endswith(("out_proj.weight", "down.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, counting tied weights once; optionally without the embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= self.tok_emb.weight.numel()
            if isinstance(self.pos_emb, LearnedPositions):
                n -= self.pos_emb.table.weight.numel()
        return n

    def check_input_ids(self, input_ids: Tensor) -> None:
        """Raise a ValueError that names what is wrong with ``input_ids``."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (B, T), got {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be int64 or int32 token ids, got {input_ids.dtype}")
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(
                f"input_ids has {t} tokens but the model's context is "
                f"max_seq_len={self.cfg.max_seq_len}; shorten the prompt"
            )
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.cfg.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, vocab_size={self.cfg.vocab_size}), got ids in "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings (scaled by √d if configured) plus absolute positions: (B, T, d)."""
        self.check_input_ids(input_ids)
        x = self.tok_emb(input_ids)
        if self.cfg.scale_embeddings:
            x = x * math.sqrt(self.cfg.d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(input_ids.shape[1], device=input_ids.device))
        return self.dropout(x)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits ``(B, T, V)``; ``attention_mask (B, T)`` marks real tokens with 1."""
        mask = None if attention_mask is None else padding_mask(attention_mask)
        x = self.embed(input_ids)  # (B, T, d)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.lm_head(self.final_norm(x))  # (B, T, V)

    @torch.no_grad()
    def attention_maps(self, input_ids: Tensor) -> list[Tensor]:
        """Each block's causal attention weights, a list of L tensors ``(B, H, T, T)``."""
        maps = []
        x = self.embed(input_ids)
        for block in self.blocks:
            maps.append(block.attn.attention_weights(block.attention_input(x), causal=block.causal))
            x = block(x)
        return maps

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Prompt plus ``max_new_tokens`` sampled ids, ``(B, T + new)``; temperature 0 is greedy.

        Without a KV cache (chapter 08 adds one) each step re-reads the last ``max_seq_len``
        tokens.
        """
        self.check_input_ids(input_ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k must be in [1, vocab_size={self.cfg.vocab_size}], got {top_k}")
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.cfg.max_seq_len :])[:, -1, :].float()  # (B, V)
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
        return ids
