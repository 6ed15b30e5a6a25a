"""Length extrapolation: train at a short context, measure the loss at every position of
a longer one, and change a RoPE model's frequencies at evaluation time (chapter 05).

Shape legend: B windows per batch, T positions, V vocabulary, L layers, F RoPE
frequencies.

- :func:`position_config` builds one small decoder per position scheme (``"learned"``,
  ``"sinusoidal"``, ``"rope"``, ``"none"``, ``"alibi"``) that accepts ``max_len`` tokens
  (the learned table only ``train_len``: it has no rows past that); :func:`train_short`
  trains it on windows of ``train_len`` tokens, from scratch or, for a copy made by
  :func:`with_rope`, as a fine-tune at a new length.
- :func:`per_position_loss` gives the held-out next-token loss at each of T positions,
  ``(T,)``; :func:`per_position_loss_scaled` does the same for a RoPE model whose
  scaling follows the length being read (linear, NTK/dynamic or YaRN,
  :func:`rope_scaling_for`).
- :func:`same_weights` and :func:`with_rope` copy a trained model with other settings (a
  sliding window; a RoPE base or scaling) and the same weights.
- :func:`rope_used_per_layer` records which RoPE table (``"local"``, ``"global"`` or
  none) each layer's attention receives, for Gemma 3's two bases and NoPE layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.checks import check_choice, check_int
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.rope import RopeScaling, dynamic_ntk_theta
from companion.tasks.text import sample_windows
from companion.training import History, cosine_lr, make_adamw, train

__all__ = [
    "SCALING_METHODS",
    "ntk_theta",
    "per_position_loss",
    "per_position_loss_scaled",
    "position_config",
    "rope_scaling_for",
    "rope_used_per_layer",
    "same_weights",
    "train_short",
    "with_rope",
]

SCALING_METHODS = ("none", "linear", "ntk", "yarn")


def position_config(
    position: str,
    vocab_size: int,
    train_len: int,
    max_len: int,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 2,
    **overrides: object,
) -> ModelConfig:
    """The chapter's small Pre-LN decoder with positions ``position``.

    ``max_seq_len`` is ``max_len`` (the longest evaluation), except for ``"learned"``,
    whose table has only the ``train_len`` rows that training can reach. ``overrides``
    sets any other config field (or replaces these defaults).
    """
    fields: dict[str, object] = {
        "vocab_size": vocab_size,
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "max_seq_len": train_len if position == "learned" else max_len,
        "position": position,
        "scale_embeddings": position
        == "sinusoidal",  # 2017: tokens on the sinusoids' scale
        "init_std": 0.1 if position == "sinusoidal" else 0.02,
        "attn_impl": "sdpa",
    }
    return ModelConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def train_short(
    model: DecoderLM,
    ids: Tensor,
    train_len: int,
    steps: int,
    *,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> History:
    """Train ``model`` on random windows of ``train_len`` tokens of ``ids (N,)``.

    AdamW, 10% warmup then a cosine to lr/10, gradient clipping at 1; the windows depend
    only on ``seed``, so models trained with the same seed see the same text.
    """
    windows = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    return train(
        model,
        lambda step: sample_windows(ids, batch_size, train_len, windows, device),
        steps,
        make_adamw(model, lr=lr),
        lr_at=lambda s: cosine_lr(
            s, lr, warmup=max(1, steps // 10), total=steps, min_lr=lr / 10
        ),
        desc=f"train {model.cfg.position}",
    )


def _check_windows(
    seq_len: int, n_windows: int, batch_size: int, window_len: int | None
) -> int:
    """The window length :func:`per_position_loss` draws, after checking its
    arguments."""
    window_len = seq_len if window_len is None else window_len
    check_int("n_windows", n_windows, 1)
    check_int("batch_size", batch_size, 1)
    if window_len < seq_len:
        raise ValueError(f"window_len ({window_len}) must be >= seq_len ({seq_len})")
    return window_len


@torch.no_grad()
def per_position_loss(
    model: DecoderLM,
    ids: Tensor,
    seq_len: int,
    n_windows: int,
    *,
    batch_size: int = 16,
    seed: int = 0,
    window_len: int | None = None,
) -> Tensor:
    """Mean next-token loss at each position of ``n_windows`` windows of ``seq_len``:
    ``(T,)``.

    Position t predicts token t + 1 from the t + 1 tokens before it. The windows
    depend only on ``seed`` and ``window_len`` (default ``seq_len``): windows of
    ``window_len`` tokens are drawn and their first ``seq_len`` read, so that calls
    with different ``seq_len`` and the same ``window_len`` score the same text. A
    model that cannot read ``seq_len`` tokens raises its own error.
    """
    window_len = _check_windows(seq_len, n_windows, batch_size, window_len)
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    total = torch.zeros(seq_len, dtype=torch.float64)
    done = 0
    while done < n_windows:
        b = min(batch_size, n_windows - done)
        x, y = sample_windows(ids, b, window_len, gen, device)
        x, y = x[:, :seq_len], y[:, :seq_len]  # (B, T)
        logits = model(x).float()  # (B, T, V)
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), y, reduction="none"
        )
        total += nll.sum(0).cpu().double()  # (T,); MPS has no float64
        done += b
    model.train(was_training)
    return (total / n_windows).float()


def ntk_theta(theta: float, rotary_dim: int, train_len: int, seq_len: int) -> float:
    """The base that dynamic ("NTK-aware") scaling uses for a ``seq_len``-token
    sequence.

    θ' = θ · (seq_len / train_len)^(R / (R − 2)) once ``seq_len`` exceeds ``train_len``:
    the same frequencies as ``rope_frequencies(..., RopeScaling("dynamic", factor=1))``
    with ``max_position_embeddings=train_len``. The fastest pair keeps its speed, the
    slowest turns ``seq_len / train_len`` times slower.
    """
    return dynamic_ntk_theta(theta, rotary_dim, 1.0, train_len, seq_len)


def same_weights(model: DecoderLM, **changes: object) -> DecoderLM:
    """A copy of ``model`` in eval mode with some config fields changed (e.g. a
    ``sliding_window``) and the same weights; the changes must not alter any shape."""
    copy = DecoderLM(model.cfg.replace(**changes)).to(next(model.parameters()).device)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def with_rope(
    model: DecoderLM, *, theta: float | None = None, scaling: RopeScaling | None = None
) -> DecoderLM:
    """A copy of a RoPE ``model`` (same weights, new tables) with base ``theta``
    (default: the model's) and ``rope_scaling`` ``scaling`` (None: plain RoPE)."""
    cfg = model.cfg
    if cfg.position != "rope":
        raise ValueError(f"with_rope needs a RoPE model, got position={cfg.position!r}")
    theta = cfg.rope_theta if theta is None else theta
    return same_weights(model, rope_theta=theta, rope_scaling=scaling)


def rope_scaling_for(
    method: str, cfg: ModelConfig, train_len: int, seq_len: int
) -> dict:
    """``with_rope`` arguments that stretch a RoPE model trained on ``train_len`` tokens
    to ``seq_len`` by ``method``, with factor s = seq_len / train_len:

    ``"none"`` leaves it alone; ``"linear"`` divides every frequency by s (position
    interpolation); ``"ntk"`` raises the base (:func:`ntk_theta`, what dynamic scaling
    does at ``seq_len``); ``"yarn"`` interpolates the pairs that turn less than once in
    ``train_len`` tokens, keeps the fast ones, ramps in between and sharpens the logits.
    """
    check_choice("method", method, SCALING_METHODS)
    factor = seq_len / train_len
    if method == "none" or factor <= 1:
        return {}
    if method == "linear":
        return {"scaling": RopeScaling("linear", factor=factor)}
    if method == "ntk":
        rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
        return {"theta": ntk_theta(cfg.rope_theta, rotary, train_len, seq_len)}
    return {
        "scaling": RopeScaling(
            "yarn", factor=factor, original_max_position_embeddings=train_len
        )
    }


def per_position_loss_scaled(
    model: DecoderLM,
    method: str,
    ids: Tensor,
    train_len: int,
    lengths: list[int],
    n_windows: int,
    *,
    batch_size: int = 16,
    seed: int = 0,
) -> Tensor:
    """Per-position loss ``(max(lengths),)`` of a RoPE model whose scaling follows the
    text's length, as dynamic scaling does: positions in ``[previous length, L)`` are
    scored by reading the first ``L`` tokens with :func:`rope_scaling_for` ``(method,
    ..., L)``; the first band ``[0, lengths[0])`` likewise. Every band reads the same
    windows of ``max(lengths)`` tokens, so ``method="none"`` gives
    :func:`per_position_loss` at that length. ``lengths`` must increase."""
    if any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ValueError(f"lengths must increase, got {lengths}")
    out = torch.empty(lengths[-1])
    start = 0
    for length in lengths:
        scaled = with_rope(
            model, **rope_scaling_for(method, model.cfg, train_len, length)
        )
        out[start:length] = per_position_loss(
            scaled,
            ids,
            length,
            n_windows,
            batch_size=batch_size,
            seed=seed,
            window_len=lengths[-1],
        )[start:length]
        start = length
    return out


@torch.no_grad()
def rope_used_per_layer(model: DecoderLM, input_ids: Tensor) -> list[str]:
    """Which RoPE table each layer's attention read in a forward pass on ``input_ids``:
    ``"global"``, ``"local"`` or ``"none"`` (recorded by hooks, not predicted)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    tables = model.rope_tables(positions)
    seen: list[str] = []

    def start(_module: torch.nn.Module, _args: tuple) -> None:
        seen.append("none")  # until the layer reads a table

    def record(
        _module: torch.nn.Module, _args: tuple, out: tuple[Tensor, Tensor]
    ) -> None:
        cos, sin = out
        seen[-1] = "other"
        for name, (want_cos, want_sin) in tables.items():
            if torch.equal(cos, want_cos) and torch.equal(sin, want_sin):
                seen[-1] = name
                return

    hooks, ropes = [], {}
    for block in model.blocks:
        hooks.append(block.attn.register_forward_pre_hook(start))
        rope = getattr(block.attn, "rope", None)
        if rope is not None:
            ropes[id(rope)] = rope  # layers share a table: one hook per module
    hooks += [rope.register_forward_hook(record) for rope in ropes.values()]
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen
