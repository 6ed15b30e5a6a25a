"""A static-shape decode step: the fast path beside :class:`~companion.model.DecoderLM`'s
cached forward (chapter 08).

Shape legend: B batch, S cache capacity (prompt + new tokens), d model width, H query heads,
H_kv key/value heads, D head width, V vocabulary.

``DecoderLM.forward`` with a :class:`~companion.model.DecodeCache` is the reference: readable,
and general (every family, window and cache kind). Its shapes change at every step (the
cache grows by one key), so each step is ~1,500 small eager operations between the matrix
products, and on a CPU those cost as much time as the products themselves. Here every step
has the *same* shapes: the keys are read from the whole preallocated cache through a mask,
the new position is a tensor, and the RoPE tables are built once. Attention is
:func:`~companion.attention.grouped_attention`, which reads each cached K/V head once for
all the query heads that share it. ``compile=True`` (opt-in) then lets ``torch.compile``
turn one step, greedy choice included, into a single graph whose small operations are
fused. Every step after the first has the shapes, dtypes and devices the first one had
checked, so the rest skip ``torch.compile``'s guard checks (``skip_guard_eval_unsafe``,
where the installed torch has it; about 1 ms a step for a 30-layer model). The prompt is
still read by the reference in one batched forward (prefill); only the one-token steps take
this path, writing into the same cache buffers.

It covers dense pre-norm RoPE decoders with full attention (SmolLM2, Llama, Mistral
without a window, Qwen3's QK-norm, Qwen2-style biases): configurations outside that raise
an error that names the field. Tests check it against the reference, token for token.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor

from .attention import grouped_attention
from .model import DecoderLM
from .rope import apply_rope

__all__ = ["StaticDecoder", "unsupported_fields"]


def unsupported_fields(model: DecoderLM) -> list[str]:
    """The config fields (with their values) the static step cannot express; [] if none."""
    cfg = model.cfg
    wanted = {
        "position": "rope",
        "norm_placement": "pre",
        "scale_embeddings": False,
        "n_experts": 0,
        "kv_lora_rank": 0,
        "attn_sinks": False,
        "attn_output_gate": False,
        "rope_local_theta": None,
        "nope_layers": (),
    }
    bad = [f"{k}={getattr(cfg, k)!r}" for k, v in wanted.items() if getattr(cfg, k) != v]
    if set(cfg.layer_kinds) != {"full"}:
        bad.append(f"layer_types={cfg.layer_kinds!r} (only full attention)")
    return bad


class StaticDecoder:
    """Greedy decoding of a :class:`~companion.model.DecoderLM` with a fixed-shape step
    (optionally compiled).

    ``generate`` matches ``model.generate(ids, n)`` token for token (greedy, no EOS stop).
    The step calls the model's own modules (norms, q/k/v projection, FFN); only the cache
    handling differs from the reference.
    """

    def __init__(self, model: DecoderLM, compile: bool = False) -> None:
        bad = unsupported_fields(model)
        if bad:
            raise ValueError(
                f"StaticDecoder covers dense pre-norm RoPE decoders; this config has {bad}. "
                "Use model.generate instead."
            )
        self.model = model
        self._next = torch.compile(self._next_eager, dynamic=False) if compile else None

    def _step_eager(
        self,
        ids: Tensor,
        pos: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        cos: Tensor,
        sin: Tensor,
    ) -> Tensor:
        """One token per sequence at position ``pos`` (a 1-element tensor): logits (B, V).
        ``cos``/``sin`` are the RoPE tables of all S positions; the new keys and values are
        written into ``keys``/``values`` (each (B, H_kv, S, D)) in place."""
        m = self.model
        x = m.tok_emb(ids)  # (B, 1, d)
        rope = cos.index_select(0, pos), sin.index_select(0, pos)  # (1, F) each
        visible = (torch.arange(keys[0].shape[2], device=ids.device) <= pos)[None]  # (1, S)
        for block, k_cache, v_cache in zip(m.blocks, keys, values, strict=True):
            attn = block.attn
            q, k, v, _ = attn.project(block.attn_norm(x))  # (B, H, 1, D), (B, H_kv, 1, D)
            q = apply_rope(q, *rope, layout=attn.rope_layout)
            k_cache.index_copy_(2, pos, apply_rope(k, *rope, layout=attn.rope_layout))
            v_cache.index_copy_(2, pos, v)
            o = grouped_attention(q, k_cache, v_cache, mask=visible, scale=attn.scale)
            x = x + attn.out_proj(o.transpose(1, 2).reshape(x.shape[0], 1, -1))
            x = x + block.ffn(block.ffn_norm(x))
        return m.lm_head(m.final_norm(x))[:, -1]  # (B, V)

    def _next_eager(self, *step_args: Tensor | list[Tensor]) -> Tensor:
        """The greedy next ids ``(B, 1)`` of :meth:`_step_eager` (same arguments)."""
        return self._step_eager(*step_args).argmax(-1, keepdim=True)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int) -> Tensor:
        """Prompt plus ``max_new_tokens`` greedy ids ``(B, T + new)``: a batched prefill
        through the reference, then one fixed-shape step per token."""
        m = self.model
        m.check_input_ids(input_ids)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        total = input_ids.shape[1] + max_new_tokens
        if total > m.cfg.max_seq_len:
            raise ValueError(
                f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceed "
                f"max_seq_len={m.cfg.max_seq_len}"
            )
        cache = m.new_cache(input_ids.shape[0], total)
        logits = m(input_ids, cache=cache, last_only=True)[:, -1]  # prefill
        keys = [layer.k for layer in cache.layers]
        values = [layer.v for layer in cache.layers]
        cos, sin = m.rope_tables(torch.arange(total, device=input_ids.device))["global"]
        step = self._next or self._next_eager
        out = [input_ids, logits.argmax(-1, keepdim=True)]

        def run(positions: range) -> None:
            for p in positions:
                pos = torch.tensor([p], device=input_ids.device)
                out.append(step(out[-1], pos, keys, values, cos, sin))

        start = input_ids.shape[1]
        run(range(start, min(start + 1, total - 1)))  # checks the compiled step's guards
        with self._guards_already_checked():
            run(range(start + 1, total - 1))
        return torch.cat(out, dim=1).to(input_ids.dtype)

    def _guards_already_checked(self) -> contextlib.AbstractContextManager:
        """Skip ``torch.compile``'s guard checks for the compiled step, if this torch can."""
        stance = getattr(torch.compiler, "set_stance", None)
        if self._next is None or stance is None:
            return contextlib.nullcontext()
        if "skip_guard_eval_unsafe" not in inspect.signature(stance).parameters:
            return contextlib.nullcontext()
        return stance(skip_guard_eval_unsafe=True)
