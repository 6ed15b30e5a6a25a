"""The product task of chapter 07: targets, the hand-built GLU, training, surfaces."""

import pytest
import torch

from companion.layers.ffn import ACTIVATIONS, FeedForward, GatedFeedForward
from companion.tasks.products import (
    exact_product_glu,
    mse,
    product_surface,
    product_task,
    train_regression,
)

# the activations of the form z·F(z) with F(z) + F(−z) = 1 (squared ReLU is not: its
# odd part is z·|z|, tested in test_relu2.py)
X_TIMES_CDF = sorted(set(ACTIVATIONS) - {"relu2"})


@pytest.mark.parametrize("shift", [1, 3, -2], ids=lambda s: f"shift={s}")
def test_product_task_targets(shift):
    x, y = product_task(64, 7, shift, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 7)
    for k in range(7):
        torch.testing.assert_close(y[:, k], x[:, k] * x[:, (k - shift) % 7])


def test_product_task_has_unit_variance():
    _, y = product_task(20000, 8, generator=torch.Generator().manual_seed(0))
    assert abs(y.var().item() - 1) < 0.05 and abs(y.mean().item()) < 0.02


@pytest.mark.parametrize("bad", [dict(d=1), dict(shift=8), dict(batch_size=0)], ids=str)
def test_product_task_rejects_bad_arguments(bad):
    args = dict(batch_size=4, d=8, shift=1) | bad
    with pytest.raises(ValueError):
        product_task(**args)


@pytest.mark.parametrize("activation", X_TIMES_CDF)
def test_activation_is_odd_part_identity(activation):
    z = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    act = ACTIVATIONS[activation]
    torch.testing.assert_close(act(z) - act(-z), z, rtol=0, atol=1e-12)


@pytest.mark.parametrize("activation", X_TIMES_CDF)
@pytest.mark.parametrize("shift", [1, 5])
def test_exact_glu_computes_the_products(activation, shift):
    d = 6
    glu = exact_product_glu(d, shift, activation)
    x, y = product_task(128, d, shift, torch.Generator().manual_seed(1))
    assert mse(glu, x, y) < 1e-10
    assert sum(p.numel() for p in glu.parameters()) == 6 * d * d


def test_training_fits_glu_much_better_than_mlp():
    d, steps = 8, 300
    torch.manual_seed(0)
    mlp = FeedForward(d, 4 * d, "gelu", bias=False)
    glu = GatedFeedForward(
        d, 8 * d // 3, "silu", bias=False
    )  # 3·8·21 = 504 < 512 weights
    x, y = product_task(2048, d, generator=torch.Generator().manual_seed(9))
    seen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only adds waiting
    try:
        hists = [
            train_regression(
                model,
                d,
                steps,
                batch_size=128,
                generator=torch.Generator().manual_seed(1),
                on_step=lambda step, m: seen.append(step),
            )
            for model in (mlp, glu)
        ]
    finally:
        torch.set_num_threads(threads)
    assert all(len(h.loss) == steps and h.loss[-1] < h.loss[0] / 3 for h in hists)
    assert seen == list(range(steps + 1)) * 2
    assert mse(glu, x, y) < mse(mlp, x, y) / 3


def test_product_surface_matches_the_target_for_the_exact_glu():
    d, grid = 5, torch.linspace(-2, 2, 9)
    surf = product_surface(exact_product_glu(d, 2), d, grid, k=3, shift=2)
    assert surf.shape == (9, 9)
    torch.testing.assert_close(surf, grid[:, None] * grid[None, :], rtol=0, atol=1e-5)
    # columns follow x_k: a model whose output k is x_k itself varies along the columns only
    identity = product_surface(torch.nn.Identity(), d, grid, k=3, shift=2)
    torch.testing.assert_close(identity, grid.expand(9, 9))
