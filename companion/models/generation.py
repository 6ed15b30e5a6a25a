"""Generation from a decoder-only model: prefill, one decode step, the loop, sampling
(chapters 02, 08).

Shape legend: B batch, T prompt tokens, V vocabulary. The functions work on any model
with ``DecoderLM``'s interface (``forward_at``, ``new_cache``, ``check_input_ids``,
``cfg``):

- :func:`prefill` reads the prompt in one batched forward and fills the cache;
- :func:`decode_one_token` runs the model's own blocks on one token at a position
  tensor ``input_pos (1,)``: every step has the same shapes, because each layer cache is
  a preallocated buffer written at ``input_pos`` and read through a mask (gpt-fast's
  design), so ``torch.compile`` compiles it once and reuses it at every position;
- :func:`decode_n_tokens` loops it; :func:`sample` picks the next ids.

``compile=True`` is opt-in. The compiled step runs every one-row linear map on the CPU
in its decode form (:mod:`companion.ops.matvec`), which inductor turns into a loop that
streams the weights. Its guards (the checks that its inputs still have the shapes and
dtypes it was compiled for) are evaluated on the first step only and skipped on the
rest, where the installed torch can (``skip_guard_eval_unsafe``; about 1 ms a step for a
30-layer model): the loop changes nothing but the values.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch import Tensor, nn

from companion.checks import check_int, check_number
from companion.ops.matvec import OneRowLinears

__all__ = [
    "check_generation_args",
    "decode_n_tokens",
    "decode_one_token",
    "generate",
    "prefill",
    "sample",
]


def check_generation_args(
    vocab_size: int,
    max_new_tokens: object,
    temperature: object,
    top_k: object,
    eos_token_id: object,
    generator: object,
) -> None:
    """Raise an error naming the first of :func:`generate`'s arguments that is not
    allowed."""
    check_int("max_new_tokens", max_new_tokens, 0)
    try:
        check_number("temperature", temperature, 0.0)
    except ValueError:
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}"
        ) from None
    if top_k is not None and (
        isinstance(top_k, bool)
        or not isinstance(top_k, int)
        or not 1 <= top_k <= vocab_size
    ):
        raise ValueError(
            f"top_k must be None or an integer in [1, vocab_size={vocab_size}], got "
            f"{top_k!r}"
        )
    if eos_token_id is not None and (
        isinstance(eos_token_id, bool)
        or not isinstance(eos_token_id, int)
        or not 0 <= eos_token_id < vocab_size
    ):
        raise ValueError(
            f"eos_token_id must be None or an id in [0, vocab_size={vocab_size}), got "
            f"{eos_token_id!r}"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next ids ``(B, 1)`` from logits ``(B, V)``: argmax at temperature 0, else sampled
    from the softmax of ``logits / temperature`` (over the ``top_k`` largest, if
    given)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def prefill(model: nn.Module, input_ids: Tensor, cache: nn.Module) -> Tensor:
    """Read the prompt ``(B, T)`` into an empty ``cache``: the last position's logits
    ``(B, V)``."""
    return model(input_ids, cache=cache, last_only=True)[:, -1]


def decode_one_token(
    model: nn.Module, token: Tensor, input_pos: Tensor, cache: nn.Module
) -> Tensor:
    """Logits ``(B, V)`` of one token per sequence, ``token (B, 1)`` at position
    ``input_pos (1,)``, through the model's own blocks; its keys are written into the
    cache."""
    return model.forward_at(token, input_pos, cache, last_only=True)[:, -1]


_compiled_step = None


def _inductor_options() -> dict[str, int]:
    """The CPU vector width the generated C++ is built for, stated in the options.

    Inductor picks the vector ISA at run time (``ATEN_CPU_CAPABILITY`` lowers it: the
    pinned numerical path asks for AVX2 on an AVX-512 CPU), but its on-disk cache of
    generated code is not keyed on that choice. A process on one path would reuse code
    written for the other's vector width: 8-lane code built as AVX-512 stores 16 floats
    per 8 and corrupts the heap; 16-lane code built as AVX2 leaves lanes unwritten
    (NaN). Stated, the width enters the cache key, and each path gets its own code.
    ``cpp.simdlen`` is the width in bits (256 for AVX2): inductor looks for the ISA of
    exactly that many bits, and a width it does not know turns vectorisation off.
    """
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return {"cpp.simdlen": isa.bit_width()} if isa else {}


def _compiled_decode_step(
    model: nn.Module, token: Tensor, input_pos: Tensor, cache: nn.Module
) -> Tensor:
    """:func:`decode_one_token` compiled, its one-row linear maps traced in their decode
    form (:func:`companion.ops.matvec.matvec`: the weights streamed row by row)."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(
            decode_one_token, dynamic=False, options=_inductor_options()
        )
    with OneRowLinears():
        return _compiled_step(model, token, input_pos, cache)


def _step(compile: bool):  # noqa: ANN202 - a plain or a compiled decode_one_token
    return _compiled_decode_step if compile else decode_one_token


