"""In-context linear regression (chapter 02): the prompts, the gradient step, the
linear attention layer and the hand-set weights, against direct computations."""

import pytest
import torch

from companion.tasks.icl_regression import (
    LinearSelfAttention,
    best_gd_lr,
    effective_step,
    gd_construction,
    gd_step_prediction,
    least_squares_prediction,
    regression_prompts,
    train_icl_layer,
)


def _prompts(batch=64, n=12, d=5, seed=0):
    return regression_prompts(batch, n, d, torch.Generator().manual_seed(seed))


def test_prompts_hold_one_linear_task_each_and_hide_the_query_label():
    tokens, targets = _prompts()
    assert tokens.shape == (64, 13, 6) and targets.shape == (64,)
    assert torch.all(tokens[:, -1, -1] == 0)
    # examples and query share one w per prompt: solve it from the first 5 examples
    x, y = tokens[:, :5, :-1], tokens[:, :5, -1]
    w = torch.linalg.solve(x, y[..., None])[..., 0]  # (B, d)
    assert torch.allclose(torch.einsum("bnd,bd->bn", tokens[:, 5:-1, :-1], w),
                          tokens[:, 5:-1, -1], atol=1e-3)
    assert torch.allclose((tokens[:, -1, :-1] * w).sum(-1), targets, atol=1e-3)
    # the tasks differ from prompt to prompt
    assert w.std(0).min() > 0.5


def test_prompts_reject_empty_sizes():
    with pytest.raises(ValueError):
        regression_prompts(4, 0, 3)


def test_gd_step_matches_autograd_on_the_prompt_loss():
    tokens, _ = _prompts()
    lr = 0.37
    expected = []
    for prompt in tokens:
        x, y, x_q = prompt[:-1, :-1], prompt[:-1, -1], prompt[-1, :-1]
        w = torch.zeros(x.shape[1], requires_grad=True)
        loss = 0.5 * (x @ w - y).square().mean()
        (grad,) = torch.autograd.grad(loss, w)
        expected.append((w - lr * grad) @ x_q)
    assert torch.allclose(gd_step_prediction(tokens, lr), torch.stack(expected),
                          atol=1e-5)


def test_best_gd_lr_minimises_the_squared_error_and_is_near_its_formula():
    tokens, targets = regression_prompts(16384, 16, 8, torch.Generator().manual_seed(1))
    eta = best_gd_lr(tokens, targets)

    def err(lr):
        return (gd_step_prediction(tokens, lr) - targets).square().mean().item()

    assert err(eta) < min(err(0.98 * eta), err(1.02 * eta))
    # for x ~ N(0, I): E[g y] / E[g²] = N / (N + d + 1) (a Wishart second moment)
    assert abs(eta / (16 / 25) - 1) < 0.05


def test_least_squares_recovers_a_determined_task_and_is_min_norm_otherwise():
    tokens, targets = _prompts(n=12, d=5)
    assert torch.allclose(least_squares_prediction(tokens), targets, atol=1e-3)
    tokens, _ = _prompts(n=3, d=5)
    x, y, x_q = tokens[0, :-1, :-1], tokens[0, :-1, -1], tokens[0, -1, :-1]
    w = x.T @ torch.linalg.solve(x @ x.T, y)  # the min-norm solution
    assert torch.allclose(least_squares_prediction(tokens)[0], w @ x_q, atol=1e-4)


def test_linear_attention_layer_by_loop():
    torch.manual_seed(0)
    layer = LinearSelfAttention(5, init_std=0.5)
    tokens, _ = _prompts(batch=4)
    out = layer(tokens)
    for b in range(4):
        e = tokens[b]
        q = e[-1] @ layer.w_q
        update = torch.zeros(6)
        for i in range(e.shape[0] - 1):  # the query reads the examples only
            update += (q @ (e[i] @ layer.w_k)) * (e[i] @ layer.w_v)
        update /= e.shape[0] - 1
        assert torch.allclose(out[b], e[-1, -1] + update[-1], atol=1e-5)


def test_the_construction_computes_the_gd_step_exactly():
    tokens, _ = _prompts()
    for lr in (0.1, 0.64, 2.0):
        layer = gd_construction(5, lr)
        with torch.no_grad():
            assert torch.allclose(layer(tokens), gd_step_prediction(tokens, lr),
                                  atol=1e-5)
        assert torch.allclose(effective_step(layer), lr * torch.eye(5))


def test_effective_step_is_the_gd_shaped_part_of_any_layer():
    torch.manual_seed(1)
    layer = LinearSelfAttention(5, init_std=0.5)
    with torch.no_grad():
        layer.w_v[:5, 5] = 0  # the label's coordinate of the value reads y only
        layer.w_k[5, :] = 0  # the key reads x only
    tokens, _ = _prompts()
    x, y, x_q = tokens[:, :-1, :-1], tokens[:, :-1, -1], tokens[:, -1, :-1]
    gamma = effective_step(layer)
    expected = torch.einsum("bd,de,bne,bn->b", x_q, gamma, x, y) / x.shape[1]
    with torch.no_grad():
        assert torch.allclose(layer(tokens), expected, atol=1e-4)


def test_training_finds_the_gd_step():
    torch.manual_seed(0)
    layer = LinearSelfAttention(4)
    losses = train_icl_layer(layer, 400, batch=128, n_examples=8, lr=2e-2,
                             generator=torch.Generator().manual_seed(0))
    assert len(losses) == 400 and sum(losses[-20:]) < 0.7 * sum(losses[:20])
    fit, fit_y = regression_prompts(8192, 8, 4, torch.Generator().manual_seed(2))
    tokens, _ = regression_prompts(2048, 8, 4, torch.Generator().manual_seed(3))
    gd = gd_step_prediction(tokens, best_gd_lr(fit, fit_y))
    with torch.no_grad():
        gap = (layer(tokens) - gd).square().mean() / gd.var()
    assert gap < 0.02
