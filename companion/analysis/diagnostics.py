"""Measuring a Transformer from the inside: the residual stream, gradients, attention
logits and the operations a function runs (chapter 06, reused by later chapters).

Shape legend: B batch, T tokens, d model width, L blocks, H heads, D head width. Every
probe works on a model with a ``blocks`` list whose blocks take the stream ``x (B, T,
d)`` as their first argument and return it (``companion.models.decoder.DecoderLM``); the
measurements use forward hooks and leave the model unchanged.

- :func:`capture_stream`, :func:`stream_states`, :func:`residual_norms`: the stream
  before block 0 and after each block, ``L + 1`` states.
- :func:`block_grad_norms`: the gradient norm of each block's parameters for one batch.
- :func:`identity_path_jacobian`: ‖∂x_L/∂x_ℓ‖ and its trace per layer, from random
  probes.
- :class:`LayerTracker`: the base of the two trackers below, one number per layer and
  pass.
- :func:`attention_logit_max` and :class:`AttentionLogitTracker`: the largest
  ``|q·k|·scale`` of each layer, once or at every forward pass during training.
- :func:`token_cosine` and :class:`StreamTracker`: how alike the tokens' stream vectors
  are (1: collapsed), e.g. at every training step.
- :func:`residual_write_weights`: the matrices that write into the stream (to rescale
  them).
- :func:`companion.analysis.op_counts.count_aten_ops` /
  :func:`companion.analysis.op_counts.count_reductions`: what a function asks PyTorch to
  do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor, nn

from companion.training import lm_loss

__all__ = [
    "AttentionLogitTracker",
    "IdentityPath",
    "LayerTracker",
    "StreamTracker",
    "attention_logit_max",
    "block_grad_norms",
    "capture_stream",
    "identity_path_jacobian",
    "residual_norms",
    "residual_write_weights",
    "stream_states",
    "token_cosine",
]


def _blocks(model: nn.Module) -> Sequence[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ValueError("the model needs a non-empty `blocks` list (e.g. a DecoderLM)")
    return blocks


@contextmanager
def capture_stream(model: nn.Module) -> Iterator[list[Tensor]]:
    """Forward hooks that append the input of block 0 and the output of every block to
    the list this yields, for every forward pass run inside the ``with`` block."""
    blocks, states = _blocks(model), []
    handles = [
        blocks[0].register_forward_pre_hook(lambda m, args: states.append(args[0]))
    ]
    handles += [
        b.register_forward_hook(lambda m, args, out: states.append(out)) for b in blocks
    ]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def stream_states(
    model: nn.Module, input_ids: Tensor, **kwargs: object
) -> list[Tensor]:
    """The residual stream ``x_0 .. x_L``, each ``(B, T, d)``: the input of the first
    block (embeddings) and the output of every block, from one forward pass (no final
    norm)."""
    with capture_stream(model) as states:
        model(input_ids, **kwargs)
    if len(states) != len(_blocks(model)) + 1:
        raise RuntimeError(
            f"expected {len(_blocks(model)) + 1} stream states, got {len(states)}"
        )
    return [s.detach() for s in states]


def residual_norms(model: nn.Module, input_ids: Tensor, **kwargs: object) -> Tensor:
    """The Euclidean norm of every token's stream vector, ``(L + 1, B, T)``: row 0 is
    the input of block 0, row ℓ the output of block ℓ."""
    states = stream_states(model, input_ids, **kwargs)
    return torch.stack([s.float().norm(dim=-1) for s in states])


def block_grad_norms(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = lm_loss,
    suffix: str | None = None,
) -> Tensor:
    """The gradient norm of each block's parameters for one batch, ``(L,)``.

    ``suffix`` keeps only parameters whose name ends with it (e.g.
    ``"ffn.down.weight"``, the matrix Xiong et al. plot). The model's ``.grad`` fields
    are left cleared.
    """
    blocks = _blocks(model)
    model.zero_grad(set_to_none=True)
    loss_fn(model, x, y).backward()
    norms = []
    for block in blocks:
        grads = [
            p.grad.float().pow(2).sum()
            for name, p in block.named_parameters()
            if p.grad is not None and (suffix is None or name.endswith(suffix))
        ]
        if not grads:
            raise ValueError(f"no parameter with a gradient matches suffix {suffix!r}")
        norms.append(torch.stack(grads).sum().sqrt())
    model.zero_grad(set_to_none=True)
    return torch.stack(norms).detach()


class IdentityPath(NamedTuple):
    """What :func:`identity_path_jacobian` measures, one entry per block input (and
    x_L)."""

    # ‖J_ℓ‖_F / √n: how strongly x_L depends on x_ℓ at all
    norm: torch.Tensor
    # tr(J_ℓ) / n: how much of that is the identity (1 for x_L = x_ℓ + ...)
    trace: torch.Tensor


def _block_inputs_and_top(
    model: nn.Module, input_ids: Tensor
) -> tuple[list[Tensor], Tensor]:
    """One forward pass with autograd on, read by hooks: every block's input x_0 ..
    x_{L-1} and the last block's output x_L, still attached to the graph."""
    blocks, inputs, out = _blocks(model), [], []
    handles = [
        b.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        for b in blocks
    ]
    handles.append(blocks[-1].register_forward_hook(lambda m, args, o: out.append(o)))
    try:
        with torch.enable_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    if not out[0].requires_grad:
        raise ValueError("the stream does not require grad: are the parameters frozen?")
    return inputs, out[0]