def _guards_checked_once(compile: bool) -> contextlib.AbstractContextManager:
    """Skip ``torch.compile``'s guard checks for the compiled step, if this torch
    can."""
    stance = getattr(torch.compiler, "set_stance", None)
    if not compile or stance is None:
        return contextlib.nullcontext()
    if "skip_guard_eval_unsafe" not in inspect.signature(stance).parameters:
        return contextlib.nullcontext()
    return stance(skip_guard_eval_unsafe=True)


def _check_finite(seen_nan: Tensor) -> None:
    """Raise if any logits read so far were NaN (``seen_nan``: a bool flag on the
    device, so the decode loop adds no host sync of its own)."""
    if bool(seen_nan):
        raise ValueError(
            "the model produced NaN logits while generating, so no token can be chosen; "
            "check the weights and the inputs (an fp16 overflow gives this, for one)"
        )


def _mark_finished(
    token: Tensor, done: Tensor | None, eos_token_id: int | None
) -> Tensor:
    """Sequences already finished keep writing ``eos_token_id``; ``done`` is updated in
    place."""
    if done is None:
        return token
    token = token.masked_fill(done, eos_token_id)
    done |= token == eos_token_id
    return token


def decode_n_tokens(
    model: nn.Module,
    token: Tensor,
    cache: nn.Module,
    n: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    compile: bool = False,
) -> list[Tensor]:
    """Up to ``n`` more ids, each ``(B, 1)``, continuing from ``token`` (the last id
    chosen, not yet in the cache). Stops early once every sequence has produced
    ``eos_token_id``. NaN logits raise a ValueError: at once when sampling (the
    softmax of a NaN cannot be sampled from), else when the loop ends (no host sync per
    greedy step)."""
    step = _step(compile)
    out: list[Tensor] = []
    done = token == eos_token_id if eos_token_id is not None else None
    input_pos = torch.tensor([cache.length], device=token.device)
    seen_nan = torch.zeros((), dtype=torch.bool, device=token.device)
    for i in range(n):
        if done is not None and bool(done.all()):
            break
        # built per step: making a stance applies it at once, so it must not exist before
        # the first step has checked the compiled step's guards
        with _guards_checked_once(compile) if i > 0 else contextlib.nullcontext():
            logits = step(model, token, input_pos, cache)
        cache.length += 1
        input_pos += 1
        seen_nan |= logits.isnan().any()
        if temperature > 0:
            _check_finite(seen_nan)
        token = sample(logits.float(), temperature, top_k, generator).to(token.dtype)
        token = _mark_finished(token, done, eos_token_id)
        out.append(token)
    _check_finite(seen_nan)
    return out


def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    eos_token_id: int | None = None,
    compile: bool = False,
) -> Tensor:
    """Prompt plus up to ``max_new_tokens`` ids ``(B, T + new)``: :func:`prefill`, then
    :func:`decode_n_tokens`. Without the cache (or past ``max_seq_len`` with absolute
    positions) each step re-reads the whole sequence (its last ``max_seq_len``
    tokens). Two silent changes of plan warn: the cache dropped because the sequence
    outgrows ``max_seq_len`` (``use_cache=False`` asks for that path and does not
    warn), and ``compile=True`` where no cached step runs."""
    cfg = model.cfg
    model.check_input_ids(input_ids)
    check_generation_args(
        cfg.vocab_size, max_new_tokens, temperature, top_k, eos_token_id, generator
    )
    total = input_ids.shape[1] + max_new_tokens
    sliding_context = cfg.position in ("learned", "sinusoidal")
    if total > cfg.max_seq_len and not sliding_context:
        raise ValueError(
            f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceed "
            f"max_seq_len={cfg.max_seq_len}"
        )
    if max_new_tokens == 0:
        return input_ids
    cached = use_cache and total <= cfg.max_seq_len
    if use_cache and not cached:
        warnings.warn(
            f"prompt + max_new_tokens = {total} exceed max_seq_len={cfg.max_seq_len}: "
            "generate re-reads the last max_seq_len tokens at every step, without the "
            "cache (pass use_cache=False to ask for that)",
            stacklevel=2,
        )
    if compile and not cached:
        warnings.warn(
            "compile=True has no effect without the cache: only the cached decode step "
            "is compiled",
            stacklevel=2,
        )
    kw = {"temperature": temperature, "top_k": top_k, "generator": generator}
    with torch.no_grad():
        if cached:
            cache = model.new_cache(input_ids.shape[0], total)
            logits = prefill(model, input_ids, cache)
            _check_finite(logits.isnan().any())
            first = sample(logits.float(), **kw).to(input_ids.dtype)
            rest = decode_n_tokens(
                model,
                first,
                cache,
                max_new_tokens - 1,
                eos_token_id=eos_token_id,
                compile=compile,
                **kw,
            )
            return torch.cat([input_ids, first, *rest], dim=1)
        ids = input_ids
        done = None
        if eos_token_id is not None:
            done = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            logits = model(ids[:, -cfg.max_seq_len :], last_only=True)[:, -1]
            _check_finite(logits.isnan().any())
            nxt = sample(logits.float(), **kw).to(ids.dtype)
            ids = torch.cat([ids, _mark_finished(nxt, done, eos_token_id)], dim=1)
            if done is not None and bool(done.all()):
                break
        return ids
