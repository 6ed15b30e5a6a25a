"""companion.analysis.diagnostics and op_counts: stream norms, gradient norms, identity-path
gains, logit tracking, operator counts, each checked against a direct computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from companion.analysis.diagnostics import (
    AttentionLogitTracker,
    StreamTracker,
    attention_logit_max,
    block_grad_norms,
    identity_path_jacobian,
    residual_norms,
    residual_write_weights,
    stream_states,
    token_cosine,
)
from companion.analysis.op_counts import count_aten_ops, count_reductions
from companion.layers.norms import layer_norm_reference, rms_norm_reference
from companion.layers.recording import recorded_inputs
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.rope import apply_rope
from companion.training import lm_loss


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: a second thread only adds waiting (and much more on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**changes) -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=3, n_heads=2, max_seq_len=8)
    return DecoderLM(cfg.replace(**changes)).eval()


IDS = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))


def manual_states(model: DecoderLM, ids: torch.Tensor) -> list[torch.Tensor]:
    x = model.embed(ids)
    states = [x]
    for block in model.blocks:
        x = block(x)
        states.append(x)
    return states


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "post_branch"])
def test_stream_states_match_a_manual_forward(placement):
    model = tiny(norm_placement=placement)
    with torch.no_grad():
        expected = manual_states(model, IDS)
    got = stream_states(model, IDS)
    assert len(got) == 4
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    norms = residual_norms(model, IDS)
    assert norms.shape == (4, 2, 8)
    torch.testing.assert_close(norms[2], expected[2].norm(dim=-1))
    assert not model.blocks[0]._forward_pre_hooks and not model.blocks[0]._forward_hooks


def test_block_grad_norms_match_autograd():
    model = tiny()
    y = IDS.roll(-1, dims=1)
    norms = block_grad_norms(model, IDS, y)
    lm_loss(model, IDS, y).backward()
    for i, block in enumerate(model.blocks):
        expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in block.parameters()))
        assert norms[i].item() == pytest.approx(expected.item(), rel=1e-5)
    expected_down = model.blocks[1].ffn.down.weight.grad.norm().item()
    down = block_grad_norms(model, IDS, y, suffix="ffn.down.weight")
    assert down[1].item() == pytest.approx(expected_down, rel=1e-5)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="suffix"):
        block_grad_norms(model, IDS, y, suffix="nothing")


def test_identity_path_gains_are_one_for_an_identity_stack():
    model = tiny(norm_placement="pre")
    with torch.no_grad():  # zero every residual write: each block is the identity
        for block in model.blocks:
            block.attn.out_proj.weight.zero_()
            block.ffn.down.weight.zero_()
    path = identity_path_jacobian(
        model, IDS, n_probes=2, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(path.norm, torch.ones(4))
    torch.testing.assert_close(path.trace, torch.ones(4))


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_identity_path_jacobian_matches_the_exact_jacobian(placement):
    model = tiny(norm_placement=placement, n_layers=2, init_std=0.3)
    ids = IDS[:1, :3]
    x0 = model.embed(ids).detach()

    def last(x):  # the stream after both blocks as a function of x_0
        for block in model.blocks:
            x = block(x)
        return x

    n = x0.numel()
    jac = torch.autograd.functional.jacobian(last, x0).reshape(n, n)
    path = identity_path_jacobian(
        model, ids, n_probes=64, generator=torch.Generator().manual_seed(0)
    )
    assert path.norm[0].item() == pytest.approx(
        (jac.norm() / math.sqrt(n)).item(), rel=0.15
    )
    assert path.trace[0].item() == pytest.approx((jac.trace() / n).item(), abs=0.15)
    assert path.norm[-1].item() == path.trace[-1].item() == 1.0


def test_identity_path_jacobian_cleans_up_and_refuses_a_frozen_model():
    model = tiny()
    with torch.no_grad():  # the probe turns autograd on for its own forward pass
        path = identity_path_jacobian(model, IDS, n_probes=1)
    assert path.norm.shape == path.trace.shape == (4,)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        identity_path_jacobian(model, IDS, n_probes=1)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in model.blocks)


@pytest.mark.parametrize(
    "changes", [{}, {"position": "rope", "n_kv_heads": 1}], ids=["mha", "gqa-rope"]
)
def test_attention_logit_max_matches_the_attention_weights(changes):
    model = tiny(attn_impl="reference", **changes)
    with torch.no_grad():
        for block in model.blocks:  # bigger weights, so the logits are far from zero
            block.attn.qkv.weight.mul_(20)
    got = attention_logit_max(model, IDS)
    # recompute layer 0 by hand from the attention weights: log p differs from the logit by a
    # per-row constant, so compare the largest |logit| through q and k directly
    attn = model.blocks[0].attn
    with recorded_inputs([attn]) as calls:
        model(IDS)
    x = calls[0][0][0]  # what layer 0's attention received: the normed stream
    qf, kf, _ = attn.project(x)
    q, k = attn.heads(qf, attn.n_heads), attn.heads(kf, attn.n_kv_heads)
    if model.cfg.position == "rope":
        cos, sin = model.rope_tables(torch.arange(8))["global"]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    visible = torch.ones(8, 8, dtype=torch.bool).tril()
    expected = logits.abs().masked_fill(~visible, 0).amax()
    assert got.shape == (3,)
    assert got[0].item() == pytest.approx(expected.item(), rel=1e-5)
    assert got[0].item() > 1.0


def test_tracker_records_one_row_per_forward_and_cleans_up():
    model = tiny()
    with AttentionLogitTracker(model) as tracker:
        with torch.no_grad():
            for _ in range(3):
                model(IDS)
    assert tracker.history.shape == (3, 3)
    assert not model.blocks[0].attn._forward_pre_hooks
    model(IDS)  # not recorded after the block
    assert tracker.history.shape == (3, 3)


def test_counts_reductions_of_the_two_norms():
    x, w, b = torch.randn(4, 16), torch.ones(16), torch.zeros(16)
    assert count_reductions(layer_norm_reference, x, w, b) == 2  # mean, then variance
    assert count_reductions(rms_norm_reference, x, w) == 1  # mean of squares only
    ops = count_aten_ops(F.linear, x, torch.randn(3, 16))
    assert (
        sum(ops.values()) >= 1
        and count_reductions(F.linear, x, torch.randn(3, 16)) == 0
    )


def test_token_cosine_matches_the_pairwise_mean():
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    f = F.normalize(x.reshape(10, 8), dim=-1)
    cos = f @ f.T
    expected = (cos.sum() - cos.trace()) / (10 * 9)
    assert token_cosine(x) == pytest.approx(expected.item(), abs=1e-6)
    assert token_cosine(torch.ones(1, 4, 8) * torch.randn(8)) == pytest.approx(
        1.0, abs=1e-6
    )


def test_stream_tracker_and_residual_writes():
    model = tiny()
    with StreamTracker(model, token_cosine) as tracker, torch.no_grad():
        model(IDS)
        model(IDS)
    states = stream_states(model, IDS)
    assert tracker.history.shape == (2, 3)
    torch.testing.assert_close(tracker.history[0], tracker.history[1])
    expected = torch.tensor([token_cosine(s) for s in states[1:]])
    torch.testing.assert_close(tracker.history[1], expected)
    assert not model.blocks[1]._forward_hooks
    writes = residual_write_weights(model)
    assert len(writes) == 6 and writes[0] is model.blocks[0].attn.out_proj.weight
    assert writes[-1] is model.blocks[2].ffn.down.weight
