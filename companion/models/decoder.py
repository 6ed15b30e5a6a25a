"""A decoder-only language model built from ``companion`` parts (chapters 02, 04,
05-09).

Shape legend: B batch, T tokens, V vocabulary, d model width, L blocks, F RoPE
frequencies. ``forward(input_ids (B, T)) -> logits (B, T, V)``. Every model family in
later chapters keeps this interface and :meth:`DecoderLM.generate`'s. Decoding uses a
:class:`DecodeCache` (one cache per layer, made by that layer's token mixer): the prompt
is read in one batched forward (prefill), then each new token costs one small step with
the same shapes at every position (:mod:`companion.models.generation`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.layers.embedding import embed_tokens, embedding_params, normal_init
from companion.layers.hyper_connections import HyperHead, expand_streams
from companion.layers.norms import build_norm
from companion.layers.positions import LearnedPositions, SinusoidalPositions
from companion.layers.recording import recorded_inputs
from companion.models.builders import build_blocks, rotary_embedding
from companion.models.config import ModelConfig
from companion.models.generation import generate
from companion.models.inputs import check_mask, check_token_ids
from companion.ops.masks import padding_mask

__all__ = ["DecodeCache", "DecoderLM"]


class DecodeCache(nn.Module):
    """The per-layer caches of one generation and how many positions they hold.

    The layer caches are position-indexed and keep no count; ``length`` is the next
    position, advanced by :meth:`DecoderLM.forward` and by the decode loop; ``convert``
    turned each layer's plain cache into the one held (``None``: plain caches)."""

    def __init__(
        self,
        layers: list[nn.Module],
        max_len: int,
        convert: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.max_len, self.length = max_len, 0
        self.convert = convert

    def positions(self, t: int, device: torch.device | str | None = None) -> Tensor:
        """The positions ``(T,)`` of the next ``t`` tokens; a ValueError if they do not
        fit."""
        if self.length + t > self.max_len:
            raise ValueError(
                f"the cache is full: {self.length} + {t} tokens exceed max_len={self.max_len}; "
                "make the cache with a larger max_len"
            )
        return torch.arange(self.length, self.length + t, device=device)


def _layout(cache: nn.Module) -> tuple[str, dict[str, tuple[tuple[int, ...], str]]]:
    """A layer cache's kind and each buffer's shape and dtype: what a step checks."""
    buffers = {
        n: (tuple(b.shape), str(b.dtype).removeprefix("torch."))
        for n, b in cache.named_buffers()
    }
    return type(cache).__name__, buffers


class DecoderLM(nn.Module):
    """Embeddings (+ absolute positions), L causal blocks, a final norm, tied output
    head."""

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
        self.blocks = nn.ModuleList(build_blocks(cfg))
        # hyper-connections (DeepSeek-V4): the streams' last collapse, before the norm
        self.hc_head = None
        if cfg.residual is not None:
            self.hc_head = HyperHead(
                cfg.d_model,
                cfg.residual.n_streams,
                eps=cfg.residual.eps,
                norm_eps=cfg.norm_eps,
                init_std=cfg.init_std,
            )
        # Post-LN blocks end in a norm already; every other placement leaves the stream raw.
        self.final_norm = (
            nn.Identity()
            if cfg.norm_placement == "post"
            else build_norm(
                cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset
            )
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(functools.partial(normal_init, std=cfg.init_std))
        for (
            name,
            p,
        ) in self.named_parameters():  # scale the residual writes by depth (GPT-2)
            if name.endswith(("out_proj.weight", "down.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, counting tied weights once; optionally without the embedding
        tables."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= embedding_params(self.tok_emb, self.pos_emb)
        return n

    def check_input_ids(self, input_ids: Tensor, start: int = 0) -> None:
        """Raise an error that names what is wrong with ``input_ids`` (type, dtype,
        shape, device, range, length from position ``start``)."""
        check_token_ids(
            input_ids,
            "input_ids",
            self.cfg.vocab_size,
            self.cfg.max_seq_len,
            start,
            device=self.tok_emb.weight.device,
        )

    def check_cache(self, cache: object, batch: int) -> None:
        """Raise an error naming ``cache`` unless it is a cache this model could have
        made for ``batch`` sequences: per layer the same kind, buffer shapes and dtypes
        as :meth:`new_cache` makes with the cache's ``convert`` (compared on the meta
        device, so nothing is
        allocated), on the weights' device. Run before any layer writes, so a step that
        fails leaves every layer's cache as it was."""
        if not isinstance(cache, DecodeCache):
            raise TypeError(
                f"cache must be a DecodeCache from model.new_cache(batch, max_len), got "
                f"{type(cache).__name__}"
            )
        if len(cache.layers) != len(self.blocks):
            raise ValueError(
                f"cache holds {len(cache.layers)} layer caches but this model has "
                f"{len(self.blocks)} blocks: it was made for another model; use "
                "model.new_cache(batch, max_len)"
            )
        ref = self.tok_emb.weight
        for i, (block, got) in enumerate(zip(self.blocks, cache.layers, strict=True)):
            want = block.attn.new_cache(
                batch, cache.max_len, dtype=ref.dtype, device="meta"
            )
            if cache.convert is not None:
                want = cache.convert(want)
            (have_kind, have), (need_kind, need) = _layout(got), _layout(want)
            if have_kind != need_kind or have != need:
                raise ValueError(
                    f"cache layer {i} is a {have_kind} with buffers {have}, but a step "
                    f"of batch {batch} through this model needs a {need_kind} with "
                    f"{need}: make the cache with model.new_cache({batch}, max_len) "
                    "(same batch, the weights' dtype)"
                )
            for name, buf in got.named_buffers():
                if buf.device != ref.device:
                    raise ValueError(
                        f"cache layer {i} holds {name} on {buf.device} but the model is "
                        f"on {ref.device}; make the cache with model.new_cache"
                    )

    def embed(self, input_ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token embeddings (scaled by √d if configured) plus absolute positions: (B, T,
        d). ``positions`` default to 0..T-1; the ids are not checked (``forward`` checks
        them)."""
        scale = math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else None
        x = embed_tokens(self.tok_emb, self.pos_emb, input_ids, positions, scale=scale)
        return self.dropout(x)

    def rope_tables(self, positions: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """cos/sin ``(T, F)`` for the positions: ``"global"`` and, if set, ``"local"``
        base and DeepSeek-V4's ``"compress"`` one (the tables the layers were built
        with)."""
        tables = {}
        if self.cfg.position == "rope":
            tables["global"] = rotary_embedding(self.cfg)(positions)
            if self.cfg.rope_local_theta is not None:
                tables["local"] = rotary_embedding(self.cfg, local=True)(positions)
            if self.cfg.compression is not None:
                tables["compress"] = rotary_embedding(self.cfg, compress=True)(
                    positions
                )
        return tables

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        convert: Callable[[nn.Module], nn.Module] | None = None,
    ) -> DecodeCache:
        """Empty caches for ``batch`` sequences of up to ``max_len`` positions, one per
        layer, made by its token mixer (default: the weights' dtype and device), then
        passed through ``convert`` if given (a quantised cache)."""
        ref = self.tok_emb.weight
        kw = {"dtype": dtype or ref.dtype, "device": device or ref.device}
        layers = [b.attn.new_cache(batch, max_len, **kw) for b in self.blocks]
        layers = layers if convert is None else [convert(c) for c in layers]
        return DecodeCache(layers, max_len, convert)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: DecodeCache | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """Logits ``(B, T, V)``; ``attention_mask (B, T)`` marks real tokens with 1.

        With a ``cache`` the tokens continue the cached positions and their keys are
        stored. ``last_only`` computes the logits of the last position only, ``(B, 1,
        V)``.
        """
        if cache is not None and attention_mask is not None:
            raise ValueError(
                "attention_mask with a cache is not supported: decode unpadded batches"
            )
        self.check_input_ids(
            input_ids, cache.length if isinstance(cache, DecodeCache) else 0
        )
        if cache is not None:
            self.check_cache(cache, input_ids.shape[0])
        if attention_mask is not None:
            check_mask(attention_mask, "attention_mask", input_ids)
        t = input_ids.shape[1]
        if cache is None:
            positions = torch.arange(t, device=input_ids.device)
        else:
            positions = cache.positions(t, input_ids.device)
        mask = None if attention_mask is None else padding_mask(attention_mask)
        logits = self.forward_at(
            input_ids, positions, cache, mask=mask, last_only=last_only
        )
        if cache is not None:
            cache.length += t
        return logits

    def forward_at(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: DecodeCache | None = None,
        *,
        mask: Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """The forward pass of the tokens at ``positions (T,)``, unchecked: logits
        ``(B, T, V)``. Nothing here depends on a Python count, so one decode step
        (``T = 1``) has the same shapes at every position and compiles once."""
        x = self.embed(input_ids, positions)  # (B, T, d)
        if self.hc_head is not None:  # n residual streams: (B, T, n, d)
            x = expand_streams(x, self.cfg.residual.n_streams)
        for i, block in enumerate(self.blocks):
            # hash-routed experts (DeepSeek-V4) choose by token id
            ids = input_ids if self.cfg.is_hash_layer(i) else None
            layer_cache = None if cache is None else cache.layers[i]
            x = block(x, positions, layer_cache, mask=mask, token_ids=ids)
        if last_only:
            x = x[:, -1:]
        if self.hc_head is not None:
            x = self.hc_head(x)  # (B, T, d)
        return self.lm_head(self.final_norm(x))  # (B, T, V)

    @torch.no_grad()
    def attention_maps(self, input_ids: Tensor) -> list[Tensor]:
        """Each block's causal attention weights, a list of L tensors ``(B, H, T, T)``,
        recomputed from what each attention module received in one forward pass."""
        for i, block in enumerate(self.blocks):
            if not hasattr(block.attn, "attention_weights"):
                raise ValueError(
                    f"attention_maps: layer {i} ({type(block.attn).__name__}) has no "
                    "attention weights"
                )
        with recorded_inputs([b.attn for b in self.blocks]) as calls:
            self(input_ids)
        return [
            block.attn.attention_weights(*args[:2], **kwargs)
            for block, (args, kwargs) in zip(self.blocks, calls, strict=True)
        ]

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
        compile: bool = False,
    ) -> Tensor:
        """Prompt plus up to ``max_new_tokens`` sampled ids, ``(B, T + new)``;
        temperature 0 is greedy. Generation stops early once every sequence has produced
        ``eos_token_id`` (sequences that finished first are padded with it).

        With the cache: one prefill forward over the prompt, then one step per token
        (:func:`companion.models.generation.generate`); ``compile=True`` compiles that
        step with ``torch.compile``. A model with absolute positions asked to go past
        ``max_seq_len`` instead re-reads the last ``max_seq_len`` tokens at each step
        (no cache), with a warning unless ``use_cache=False`` asked for that.
        """
        return generate(
            self,
            input_ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
            use_cache=use_cache,
            eos_token_id=eos_token_id,
            compile=compile,
        )
