"""Manifold-constrained hyper-connections (mHC): n residual streams in place of one
(DeepSeek-V4).

Shape legend: B batch, T tokens, n streams (``hc_mult``), d model width; the streams
``(B, T, n, d)``, a sublayer's input and output ``(B, T, d)``; ``pre``, ``post``
``(B, T, n)``, ``comb`` ``(B, T, n, n)``.

Around each sublayer f (attention, FFN) every token carries n streams x_1..x_n. Its
streams, flattened and RMS-normalised, go through one linear map ``fn`` (+ ``base``,
times ``scale``) to three sets of coefficients:

- ``pre_j = σ(·) + ε`` collapse the streams into f's input: h = Σ_j pre_j·x_j;
- ``post_k = 2σ(·)`` spread f's output back onto the streams;
- ``comb`` mixes the streams: x'_k = post_k·f(norm(h)) + Σ_j comb_jk·x_j. ``comb`` is
  the softmax of its logits pushed onto the doubly stochastic matrices (every row and
  column sums to 1) by Sinkhorn iterations (:func:`sinkhorn`), so the mixing averages
  the streams and can neither grow nor shrink their sum.

The embedding enters as n copies (:func:`expand_streams`); :class:`HyperHead` collapses
the streams before the final norm. :class:`HyperConnection` is a block's residual rule
at one sublayer (:class:`companion.layers.block.TransformerBlock`, ``residuals``).
Forms, one signature each: :func:`sinkhorn_reference` (loops over rows and columns) and
:func:`sinkhorn`; :func:`collapse_streams_reference` / :func:`collapse_streams` and
:func:`hyper_step_reference` / :func:`hyper_step` (loops over streams, or batched).
Parameters carry transformers' names: ``fn ((2+n)·n, n·d)``, ``base ((2+n)·n,)``,
``scale (3,)``; the head's ``hc_fn (n, n·d)``, ``hc_base (n,)``, ``hc_scale (1,)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_choice, check_int, check_number

__all__ = [
    "HYPER_IMPLS",
    "HyperConnection",
    "HyperHead",
    "collapse_streams",
    "collapse_streams_reference",
    "expand_streams",
    "hyper_step",
    "hyper_step_reference",
    "sinkhorn",
    "sinkhorn_reference",
]


def expand_streams(x: Tensor, n_streams: int) -> Tensor:
    """The embeddings ``x (B, T, d)`` as n identical streams ``(B, T, n, d)``."""
    return x.unsqueeze(2).expand(-1, -1, n_streams, -1).contiguous()


def sinkhorn_reference(logits: Tensor, iters: int, eps: float = 1e-6) -> Tensor:
    """``logits (..., n, n)`` -> a nearly doubly stochastic ``(..., n, n)``, in fp32.

    Softmax over each row (+ ``eps``), then ``iters`` times: divide every column by its
    sum (+ ``eps``), and between two column passes every row by its sum. One row and one
    column at a time.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 if given
    m = logits.to(dtype).softmax(-1) + eps  # (..., n, n): rows sum to 1 + n·eps
    n = m.shape[-1]
    assert m.shape[-2] == n, "the mixing matrix is square"

    def columns(m: Tensor) -> Tensor:
        cols = [
            m[..., :, j] / (m[..., :, j].sum(-1, keepdim=True) + eps) for j in range(n)
        ]
        return torch.stack(cols, dim=-1)

    def rows(m: Tensor) -> Tensor:
        rws = [
            m[..., i, :] / (m[..., i, :].sum(-1, keepdim=True) + eps) for i in range(n)
        ]
        return torch.stack(rws, dim=-2)

    m = columns(m)
    for _ in range(iters - 1):
        m = columns(rows(m))
    return m