def identity_path_jacobian(
    model: nn.Module,
    input_ids: Tensor,
    n_probes: int = 4,
    generator: torch.Generator | None = None,
) -> IdentityPath:
    """How the last block's output x_L depends on each block's input x_ℓ, ``(L + 1,)``
    each.

    J_ℓ = ∂x_L/∂x_ℓ is an n×n matrix (n = B·T·d), never built: ``n_probes`` Gaussian
    probes v give ‖J_ℓ‖²_F ≈ Σ‖J_ℓᵀv‖² and tr(J_ℓ) ≈ Σ vᵀJ_ℓᵀv (Hutchinson), both
    divided by Σ‖v‖² ≈ n·n_probes. A stack of identities gives 1 and 1; entry L is
    always exactly 1. The two differ when x_L depends on x_ℓ through the sublayers
    rather than straight through.
    """
    inputs, x_last = _block_inputs_and_top(model, input_ids)
    sq = torch.zeros(len(inputs) + 1)  # Σ ‖J_ℓᵀv‖² per ℓ; last entry: Σ ‖v‖²
    tr = torch.zeros(len(inputs) + 1)  # Σ vᵀJ_ℓᵀv per ℓ
    for _ in range(n_probes):
        v = torch.randn(x_last.shape, generator=generator).to(x_last)
        # one backward pass gives J_ℓᵀv for every ℓ at once
        jtv = torch.autograd.grad(x_last, inputs, v, retain_graph=True)
        sq[:-1] += torch.stack([g.float().pow(2).sum() for g in jtv]).cpu()
        tr[:-1] += torch.stack([(g.float() * v.float()).sum() for g in jtv]).cpu()
        sq[-1] += v.float().pow(2).sum().cpu()
    tr[-1] = sq[-1]  # J_L = I, so vᵀJ_Lᵀv = ‖v‖²
    return IdentityPath(norm=(sq / sq[-1]).sqrt(), trace=tr / sq[-1])


def _logit_max(attn: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """max ``|q·k|·scale`` over heads and the positions a query may see, for one
    attention call."""
    positions = args[1] if len(args) > 1 else kwargs.get("positions")
    q, k, _, mask, causal, *_ = attn.attention_inputs(
        args[0], positions, mask=kwargs.get("mask")
    )
    k = k.repeat_interleave(
        q.shape[1] // k.shape[1], dim=1
    )  # GQA: one key head per query head
    scale = attn.scale if attn.scale is not None else q.shape[-1] ** -0.5
    logits = (q.float() @ k.float().transpose(-2, -1)).abs() * scale  # (B, H, T, S)
    t, s = logits.shape[-2:]
    if causal:
        allowed = torch.ones(t, s, dtype=torch.bool, device=logits.device).tril(s - t)
        logits = logits.masked_fill(~allowed, 0.0)
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, 0.0)
    return logits.amax()


