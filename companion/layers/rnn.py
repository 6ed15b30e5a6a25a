"""Recurrent layers: a vanilla RNN, the LSTM and the GRU, one step at a time (chapter
01).

Shape legend: B batch, T time steps, E input width, H hidden width, V vocabulary. Every
layer maps ``x (B, T, E)`` and an optional ``state`` to ``(out (B, T, H), state)``,
where ``state`` is ``h (B, H)``, or ``(h, c)`` for the LSTM.

Each layer holds one PyTorch module (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``; one layer,
``batch_first``) and offers two forms over the *same* parameters, chosen by ``impl``:
``"reference"`` loops over time in Python with the cell equations written out
(:func:`rnn_cell`, :func:`lstm_cell`, :func:`gru_cell`), ``"torch"`` calls PyTorch's
fused kernel. The gate order follows PyTorch's packing of ``weight_ih_l0`` /
``weight_hh_l0``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from companion.checks import check_choice, check_int

__all__ = [
    "GRU",
    "IMPLS",
    "LSTM",
    "RNN",
    "RecurrentLM",
    "autograd_depth",
    "distant_recall",
    "gru_cell",
    "lstm_cell",
    "rnn_cell",
]

IMPLS = ("reference", "torch")
_KINDS = ("rnn", "lstm", "gru")


def _affine(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return x @ w.T if b is None else x @ w.T + b


def rnn_cell(
    x_t: Tensor,
    h: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> Tensor:
    """Elman's step: ``h' = tanh(W_ih x + b_ih + W_hh h + b_hh)``; x_t (B, E), h (B,
    H)."""
    return torch.tanh(_affine(x_t, w_ih, b_ih) + _affine(h, w_hh, b_hh))  # (B, H)


def lstm_cell(
    x_t: Tensor,
    h: Tensor,
    c: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One LSTM step; x_t (B, E), h and c (B, H); weights pack the gates as (i, f, g,
    o)."""
    gates = _affine(x_t, w_ih, b_ih) + _affine(h, w_hh, b_hh)  # (B, 4H)
    i, f, g, o = gates.chunk(4, dim=-1)  # (B, H) each
    i, f, o = (
        torch.sigmoid(i),
        torch.sigmoid(f),
        torch.sigmoid(o),
    )  # input, forget, output
    c = f * c + i * torch.tanh(g)  # the cell: keep a fraction f, write a fraction i
    h = o * torch.tanh(c)  # what the rest of the network sees
    return h, c


