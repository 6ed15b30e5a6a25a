"""Causal dilated convolution stacks (chapter 01): an explicit sum over taps, exact
dependence sets measured by input gradients, and the bad inputs."""

from __future__ import annotations

import itertools

import pytest
import torch

from companion.layers.conv import CausalConvStack, dilations


def reference_stack(stack: CausalConvStack, x: torch.Tensor) -> torch.Tensor:
    """Each layer written as a sum over its k taps: tap j of a layer with dilation δ
    reads position t − (k − 1 − j)·δ, and a position before 0 reads zero."""
    h = x  # (B, T, C)
    k, t_len = stack.kernel_size, x.shape[1]
    for conv, delta in zip(stack.convs, stack.dilations, strict=True):
        pre = conv.bias.expand(x.shape[0], t_len, -1).clone()
        for j in range(k):
            shift = (k - 1 - j) * delta
            if shift >= t_len:
                continue
            past = torch.zeros_like(h)
            past[:, shift:] = h[:, : t_len - shift]  # past[:, t] = h[:, t - shift]
            pre = pre + past @ conv.weight[:, :, j].T
        h = h + torch.tanh(pre)
    return h


def reachable(k: int, dils: list[int]) -> set[int]:
    """Offsets n such that some choice of one tap per layer sums to n."""
    return {
        sum(j * d for j, d in zip(taps, dils, strict=True))
        for taps in itertools.product(range(k), repeat=len(dils))
    }


CASES = [  # (kernel, layers, base): dilated, undilated, base unlike the kernel
    (2, 4, None),
    (3, 3, None),
    (3, 4, 1),
    (2, 3, 3),
    (4, 2, None),
]


@pytest.mark.parametrize(("k", "n_layers", "base"), CASES)
def test_stack_matches_the_sum_over_taps(k, n_layers, base):
    torch.manual_seed(0)
    stack = CausalConvStack(5, k, n_layers, dilation_base=base).double()
    x = torch.randn(2, 40, 5, dtype=torch.float64)
    assert torch.allclose(stack(x), reference_stack(stack, x), atol=1e-12)


@pytest.mark.parametrize(("k", "n_layers", "base"), CASES)
def test_output_depends_exactly_on_the_reachable_past(k, n_layers, base):
    torch.manual_seed(1)
    stack = CausalConvStack(4, k, n_layers, dilation_base=base).double()
    t_len, t = 50, 35
    x = torch.randn(1, t_len, 4, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(stack(x)[0, t].sum(), x)
    read = {t - s for s in range(t_len) if (g[0, s] != 0).any()}
    b = k if base is None else base
    want = reachable(k, [b**layer for layer in range(n_layers)])
    assert read == want  # every reachable offset, nothing else, nothing in the future
    assert max(want) + 1 == stack.receptive_field


def test_dilations_grow_geometrically():
    assert dilations(4, 3) == [1, 3, 9, 27]
    assert dilations(3, 1) == [1, 1, 1]
    assert CausalConvStack(2, 2, 3).dilations == [1, 2, 4]  # default base: the kernel


def test_dilated_stack_reaches_every_offset_below_k_to_the_L():
    for k, n_layers in ((2, 5), (3, 3), (5, 2)):
        dils = [k**layer for layer in range(n_layers)]
        assert reachable(k, dils) == set(range(k**n_layers))


def test_hidden_states_are_the_layers_in_turn():
    torch.manual_seed(2)
    stack = CausalConvStack(3, 2, 3)
    x = torch.randn(2, 9, 3)
    states = stack.hidden_states(x)
    assert len(states) == 3 and all(s.shape == x.shape for s in states)
    assert torch.equal(states[-1], stack(x))
    assert torch.allclose(
        states[1], stack.layer(states[0].transpose(1, 2), 1).transpose(1, 2)
    )


def test_a_later_input_never_changes_an_earlier_output():
    torch.manual_seed(3)
    stack = CausalConvStack(3, 3, 3)
    x = torch.randn(1, 30, 3)
    y = x.clone()
    y[:, 20:] = torch.randn(1, 10, 3)
    assert torch.equal(stack(x)[:, :20], stack(y)[:, :20])
    assert not torch.equal(stack(x)[:, 20:], stack(y)[:, 20:])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"channels": 0}, "channels"),
        ({"kernel_size": 0}, "kernel_size"),
        ({"n_layers": 0}, "n_layers"),
        ({"dilation_base": 0}, "dilation_base"),
        ({"kernel_size": 2.0}, "kernel_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    args = {"channels": 4, "kernel_size": 3, "n_layers": 2} | kwargs
    with pytest.raises(ValueError, match=name):
        CausalConvStack(**args)


@pytest.mark.parametrize("shape", [(2, 7, 5), (7, 4), (2, 0, 4)])
def test_bad_input_shape_is_named(shape):
    with pytest.raises(ValueError, match=r"^x must have shape \(B, T, 4\)"):
        CausalConvStack(4, 3, 2)(torch.zeros(shape))