def sinkhorn(logits: Tensor, iters: int, eps: float = 1e-6) -> Tensor:
    """:func:`sinkhorn_reference`, every row (column) of every matrix at once."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    m = logits.to(dtype).softmax(-1) + eps  # (..., n, n)
    m = m / (m.sum(-2, keepdim=True) + eps)  # columns
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)  # rows
        m = m / (m.sum(-2, keepdim=True) + eps)  # columns
    return m


def collapse_streams_reference(streams: Tensor, pre: Tensor) -> Tensor:
    """Σ_j pre_j·x_j: ``streams (B, T, n, d)``, ``pre (B, T, n)`` -> ``(B, T, d)``, one
    stream at a time in fp32, returned in the streams' dtype."""
    n = streams.shape[2]
    assert pre.shape == streams.shape[:3]
    h = sum(pre[..., j, None].float() * streams[..., j, :].float() for j in range(n))
    return h.to(streams.dtype)  # (B, T, d)


def collapse_streams(streams: Tensor, pre: Tensor) -> Tensor:
    """:func:`collapse_streams_reference`, all streams in one product and sum."""
    return (pre.unsqueeze(-1) * streams).sum(2).to(streams.dtype)  # (B, T, d)


def hyper_step_reference(
    streams: Tensor,
    pre: Tensor,
    post: Tensor,
    comb: Tensor,
    branch: Callable[[Tensor], Tensor],
) -> Tensor:
    """One sublayer inside its hyper-connection, a loop over streams, in fp32.

    ``streams (B, T, n, d)``; ``branch`` maps the collapsed ``(B, T, d)`` to the
    sublayer's output ``(B, T, d)``. Returns x'_k = post_k·branch(Σ_j pre_j·x_j) + Σ_j
    comb_jk·x_j, ``(B, T, n, d)`` in the streams' dtype.
    """
    b, t, n, d = streams.shape
    assert post.shape == (b, t, n) and comb.shape == (b, t, n, n)
    out = branch(collapse_streams_reference(streams, pre)).float()  # (B, T, d)
    assert out.shape == (b, t, d)
    x = streams.float()
    new = []
    for k in range(n):
        mixed = sum(comb[..., j, k, None].float() * x[..., j, :] for j in range(n))
        new.append(post[..., k, None].float() * out + mixed)  # (B, T, d)
    return torch.stack(new, dim=2).to(streams.dtype)  # (B, T, n, d)


def hyper_step(
    streams: Tensor,
    pre: Tensor,
    post: Tensor,
    comb: Tensor,
    branch: Callable[[Tensor], Tensor],
) -> Tensor:
    """:func:`hyper_step_reference`, batched: the mixing is one matmul ``combᵀ @ x``,
    in the streams' dtype."""
    dtype = streams.dtype
    out = branch(collapse_streams(streams, pre))  # (B, T, d)
    expanded = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)  # (B, T, n, d)
    return expanded + comb.to(dtype).transpose(-1, -2) @ streams  # (B, T, n, d)


# the forms, by the name a module's ``impl`` gives: (collapse, step)
HYPER_FORMS = {
    "reference": (collapse_streams_reference, hyper_step_reference),
    "batched": (collapse_streams, hyper_step),
}
HYPER_IMPLS = tuple(HYPER_FORMS)


def _check_streams(streams: Tensor, n: int, d: int) -> None:
    if streams.dim() != 4 or tuple(streams.shape[2:]) != (n, d):
        raise ValueError(
            f"streams must have shape (B, T, n_streams={n}, d_model={d}), got "
            f"{tuple(streams.shape)}: expand the embeddings with expand_streams"
        )


def _check_sizes(d_model: int, n_streams: int, eps: float, norm_eps: float) -> None:
    check_int("d_model", d_model, 1)
    check_int("n_streams", n_streams, 1)
    check_number("eps", eps)
    check_number("norm_eps", norm_eps)