def gru_cell(
    x_t: Tensor,
    h: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> Tensor:
    """One GRU step; x_t (B, E), h (B, H); weights pack the gates as (r, z, n)."""
    xr, xz, xn = _affine(x_t, w_ih, b_ih).chunk(3, dim=-1)  # (B, H) each
    hr, hz, hn = _affine(h, w_hh, b_hh).chunk(3, dim=-1)
    r = torch.sigmoid(xr + hr)  # reset: how much of h the candidate may read
    z = torch.sigmoid(xz + hz)  # update: how much of h to keep
    n = torch.tanh(
        xn + r * hn
    )  # the candidate (b_hn sits inside r * (...), as in PyTorch)
    return (1 - z) * n + z * h


class _Recurrent(nn.Module):
    """Construction, parameter access and input checks shared by the three layers."""

    torch_cls: type[nn.RNNBase]

    def __init__(self, input_size: int, hidden_size: int, *, bias: bool = True) -> None:
        super().__init__()
        for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
            check_int(name, value, 1)
        self.input_size, self.hidden_size = input_size, hidden_size
        self.core = self.torch_cls(input_size, hidden_size, batch_first=True, bias=bias)

    def params(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(w_ih, w_hh, b_ih, b_hh)``, the tensors both forms use (biases None if
        absent)."""
        c = self.core
        return (
            c.weight_ih_l0,
            c.weight_hh_l0,
            getattr(c, "bias_ih_l0", None),
            getattr(c, "bias_hh_l0", None),
        )

    def forward(
        self, x: Tensor, state: Tensor | None = None, *, impl: str = "reference"
    ) -> tuple[Tensor, Tensor]:
        """``x (B, T, E)``, ``state h (B, H)`` -> ``(out (B, T, H), h (B, H))``, for a
        cell whose state is one tensor (the RNN's and the GRU's)."""
        h = self._zeros(x) if state is None else state
        self._check(x, (h,), impl)
        if impl == "torch":
            out, h_n = self.core(x, h[None])
            return out, h_n[0]
        outs = []
        for t in range(
            x.shape[1]
        ):  # step t cannot start before step t - 1 has finished
            h = self.cell(x[:, t], h, *self.params())
            outs.append(h)
        return torch.stack(outs, dim=1), h  # (B, T, H), (B, H)

    def _check(self, x: Tensor, states: tuple[Tensor, ...], impl: str) -> None:
        check_choice("impl", impl, IMPLS)
        if x.ndim != 3 or x.shape[-1] != self.input_size or x.shape[1] < 1:
            raise ValueError(
                f"x must have shape (B, T, {self.input_size}) with T >= 1, got {tuple(x.shape)}"
            )
        want = (x.shape[0], self.hidden_size)
        for s in states:
            if tuple(s.shape) != want:
                raise ValueError(
                    f"state tensors must have shape (B, H) = {want}, got {tuple(s.shape)}"
                )

    def _zeros(self, x: Tensor) -> Tensor:
        return x.new_zeros(x.shape[0], self.hidden_size)  # (B, H)


class RNN(_Recurrent):
    """Elman's recurrent network (Elman, 1990) with a tanh non-linearity."""

    torch_cls = nn.RNN
    cell = staticmethod(rnn_cell)


class LSTM(_Recurrent):
    """Long short-term memory (Hochreiter and Schmidhuber, 1997): a gated, additive cell
    state."""

    torch_cls = nn.LSTM

    def forward(
        self,
        x: Tensor,
        state: tuple[Tensor, Tensor] | None = None,
        *,
        impl: str = "reference",
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``x (B, T, E)``, ``state (h, c)`` each (B, H) -> ``(out (B, T, H), (h,
        c))``."""
        h, c = (self._zeros(x), self._zeros(x)) if state is None else state
        self._check(x, (h, c), impl)
        if impl == "torch":
            out, (h_n, c_n) = self.core(x, (h[None], c[None]))
            return out, (h_n[0], c_n[0])
        outs = []
        for t in range(
            x.shape[1]
        ):  # step t cannot start before step t - 1 has finished
            h, c = lstm_cell(x[:, t], h, c, *self.params())
            outs.append(h)
        return torch.stack(outs, dim=1), (h, c)  # (B, T, H), ((B, H), (B, H))


class GRU(_Recurrent):
    """Gated recurrent unit (Cho et al., 2014): two gates, no separate cell state."""

    torch_cls = nn.GRU
    cell = staticmethod(gru_cell)


_LAYERS: dict[str, type[_Recurrent]] = {"rnn": RNN, "lstm": LSTM, "gru": GRU}


class RecurrentLM(nn.Module):
    """Embedding -> one recurrent layer -> linear head: ``input_ids (B, T) -> logits (B,
    T, V)``.

    ``kind`` is ``"rnn"``, ``"lstm"`` or ``"gru"``; ``impl`` picks the form used by
    ``forward`` (it can be changed on the instance at any time).
    """

    def __init__(
        self,
        vocab_size: int,
        d_embed: int,
        hidden_size: int,
        *,
        kind: str = "lstm",
        impl: str = "reference",
    ) -> None:
        super().__init__()
        check_choice("kind", kind, _KINDS)
        check_choice("impl", impl, IMPLS)
        self.vocab_size, self.kind, self.impl = vocab_size, kind, impl
        self.tok_emb = nn.Embedding(vocab_size, d_embed)
        self.rnn = _LAYERS[kind](d_embed, hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)

    def num_params(self) -> int:
        """All parameters (nothing is tied)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be int token ids of shape (B, T), got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        out, _ = self.rnn(self.tok_emb(input_ids), impl=self.impl)  # (B, T, H)
        return self.head(out)  # (B, T, V)


def autograd_depth(output: Tensor) -> int:
    """The longest chain of recorded operations between ``output`` and any leaf.

    Operations on one chain must run one after another; everything else may run in
    parallel. Counts autograd nodes, so only forms built from small ops (the references)
    show their true chain; a fused kernel counts as one node.
    """
    if output.grad_fn is None:
        return 0
    depth: dict[object, int] = {}
    stack: list[tuple[object, bool]] = [(output.grad_fn, False)]
    while (
        stack
    ):  # iterative post-order walk: chains can be far deeper than Python's stack
        node, expanded = stack.pop()
        if node in depth:
            continue
        parents = [p for p, _ in node.next_functions if p is not None]  # type: ignore[attr-defined]
        if expanded:
            depth[node] = 1 + max((depth[p] for p in parents), default=0)
        else:
            stack.append((node, True))
            stack.extend((p, False) for p in parents if p not in depth)
    return depth[output.grad_fn]


def distant_recall(
    batch_size: int,
    length: int,
    n_signals: int,
    n_distractors: int,
    distance: int | Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One signal hidden among distractors; the last token asks which signal it was.

    Vocabulary: query ``0``, signals ``1 .. n_signals``, distractors after them. The
    signal sits ``distance`` steps before the query: an int, a ``(B,)`` tensor, or
    ``None`` for distances drawn log-uniformly from ``1 .. length - 1`` (each scale gets
    an equal share). Returns ``x (B, length)``, ``y (B, length)`` scored only at the
    last position (others ``-100``) and the distances ``(B,)``.
    """
    if length < 2 or n_signals < 1 or n_distractors < 1:
        raise ValueError(
            f"need length >= 2, n_signals >= 1, n_distractors >= 1; got length={length}, "
            f"n_signals={n_signals}, n_distractors={n_distractors}"
        )
    lo = 1 + n_signals
    x = torch.randint(lo, lo + n_distractors, (batch_size, length), generator=generator)
    if distance is None:
        u = torch.rand(batch_size, generator=generator) * math.log(length)
        dist = (
            u.exp().floor().long().clamp(1, length - 1)
        )  # log-uniform in [1, length - 1]
    else:
        dist = torch.as_tensor(distance, dtype=torch.long).expand(batch_size).clone()
    if dist.min() < 1 or dist.max() > length - 1:
        raise ValueError(
            f"distance must lie in [1, length - 1 = {length - 1}], got {distance}"
        )
    signal = torch.randint(1, lo, (batch_size,), generator=generator)
    rows = torch.arange(batch_size)
    x[rows, length - 1 - dist] = signal
    x[:, -1] = 0  # the query
    y = torch.full_like(x, -100)
    y[:, -1] = signal
    return x, y, dist
