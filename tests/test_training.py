"""Schedules, label smoothing, AdamW groups, the training loop, progress silencing."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.training import (
    cosine_lr,
    evaluate,
    inverse_sqrt_lr,
    label_smoothed_cross_entropy,
    lm_loss,
    make_adamw,
    portable_adam,
    progress,
    seed_everything,
    train,
)


def test_inverse_sqrt_schedule_peaks_at_warmup():
    lrs = [inverse_sqrt_lr(s, 512, 4000) for s in range(20000)]
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    assert peak == 3999
    assert lrs[peak] == pytest.approx(512**-0.5 * 4000**-0.5)
    assert lrs[15999] == pytest.approx(
        lrs[3999] / 2
    )  # 1/sqrt decay: 4x the steps, half the lr


def test_cosine_schedule_endpoints():
    assert cosine_lr(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert cosine_lr(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert cosine_lr(100, 1.0, 10, 100, min_lr=0.1) == pytest.approx(0.1)
    assert cosine_lr(55, 1.0, 10, 100) == pytest.approx(0.5)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_torch_with_rescaled_eps(eps):
    torch.manual_seed(0)
    v = 13
    logits, tgt = torch.randn(20, v), torch.randint(0, v, (20,))
    tgt[3] = -100
    ours = label_smoothed_cross_entropy(logits, tgt, eps)
    # torch spreads eps over all V classes; ours over the V - 1 wrong ones (the 2017 paper's).
    theirs = F.cross_entropy(
        logits, tgt, label_smoothing=eps * v / (v - 1), ignore_index=-100
    )
    torch.testing.assert_close(ours, theirs)


def test_label_smoothing_rejects_bad_eps():
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\)"):
        label_smoothed_cross_entropy(
            torch.randn(2, 3), torch.zeros(2, dtype=torch.long), 1.0
        )


def test_adamw_decays_matrices_only():
    model = DecoderLM(ModelConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1))
    opt = make_adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert (
        all(p.ndim < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    )


def test_fused_adamw_steps_like_the_per_tensor_reference():
    """make_adamw's fused kernel (portable digits) against torch's per-tensor loop.

    A small MLP, not a Transformer: attention's key bias has a gradient of pure
    rounding noise (softmax ignores it), which Adam normalises into steps of full size
    that differ between any two kernels."""
    torch.manual_seed(0)
    fused = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    ref = copy.deepcopy(fused)
    start = [p.detach().clone() for p in fused.parameters()]
    opt = make_adamw(fused, lr=1e-2, weight_decay=0.1)
    assert all(g["fused"] for g in opt.param_groups)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [p for p in ref.parameters() if p.ndim >= 2]},
            {
                "params": [p for p in ref.parameters() if p.ndim < 2],
                "weight_decay": 0.0,
            },
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        foreach=False,
    )
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for _ in range(5):
        for m, o in ((fused, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for a, b, a0 in zip(fused.parameters(), ref.parameters(), start, strict=True):
        assert (a - a0).abs().max() > 1e-2  # five steps of lr 1e-2 moved every tensor
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_portable_adam_only_fuses_where_a_kernel_exists():
    assert portable_adam([torch.zeros(2)]) == {"fused": True}
    assert portable_adam([torch.zeros(2, device="meta")]) == {}
    assert portable_adam([]) == {}


def test_training_reduces_loss_and_is_seeded():
    def run() -> list[float]:
        gen = seed_everything(0)
        model = DecoderLM(
            ModelConfig(vocab_size=8, d_model=32, n_heads=2, n_layers=1, max_seq_len=16)
        )
        data = torch.arange(8).repeat(40)  # a periodic sequence: easy to learn

        def batch(_: int):
            start = torch.randint(0, len(data) - 17, (8,), generator=gen)
            idx = start[:, None] + torch.arange(16)
            return data[idx], data[idx + 1]

        opt = make_adamw(model, lr=3e-3)
        hist = train(
            model,
            batch,
            60,
            opt,
            lr_at=lambda s: cosine_lr(s, 3e-3, 5, 60),
            eval_fn=lambda: evaluate(model, [batch(0)]),
            eval_every=20,
        )
        assert hist.eval_step == [19, 39, 59]
        return hist.loss

    a, b = run(), run()
    assert a == b
    assert a[-1] < 0.5 * a[0]


def test_nonfinite_loss_raises():
    model = DecoderLM(ModelConfig(vocab_size=8, d_model=16, n_heads=2, n_layers=1))
    x = torch.zeros(1, 4, dtype=torch.long)

    def nan_loss(m, a, b):
        return lm_loss(m, a, b) * float("nan")

    with pytest.raises(FloatingPointError, match="loss became nan at step 0"):
        train(model, lambda s: (x, x), 3, make_adamw(model, 1e-3), loss_fn=nan_loss)


def test_evaluate_needs_batches():
    with pytest.raises(ValueError, match="no batches"):
        evaluate(torch.nn.Identity(), [])


def test_progress_is_silenced_by_env(monkeypatch, capsys):
    monkeypatch.setenv("COMPANION_PROGRESS", "0")
    assert list(progress(range(3), desc="x")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def _tiny() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def _train(**changes):
    model = _tiny()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    kwargs = dict(
        model=model,
        get_batch=lambda s: (x, y),
        steps=2,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, a, b: F.mse_loss(m(a), b),
    )
    return train(**{**kwargs, **changes})


@pytest.mark.parametrize(
    ("call", "error", "names"),
    [
        (lambda: seed_everything(-1), ValueError, "seed"),
        (lambda: seed_everything(2**32), ValueError, "seed"),
        (lambda: seed_everything("abc"), ValueError, "seed"),
        (lambda: seed_everything(1.5), ValueError, "seed"),
        (lambda: seed_everything(True), ValueError, "seed"),
        (lambda: inverse_sqrt_lr(0, 64, 0), ValueError, "warmup"),
        (lambda: inverse_sqrt_lr(-1, 64, 10), ValueError, "step"),
        (lambda: inverse_sqrt_lr(0, 0, 10), ValueError, "d_model"),
        (lambda: cosine_lr(0, 1.0, -1, 10), ValueError, "warmup"),
        (lambda: cosine_lr(0, 1.0, 2.5, 10), ValueError, "warmup"),
        (lambda: cosine_lr(0, -1.0, 1, 10), ValueError, "max_lr"),
        (lambda: cosine_lr(0, float("nan"), 1, 10), ValueError, "max_lr"),
        (lambda: cosine_lr(0, 1.0, 1, 10, min_lr=-0.1), ValueError, "min_lr"),
        (lambda: cosine_lr(0, 1.0, 1, -5), ValueError, "total"),
        (lambda: _train(steps=-1), ValueError, "steps"),
        (lambda: _train(steps=2.0), ValueError, "steps"),
        (lambda: _train(clip=-1.0), ValueError, "clip"),
        (lambda: _train(clip=0), ValueError, "clip"),
        (lambda: _train(clip=float("nan")), ValueError, "clip"),
        (lambda: _train(eval_every=-3), ValueError, "eval_every"),
    ],
)
def test_bad_arguments_name_themselves(call, error, names):
    with pytest.raises(error, match=names):
        call()


def test_a_bad_seed_seeds_nothing():
    """Python's random accepts a string seed and NumPy's does not: checked first."""
    random.seed(123)
    expected = random.random()
    random.seed(123)
    with pytest.raises(ValueError, match="seed"):
        seed_everything("abc")
    assert random.random() == expected


def test_train_and_evaluate_restore_the_mode_when_they_fail():
    def boom(step):
        raise RuntimeError("no data")

    model = _tiny().eval()
    with pytest.raises(RuntimeError, match="no data"):
        _train(
            model=model, get_batch=boom, optimizer=torch.optim.SGD(model.parameters())
        )
    assert not model.training  # came in eval mode, left in eval mode

    model.train()

    def bad_loss(m, x, y):
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        evaluate(model, [(torch.zeros(1, 3), torch.zeros(1, 2))], loss_fn=bad_loss)
    assert model.training
    model.eval()  # a successful train() leaves eval mode, whatever it came in
    _train(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert not model.training
