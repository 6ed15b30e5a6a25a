"""The fused residual-add + RMSNorm kernel equals x + residual then the RMSNorm reference,
forward and backward (interpreted on CPU where no CUDA GPU is present)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from companion.kernels.rms_norm import add_rms_norm  # noqa: E402
from companion.layers.norms import rms_norm_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 outputs against the fp32 reference: a few bf16 steps (2^-8 relative each)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}
# compiled Triton rounds fp32 -> bf16 to nearest even, as torch does; Triton's
# interpreter (3.7) truncates, so there a bf16 sum may sit one bf16 step (2^-7) off
H_RTOL = 0.0 if DEVICE.type == "cuda" else 2**-7


def _inputs(shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x, r = (scale * torch.randn(*shape, generator=gen) for _ in range(2))
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (x, r, w)]


def _reference(x, r, w, eps, offset):
    """fp32 reference on fp32 leaf copies, the sum rounded to x's dtype as torch does."""
    leaves = [t.detach().float().requires_grad_() for t in (x, r, w)]
    h = (leaves[0].to(x.dtype) + leaves[1].to(x.dtype)).float()
    return leaves, rms_norm_reference(h, leaves[2], eps, offset), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [32, 48, 130], ids=lambda d: f"D{d}")
def test_forward_matches_add_then_reference(dtype, d):
    x, r, w = _inputs((2, 5, d), dtype)
    y, h = add_rms_norm(x, r, w)
    _, y_ref, h_ref = _reference(x, r, w, 1e-6, 0.0)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == x.shape
    h_rtol = H_RTOL if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(h, x + r, rtol=h_rtol, atol=0)  # the rounded sum
    torch.testing.assert_close(y.float(), y_ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_eps_sits_inside_the_square_root():
    x, r, w = _inputs((4, 16), torch.float32, scale=0.1)  # mean(h²) ~ eps
    y, _ = add_rms_norm(x, r, w, eps=0.05)
    torch.testing.assert_close(y, rms_norm_reference(x + r, w, 0.05))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
def test_gradients_of_y_and_h_add_up(dtype, offset):
    # 100 rows of a non-power-of-two width: 7 tiles of 16 rows, more than the backward
    # programs, so dweight is summed over programs and over the tiles each loops through
    x, r, w = _inputs((100, 40), dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    gy, gh = (torch.randn(100, 40, generator=gen).to(DEVICE) for _ in range(2))
    y, h = add_rms_norm(x, r, w, eps=1e-5, offset=offset)
    ((y.float() * gy).sum() + (h.float() * gh).sum()).backward()
    leaves, y_ref, h_ref = _reference(x, r, w, 1e-5, offset)
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.detach(), rtol=rtol, atol=atol)
    for got, ref in zip((x, r, w), leaves, strict=True):
        scale = ref.grad.abs().max().item()
        torch.testing.assert_close(
            got.grad.float(), ref.grad, rtol=rtol, atol=atol * scale
        )
    torch.testing.assert_close(x.grad, r.grad)  # both summands get dh


def test_gradient_through_y_alone_and_h_alone():
    x, r, w = _inputs((6, 24), torch.float32, seed=3)
    y, _ = add_rms_norm(x, r, w)
    y.pow(2).sum().backward()
    leaves, y_ref, _ = _reference(x, r, w, 1e-6, 0.0)
    y_ref.pow(2).sum().backward()
    for got, ref in zip((x, r, w), leaves, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-4)
    x.grad = r.grad = w.grad = None
    _, h = add_rms_norm(x, r, w)
    (3 * h).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(r.grad, x.grad)
    assert w.grad is None


def test_bad_input_is_named():
    x, r, w = (t.detach() for t in _inputs((3, 8), torch.float32))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, r[:2], w)
    with pytest.raises(ValueError, match=r"weight must have shape \(D,\) = \(8,\)"):
        add_rms_norm(x, r, w[:4])
    with pytest.raises(ValueError, match="x, residual must share one dtype"):
        add_rms_norm(x, r.half(), w)
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        add_rms_norm(x.long(), r, w)
    with pytest.raises(ValueError, match="D must be in"):
        wide = torch.zeros(1, 8193, device=DEVICE)
        add_rms_norm(wide, wide, w)
    with pytest.raises(ValueError, match="eps must be a positive number"):
        add_rms_norm(x, r, w, eps=0)
    with pytest.raises(ValueError, match="offset must be a finite number"):
        add_rms_norm(x, r, w, offset=float("nan"))


def test_a_cpu_tensor_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r, w = torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="add_rms_norm runs on a CUDA GPU"):
        add_rms_norm(x, r, w)
