"""Associative recall without training: write key→value pairs into a memory, read them
back (chapter 11).

Shape legend: N pairs, D_k key width, D_v value width. Keys and values are random unit
vectors. A *rule* says how the pairs are stored and read with the key itself as the
query:

* ``"linear"``: linear attention's state ``S = Σ k_i v_iᵀ`` (a fixed ``D_k×D_v``
  matrix), read as ``Sᵀ k``;
* ``"delta"``: the delta rule with ``β = 1``, pairs written in order, read as ``Sᵀ k``;
* ``"softmax"``: softmax attention over all N cached pairs, ``softmax(τ K k) V`` with
  ``τ = √D_k`` by default (what unit keys scaled to norm ``D_k^{1/4}`` give under the
  usual ``1/√D_k``; a sharper τ makes the read sharper).

States are written with :mod:`companion.ops.linear_attention`'s chunked forms, in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_choice, check_int
from companion.ops.delta_rule import chunk_delta_rule
from companion.ops.linear_attention import chunk_linear_attention

__all__ = ["RULES", "recall_pairs", "recall_read", "recall_scores"]

RULES = ("linear", "delta", "softmax")


def recall_pairs(
    n_pairs: int, key_dim: int, value_dim: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """``N`` random unit keys ``(N, D_k)`` and unit values ``(N, D_v)``, fp64."""
    for name, x in (
        ("n_pairs", n_pairs),
        ("key_dim", key_dim),
        ("value_dim", value_dim),
    ):
        check_int(name, x, 1)
    keys = torch.randn(n_pairs, key_dim, generator=generator, dtype=torch.float64)
    values = torch.randn(n_pairs, value_dim, generator=generator, dtype=torch.float64)
    return F.normalize(keys, dim=-1), F.normalize(values, dim=-1)


def recall_read(
    keys: Tensor, values: Tensor, rule: str, softmax_scale: float | None = None
) -> Tensor:
    """Store all pairs with ``rule``, then query every key: the values read back ``(N,
    D_v)``."""
    check_choice("rule", rule, RULES)
    if keys.ndim != 2 or values.ndim != 2 or keys.shape[0] != values.shape[0]:
        raise ValueError(
            f"keys (N, D_k) and values (N, D_v) must share N, got {tuple(keys.shape)}, "
            f"{tuple(values.shape)}"
        )
    if rule == "softmax":
        tau = keys.shape[1] ** 0.5 if softmax_scale is None else softmax_scale
        return torch.softmax(tau * keys @ keys.T, dim=-1) @ values  # (N, D_v)
    k, v = (
        keys[None, :, None],
        values[None, :, None],
    )  # (1, N, 1, D): one sequence, one head
    if rule == "linear":
        _, state = chunk_linear_attention(k, k, v, None, True)
    else:
        beta = torch.ones(1, keys.shape[0], 1, dtype=keys.dtype)
        _, state = chunk_delta_rule(k, k, v, beta, None, True)
    return keys @ state[0, 0]  # (N, D_v)


def recall_scores(keys: Tensor, values: Tensor, read: Tensor) -> tuple[Tensor, Tensor]:
    """Per pair: ``correct (N,)`` bool, the nearest stored value is the right one, and
    the read error ``‖read − v‖ (N,)`` (the values have unit norm, so 1 is as large as
    the value)."""
    correct = (read @ values.T).argmax(dim=-1) == torch.arange(len(values))
    return correct, (read - values).norm(dim=-1)
