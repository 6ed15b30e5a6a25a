"""A decoder-only language model built from ``companion`` parts (chapters 02, 04, 05-09).

Shape legend: B batch, T tokens, V vocabulary, d model width, L blocks, F RoPE frequencies.
``forward(input_ids (B, T)) -> logits (B, T, V)``. Every model family in later chapters
keeps this interface and :meth:`DecoderLM.generate`'s. Decoding uses a
:class:`DecodeCache` (one KV cache per layer, a ring buffer for sliding layers): the prompt
is read in one batched forward (prefill), then each new token costs one small step.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from .block import TransformerBlock
from .config import ModelConfig, check_token_ids
from .flex import BlockMask, causal_window_block_mask
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetCache
from .kv_cache import KVCache, SlidingWindowCache, position_mask
from .masks import combine_masks, padding_mask
from .mla import LatentCache, MultiHeadLatentAttention
from .norms import build_norm
from .positions import LearnedPositions, SinusoidalPositions
from .rope import rope_cos_sin, rope_frequencies

__all__ = ["DecodeCache", "DecoderLM", "normal_init", "sample_next"]


def normal_init(m: nn.Module, std: float) -> None:
    """GPT-2's initialisation of one module: N(0, std) weights for linear layers and
    embeddings, zero biases. Use as ``model.apply(partial(normal_init, std=...))``."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=std)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class DecodeCache(nn.Module):
    """The per-layer KV caches of one generation, and how many positions they hold."""

    def __init__(
        self, layers: list[KVCache | SlidingWindowCache | LatentCache | GatedDeltaNetCache]
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    @property
    def length(self) -> int:
        return self.layers[0].length if len(self.layers) else 0


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
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg, causal=True, layer=i) for i in range(cfg.n_layers)
        )
        # Post-LN blocks end in a norm already; every other placement leaves the stream raw.
        self.final_norm = (
            nn.Identity()
            if cfg.norm_placement == "post"
            else build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset)
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._block_masks: dict[tuple, BlockMask] = {}  # FlexAttention masks, by shape
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(functools.partial(normal_init, std=cfg.init_std))
        for name, p in self.named_parameters():  # scale the residual writes by depth (GPT-2)
            if name.endswith(("out_proj.weight", "down.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, counting tied weights once; optionally without the embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= self.tok_emb.weight.numel()
            if isinstance(self.pos_emb, LearnedPositions):
                n -= self.pos_emb.table.weight.numel()
        return n

    def check_input_ids(self, input_ids: Tensor, start: int = 0) -> None:
        """Raise a ValueError that names what is wrong with ``input_ids``."""
        check_token_ids(input_ids, "input_ids", self.cfg.vocab_size, self.cfg.max_seq_len, start)

    def embed(self, input_ids: Tensor, start: int = 0) -> Tensor:
        """Token embeddings (scaled by √d if configured) plus absolute positions: (B, T, d)."""
        self.check_input_ids(input_ids, start)
        x = self.tok_emb(input_ids)
        if self.cfg.scale_embeddings:
            x = x * torch.tensor(math.sqrt(self.cfg.d_model), dtype=x.dtype)
        if self.pos_emb is not None:
            t = input_ids.shape[1]
            x = x + self.pos_emb(torch.arange(start, start + t, device=input_ids.device))
        return self.dropout(x)

    def rope_tables(self, positions: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """cos/sin ``(T, F)`` for the positions: ``"global"`` and, if set, ``"local"`` base."""
        cfg = self.cfg
        if cfg.position != "rope":
            return {}
        seq_len = int(positions[-1]) + 1 if positions.numel() else 0
        inv, scale = rope_frequencies(
            cfg.rope_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.partial_rotary_factor,
            cfg.max_seq_len,
            seq_len=seq_len,
        )
        tables = {"global": rope_cos_sin(positions, inv, scale)}
        if cfg.rope_local_theta is not None:
            inv, _ = rope_frequencies(
                cfg.rope_dim, cfg.rope_local_theta, None, cfg.partial_rotary_factor
            )
            tables["local"] = rope_cos_sin(positions, inv)
        return tables

    def _self_attention_mask(
        self, positions: Tensor, window: int | None, pad: Tensor | None
    ) -> Tensor | BlockMask | None:
        """The mask of one layer kind: None (plain causal), a bool tensor, or for
        ``attn_impl="flex"`` a BlockMask, built once per length and window and reused."""
        if self.cfg.attn_impl == "flex" and pad is None:
            key = (len(positions), window, positions.device)
            if key not in self._block_masks:
                self._block_masks[key] = causal_window_block_mask(
                    len(positions), None, window, positions.device
                )
            return self._block_masks[key]
        if window is None:
            return pad
        return combine_masks(pad, position_mask(positions, positions, window))

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> DecodeCache:
        """Empty caches for ``batch`` sequences of up to ``max_len`` positions."""
        ref = self.tok_emb.weight
        dtype = dtype or ref.dtype
        layers = []
        for block in self.blocks:
            attn = block.attn
            if isinstance(attn, MultiHeadLatentAttention):
                layers.append(attn.new_cache(batch, max_len, dtype, ref.device))
                continue
            if isinstance(attn, GatedDeltaNet):  # a fixed-size state, whatever max_len
                layers.append(attn.make_cache(batch, dtype, ref.device))
                continue
            args = (batch, attn.n_kv_heads)
            kw = {"dtype": dtype, "device": ref.device}
            if block.window is not None and block.window < max_len:
                layers.append(SlidingWindowCache(*args, block.window, attn.head_dim, **kw))
            else:
                layers.append(KVCache(*args, max_len, attn.head_dim, **kw))
        return DecodeCache(layers)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: DecodeCache | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """Logits ``(B, T, V)``; ``attention_mask (B, T)`` marks real tokens with 1.

        With a ``cache`` the tokens continue the cached positions and their keys are stored.
        ``last_only`` computes the logits of the last position only, ``(B, 1, V)``.
        """
        start = cache.length if cache is not None else 0
        if cache is not None and attention_mask is not None:
            raise ValueError(
                "attention_mask with a cache is not supported: decode unpadded batches"
            )
        x = self.embed(input_ids, start)  # (B, T, d)
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        tables = self.rope_tables(positions)
        pad = None if attention_mask is None else padding_mask(attention_mask)
        masks: dict[int | None, Tensor | None] = {}
        for i, block in enumerate(self.blocks):
            rope = tables.get("local" if block.window and "local" in tables else "global")
            if cache is not None:
                x = block(x, rope=rope, cache=cache.layers[i], positions=positions)
                continue
            if block.window not in masks:  # built once per forward, shared by the layers
                masks[block.window] = self._self_attention_mask(positions, block.window, pad)
            x = block(x, mask=masks[block.window], rope=rope)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.final_norm(x))  # (B, T, V)

    @torch.no_grad()
    def attention_maps(self, input_ids: Tensor) -> list[Tensor]:
        """Each block's causal attention weights, a list of L tensors ``(B, H, T, T)``."""
        maps = []
        x = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        tables = self.rope_tables(positions)
        for i, block in enumerate(self.blocks):
            if block.kind == "linear":
                raise ValueError(
                    f"attention_maps: layer {i} is a Gated DeltaNet layer, which has no "
                    "attention weights"
                )
            rope = tables.get("local" if block.window and "local" in tables else "global")
            rope = rope if block.uses_rope else None
            mask = (
                None if block.window is None else position_mask(positions, positions, block.window)
            )
            h = block.attention_input(x)
            maps.append(block.attn.attention_weights(h, mask=mask, causal=block.causal, rope=rope))
            x = block(x, mask=mask, rope=rope)
        return maps

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        eos_token_id: int | None = None,
    ) -> Tensor:
        """Prompt plus up to ``max_new_tokens`` sampled ids, ``(B, T + new)``; temperature 0
        is greedy. Generation stops early once every sequence has produced ``eos_token_id``
        (sequences that finished first are padded with it).

        With the cache: one prefill forward over the prompt, then one step per token. A model
        with absolute positions asked to go past ``max_seq_len`` instead re-reads the last
        ``max_seq_len`` tokens at each step (no cache).
        """
        self.check_input_ids(input_ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k must be in [1, vocab_size={self.cfg.vocab_size}], got {top_k}")
        total = input_ids.shape[1] + max_new_tokens
        sliding_context = self.cfg.position in ("learned", "sinusoidal")
        if total > self.cfg.max_seq_len and not sliding_context:
            raise ValueError(
                f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceed "
                f"max_seq_len={self.cfg.max_seq_len}"
            )
        cache = None
        if use_cache and total <= self.cfg.max_seq_len:
            cache = self.new_cache(input_ids.shape[0], total)
        ids, step_in = input_ids, input_ids
        done = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            if cache is not None:
                logits = self(step_in, cache=cache, last_only=True)[:, -1, :]
            else:
                logits = self(ids[:, -self.cfg.max_seq_len :], last_only=True)[:, -1, :]
            nxt = sample_next(logits.float(), temperature, top_k, generator).to(ids.dtype)
            if eos_token_id is not None:
                nxt = nxt.masked_fill(done, eos_token_id)
                done |= nxt == eos_token_id
            ids = torch.cat([ids, nxt], dim=1)
            step_in = nxt
            if eos_token_id is not None and bool(done.all()):
                break
        return ids


def sample_next(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """Next ids ``(B, 1)`` from logits ``(B, V)``: argmax at temperature 0, else sampled."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