class HyperConnection(nn.Module):
    """A block's residual rule at one sublayer: collapse n streams, run the sublayer,
    expand and mix.

    Called like :meth:`companion.layers.block.TransformerBlock.residual`: ``(streams,
    norm, out_norm, sublayer)``; ``norm`` reads the collapsed input, ``out_norm`` (if
    any) the sublayer's output. ``eps`` is transformers' ``hc_eps``, ``norm_eps`` its
    ``rms_norm_eps`` (the RMS norm of the flattened streams). The coefficients are
    computed in fp32.
    """

    def __init__(
        self,
        d_model: int,
        n_streams: int,
        *,
        sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        impl: str = "batched",
    ) -> None:
        super().__init__()
        _check_sizes(d_model, n_streams, eps, norm_eps)
        check_int("sinkhorn_iters", sinkhorn_iters, 1)
        check_choice("impl", impl, HYPER_IMPLS)
        self.d_model, self.n_streams, self.sinkhorn_iters = (
            d_model,
            n_streams,
            sinkhorn_iters,
        )
        self.eps, self.norm_eps, self.init_std, self.impl = (
            eps,
            norm_eps,
            init_std,
            impl,
        )
        n = n_streams
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * d_model))  # pre, post, comb
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))  # one per coefficient set
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' start: ``fn`` N(0, ``init_std``), ``base`` 0, ``scale`` 1."""
        nn.init.normal_(self.fn, std=self.init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def coefficients(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``streams (B, T, n, d)`` -> ``pre (B, T, n)``, ``post (B, T, n)``, ``comb (B, T,
        n, n)``, in fp32."""
        _check_streams(streams, self.n_streams, self.d_model)
        n = self.n_streams
        flat = streams.flatten(2).float()  # (B, T, n·d)
        flat = F.rms_norm(flat, flat.shape[-1:], eps=self.norm_eps)
        mixes = F.linear(flat, self.fn.float())  # (B, T, (2+n)·n)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps  # (B, T, n)
        post = 2 * torch.sigmoid(post_w * post_s + post_b)  # (B, T, n)
        comb_logits = (comb_w * comb_s + comb_b).unflatten(-1, (n, n))  # (B, T, n, n)
        comb = sinkhorn(comb_logits, self.sinkhorn_iters, self.eps)
        return pre, post, comb

    def forward(
        self,
        streams: Tensor,
        norm: nn.Module | None,
        out_norm: nn.Module | None,
        sublayer: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """``streams (B, T, n, d)`` -> ``(B, T, n, d)`` after the sublayer."""
        check_choice("impl", self.impl, HYPER_IMPLS)
        pre, post, comb = self.coefficients(streams)

        def branch(h: Tensor) -> Tensor:  # (B, T, d) -> (B, T, d)
            h = sublayer(norm(h) if norm is not None else h)
            return out_norm(h) if out_norm is not None else h

        return HYPER_FORMS[self.impl][1](streams, pre, post, comb, branch)


class HyperHead(nn.Module):
    """The streams' last collapse, before the model's final norm: ``(B, T, n, d)`` ->
    ``(B, T, d)``, weights σ(·) + ``eps`` from the RMS-normalised flattened streams."""

    def __init__(
        self,
        d_model: int,
        n_streams: int,
        *,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        impl: str = "batched",
    ) -> None:
        super().__init__()
        _check_sizes(d_model, n_streams, eps, norm_eps)
        check_choice("impl", impl, HYPER_IMPLS)
        self.d_model, self.n_streams = d_model, n_streams
        self.eps, self.norm_eps, self.init_std, self.impl = (
            eps,
            norm_eps,
            init_std,
            impl,
        )
        self.hc_fn = nn.Parameter(torch.empty(n_streams, n_streams * d_model))
        self.hc_base = nn.Parameter(torch.empty(n_streams))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' start: ``hc_fn`` N(0, ``init_std``), ``hc_base`` 0, ``hc_scale``
        1."""
        nn.init.normal_(self.hc_fn, std=self.init_std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, streams: Tensor) -> Tensor:
        _check_streams(streams, self.n_streams, self.d_model)
        check_choice("impl", self.impl, HYPER_IMPLS)
        flat = streams.flatten(2).float()  # (B, T, n·d)
        flat = F.rms_norm(flat, flat.shape[-1:], eps=self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())  # (B, T, n)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float())
        return HYPER_FORMS[self.impl][0](streams, pre + self.eps)  # (B, T, d)