class LayerTracker:
    """Record one number per layer at every forward pass while active (a context
    manager).

    ``with tracker: train(...)``; afterwards ``tracker.history`` is ``(calls, L)``. A
    subclass says which module of each layer it watches and what it measures there
    (``_watch``), and calls ``_record`` once per layer and pass, in layer order.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self._rows: list[list[float]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _watch(
        self, index: int, module: nn.Module
    ) -> torch.utils.hooks.RemovableHandle:
        raise NotImplementedError

    def _record(self, index: int, value: float) -> None:
        if index == 0:
            self._rows.append([])
        self._rows[-1].append(value)

    def __enter__(self) -> LayerTracker:
        self._handles = [self._watch(i, m) for i, m in enumerate(self.modules)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def history(self) -> Tensor:
        """``(calls, L)``: the measure of each layer at each recorded forward pass."""
        return torch.tensor(self._rows).reshape(-1, len(self.modules))


class AttentionLogitTracker(LayerTracker):
    """Record every layer's largest attention logit at each forward pass while active.

    ``with AttentionLogitTracker(model) as t:`` around training; ``t.history`` is
    ``(calls, L)``. The logits are recomputed from each attention module's input
    (``attention_inputs``: projections, RoPE, mask), under ``no_grad``, so training is
    unchanged. Cached decoding is not supported.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__([b.attn for b in _blocks(model)])

    def _watch(
        self, index: int, module: nn.Module
    ) -> torch.utils.hooks.RemovableHandle:
        def hook(attn: nn.Module, args: tuple, kwargs: dict) -> None:
            if (args[2] if len(args) > 2 else kwargs.get("cache")) is not None:
                raise ValueError(
                    "AttentionLogitTracker does not support cached decoding"
                )
            with torch.no_grad():
                self._record(index, _logit_max(attn, args, kwargs).item())

        return module.register_forward_pre_hook(hook, with_kwargs=True)


def attention_logit_max(model: nn.Module, input_ids: Tensor) -> Tensor:
    """Each layer's largest ``|q·k|·scale`` over heads and visible positions,
    ``(L,)``."""
    with torch.no_grad(), AttentionLogitTracker(model) as tracker:
        model(input_ids)
    return tracker.history[-1]


def token_cosine(x: Tensor) -> float:
    """Mean cosine similarity between the token vectors of ``x (B, T, d)``, over all
    pairs of distinct tokens: 1 when every token carries the same direction (a collapsed
    stream)."""
    f = torch.nn.functional.normalize(
        x.detach().float().reshape(-1, x.shape[-1]), dim=-1
    )
    n = f.shape[0]
    if n < 2:
        raise ValueError("token_cosine needs at least two tokens")
    total = f.sum(dim=0).pow(2).sum()  # Σ_ij cos(f_i, f_j), self-pairs included
    return ((total - n) / (n * (n - 1))).item()


class StreamTracker(LayerTracker):
    """Record ``measure(x_ℓ)`` for the output of every block at every forward pass.

    ``with StreamTracker(model, token_cosine) as t: train(...)`` gives ``t.history``,
    ``(calls, L)``, at no extra forward cost (the hooks read the stream as it passes).
    """

    def __init__(self, model: nn.Module, measure: Callable[[Tensor], float]) -> None:
        super().__init__(_blocks(model))
        self.measure = measure

    def _watch(
        self, index: int, module: nn.Module
    ) -> torch.utils.hooks.RemovableHandle:
        return module.register_forward_hook(
            lambda _m, _args, out: self._record(index, self.measure(out))
        )


def residual_write_weights(model: nn.Module) -> list[nn.Parameter]:
    """The matrices that write into the residual stream: each block's attention output
    projection and FFN down projection (``attn.out_proj``, ``ffn.down``), in order."""
    return [
        p
        for block in _blocks(model)
        for name, p in block.named_parameters()
        if name in ("attn.out_proj.weight", "ffn.down.weight")
    ]
