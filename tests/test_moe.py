"""Mixture of experts: router, balancing, reference vs grouped experts, parity with transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from companion.layers.moe import GLUExperts, GptOssExperts, MoEFeedForward
from companion.layers.router import (
    TopKRouter,
    load_balancing_loss,
    update_selection_bias,
)
from companion.ops.experts import (
    expert_load,
    experts_grouped,
    experts_reference,
    grouped_matmul,
    grouped_mm_available,
    swiglu,
)

# ---------------------------------------------------------------- router


def test_softmax_topk_renormalised_equals_softmax_of_the_chosen_logits():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 3, bias=True)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(50, 16)
    weights, indices, probs = router(x)
    logits = F.linear(x, router.weight, router.bias)
    top_logits, top_idx = logits.topk(3, dim=-1)  # gpt-oss: top-k first, then softmax
    torch.testing.assert_close(indices, top_idx)
    torch.testing.assert_close(weights, top_logits.softmax(-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(50))


def test_without_renormalisation_the_weights_are_the_chosen_probabilities():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, norm_topk=False, scale=3.0)
    weights, indices, probs = router(torch.randn(20, 16))
    torch.testing.assert_close(weights, 3.0 * probs.gather(-1, indices))
    assert (weights.sum(-1) < 3.0).all()


def test_selection_bias_changes_the_choice_never_the_weights():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, scoring="sigmoid", scale=2.5, selection_bias=True)
    router.selection_bias[5] = 10.0  # expert 5 wins every selection...
    weights, indices, scores = router(torch.randn(30, 16))
    assert (indices == 5).any(-1).all()
    chosen = scores.gather(-1, indices)  # ...but its weight is its own unbiased score
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert "selection_bias" in dict(router.named_buffers())
    assert "selection_bias" not in dict(router.named_parameters())


@pytest.mark.parametrize(
    "groups, topk_groups, top_k", [(4, 1, 3), (4, 2, 4), (8, 3, 6), (1, 1, 4)]
)
def test_group_limited_routing_is_transformers_deepseek_v3(groups, topk_groups, top_k):
    """The same experts and weights as DeepSeek-V3's router in transformers, with a
    selection bias large enough to change the groups chosen."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=24, num_experts_per_tok=top_k, n_group=groups,
        topk_group=topk_groups, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    theirs = ds.DeepseekV3TopkRouter(cfg)
    ours = TopKRouter(
        16, 24, top_k, scoring="sigmoid", n_groups=groups, topk_groups=topk_groups,
        scale=2.5, selection_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.normal_(0.0, 0.3)
        ours.weight.copy_(theirs.weight)
        ours.selection_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, 16)
    _, w_theirs, i_theirs = theirs(x)
    weights, indices, _ = ours(x)
    order_t, order_o = i_theirs.sort(-1), indices.sort(-1)  # the same set of experts
    assert torch.equal(order_o.values, order_t.values)
    torch.testing.assert_close(
        weights.gather(-1, order_o.indices), w_theirs.gather(-1, order_t.indices)
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scoring": "relu"}, "scoring must be one of"),
        ({"top_k": 9}, "top_k must be in"),
        ({"n_groups": 3}, "n_groups must divide"),
        ({"n_groups": 4, "topk_groups": 5}, "topk_groups must be in"),
        ({"n_groups": 4, "topk_groups": 1, "top_k": 3}, "group-limited routing"),
    ],
    ids=["scoring", "top_k", "n_groups", "topk_groups", "too_few_in_groups"],
)
def test_router_rejects_bad_arguments(kwargs, match):
    args = {"top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        TopKRouter(16, 8, args.pop("top_k"), **args)


# ---------------------------------------------------------------- balancing


def test_load_balancing_loss_is_k_for_uniform_routing():
    probs = torch.full((8, 4), 0.25)
    indices = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(probs, indices, 4).item() == pytest.approx(2.0)


@pytest.mark.parametrize("n_experts, top_k", [(8, 2), (16, 4), (5, 1)], ids=str)
def test_load_balancing_loss_matches_transformers(n_experts, top_k):
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    torch.manual_seed(0)
    logits = 2 * torch.randn(64, n_experts)
    probs = logits.softmax(-1)
    indices = probs.topk(top_k, dim=-1).indices
    ours = load_balancing_loss(probs, indices, n_experts)
    theirs = qwen3_moe.load_balancing_loss_func((logits,), n_experts, top_k)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_selection_bias_updates_flatten_a_skewed_load():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, scoring="sigmoid", bias=True, selection_bias=True)
    with torch.no_grad():
        router.bias[:2] = 3.0  # experts 0 and 1 take almost every token
    x = torch.randn(512, 16)

    def imbalance() -> float:
        load = expert_load(router(x)[1], 8).float()
        return (load.max() / load.mean()).item()

    before = imbalance()
    for _ in range(300):
        update_selection_bias(
            router.selection_bias, expert_load(router(x)[1], 8), 0.003
        )
    assert before > 3.5
    assert imbalance() < 1.2
    assert router.selection_bias[:2].max() < router.selection_bias[2:].min()


# ---------------------------------------------------------------- experts: reference vs grouped

KERNELS = ["segments", "grouped_mm"]


def _skip_if_unavailable(kernel: str) -> None:
    if kernel == "grouped_mm" and not grouped_mm_available(
        torch.zeros(2, 16), torch.zeros(2, 16, 16)
    ):
        pytest.skip(
            f"torch._grouped_mm does not run in fp32 on CPU in torch {torch.__version__}"
        )


def _routing(
    n: int, k: int, experts: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token, drawn from ``experts`` only (the others get no token)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    indices = torch.stack(
        [pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(n)]
    )
    weights = torch.rand(n, k, generator=gen)
    return weights, indices


def _rel_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    err = (a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)
    assert err < tol, f"relative RMS error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "counts",
    [[3, 0, 4, 3], [0, 0, 0, 10], [10, 0, 0, 0], [1, 2, 3, 4]],
    ids=["middle_empty", "last_only", "first_only", "all"],
)
def test_grouped_matmul_matches_a_loop_forward_and_backward(kernel, counts):
    _skip_if_unavailable(kernel)
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(4, 32, 16, requires_grad=True)
    out = grouped_matmul(x, w, torch.tensor(counts), kernel)
    out.sum().backward()  # a stride-0 gradient, which torch._grouped_mm cannot take raw
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expert = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    ref = torch.einsum("si,soi->so", x2, w2[expert])
    ref.sum().backward()
    _rel_close(out, ref)
    _rel_close(x.grad, x2.grad)
    _rel_close(w.grad, w2.grad)


def test_grouped_mm_kernel_refuses_what_it_cannot_run():
    x, w = (
        torch.zeros(4, 16, dtype=torch.float64),
        torch.zeros(2, 16, 16, dtype=torch.float64),
    )
    with pytest.raises(ValueError, match="kernel='grouped_mm' is not available"):
        grouped_matmul(x, w, torch.tensor([2, 2]), "grouped_mm")
    layer = MoEFeedForward(16, 4, 2, 8).double()
    layer.experts.impl = (
        "grouped_mm"  # fp64 never runs on torch._grouped_mm: no fallback
    )
    with pytest.raises(ValueError, match="use kernel='segments'"):
        layer(torch.zeros(1, 3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="kernel must be one of"):
        grouped_matmul(x, w, torch.tensor([2, 2]), "triton")


def _make_experts(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "glu":
        return GLUExperts(8, 16, 24)
    experts = GptOssExperts(8, 16, 24, limit=0.5)  # a small limit, so the clamps bite
    for b in (experts.gate_up_bias, experts.down_bias):
        torch.nn.init.normal_(b, std=0.5)
    return experts


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["glu", "gpt_oss"])
def test_grouped_experts_match_the_reference_forward_and_backward(kind, kernel):
    _skip_if_unavailable(kernel)
    experts = _make_experts(kind)
    weights, indices = _routing(
        40, 3, [0, 2, 3, 5, 7], seed=2
    )  # experts 1, 4, 6 get nothing
    x = 2 * torch.randn(40, 16)
    params = list(experts.parameters())
    act = swiglu if kind == "glu" else experts.act
    biases = (experts.gate_up_bias, experts.down_bias) if kind == "gpt_oss" else ()
    grads = []
    for form in (experts_reference, experts_grouped):
        xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
        extra = {"kernel": kernel} if form is experts_grouped else {}
        out = form(
            xr, wr, indices, experts.gate_up, experts.down, act, *biases, **extra
        )
        out.backward(torch.cos(out.detach()))
        grads.append([out, xr.grad, wr.grad] + [p.grad.clone() for p in params])
        experts.zero_grad()
    for ref, fast in zip(*grads, strict=True):
        _rel_close(fast, ref)
    for p_grad in grads[1][3:]:
        assert p_grad[[1, 4, 6]].abs().max() == 0  # no tokens, no gradient


@pytest.mark.parametrize("kind", ["glu", "gpt_oss"])
def test_experts_impl_switch_gives_the_same_module_output(kind):
    experts = _make_experts(kind)
    weights, indices = _routing(12, 2, list(range(8)), seed=3)
    x = torch.randn(12, 16)
    experts.impl = "reference"
    ref = experts(x, weights, indices)
    experts.impl = "grouped"
    _rel_close(experts(x, weights, indices), ref)
    experts.impl = "loop"
    with pytest.raises(ValueError, match="impl must be one of"):
        experts(x, weights, indices)


# ---------------------------------------------------------------- the MoE feed-forward


def test_parameters_are_the_documented_ones():
    d, e, f, shared = 16, 8, 24, 40
    moe = MoEFeedForward(
        d, e, 2, f, selection_bias=True, shared_d_ff=shared, shared_gate=True
    )
    assert {n: tuple(p.shape) for n, p in moe.named_parameters()} == {
        "router.weight": (e, d),
        "experts.gate_up": (e, 2 * f, d),
        "experts.down": (e, d, f),
        "shared.gate.weight": (shared, d),
        "shared.up.weight": (shared, d),
        "shared.down.weight": (d, shared),
        "shared_gate.weight": (1, d),
    }
    assert (
        sum(p.numel() for p in moe.parameters())
        == e * d + e * 3 * f * d + 3 * d * shared + d
    )
    assert [n for n, _ in moe.named_buffers()] == ["router.selection_bias"]
    oss = MoEFeedForward(d, e, 2, f, kind="gpt_oss", router_bias=True)
    total = e * d + e + e * (3 * f * d + 2 * f + d)
    assert sum(p.numel() for p in oss.parameters()) == total


@pytest.mark.parametrize("kind", ["glu", "gpt_oss"])
def test_moe_reference_and_grouped_agree_and_keep_the_routing(kind):
    torch.manual_seed(0)
    moe = MoEFeedForward(16, 8, 2, 24, kind=kind, shared_d_ff=20, shared_gate=True)
    x = torch.randn(2, 5, 16)
    out = moe(x)
    assert out.shape == x.shape
    routing = moe.last_routing
    assert routing.weights.shape == routing.indices.shape == (10, 2)
    assert routing.scores.shape == (10, 8)
    load_balancing_loss(routing.scores, routing.indices, 8).backward()
    assert moe.router.weight.grad.abs().sum() > 0  # the aux loss reaches the router
    moe.experts.impl = "reference"
    _rel_close(out, moe(x))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "mlp"}, "kind must be one of"),
        ({"shared_gate": True}, "shared_gate needs"),
    ],
    ids=["kind", "gate_without_shared"],
)
def test_moe_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(16, 8, 2, 24, **kwargs)


# ---------------------------------------------------------------- parity with transformers


def moe_state_from_hf(
    hf_state: dict[str, torch.Tensor], kind: str
) -> dict[str, torch.Tensor]:
    """Map a transformers MoE block's state dict onto :class:`MoEFeedForward`'s names.

    Qwen3-MoE, Qwen3-Next, DeepSeek-V3 (``kind="glu"``) store ``experts.gate_up_proj (E, 2F, d)``
    rows [gate; up] and ``experts.down_proj (E, d, F)``, the layout we keep. gpt-oss
    (``kind="gpt_oss"``) stores them as (E, d, 2F) with interleaved gate/up columns and
    (E, F, d): transpose the last two axes, keep the interleaving.
    """
    names = {
        "gate.weight": "router.weight",  # Qwen3-MoE, Qwen3-Next, DeepSeek-V3
        "router.weight": "router.weight",  # gpt-oss
        "router.bias": "router.bias",
        "gate.e_score_correction_bias": "router.selection_bias",
        "experts.gate_up_proj": "experts.gate_up",
        "experts.gate_up_proj_bias": "experts.gate_up_bias",
        "experts.down_proj": "experts.down",
        "experts.down_proj_bias": "experts.down_bias",
        "shared_expert_gate.weight": "shared_gate.weight",
    }
    for prefix in ("shared_experts", "shared_expert"):  # DeepSeek-V3, Qwen3-Next
        for proj in ("gate", "up", "down"):
            names[f"{prefix}.{proj}_proj.weight"] = f"shared.{proj}.weight"
    ours = {}
    for name, tensor in hf_state.items():
        if name not in names:
            raise KeyError(f"no mapping for transformers parameter {name!r}")
        transpose = kind == "gpt_oss" and name in (
            "experts.gate_up_proj",
            "experts.down_proj",
        )
        ours[names[name]] = tensor.transpose(1, 2) if transpose else tensor
    return ours


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            scale = 0.1 if "bias" in name and "proj" not in name else 0.3
            t.copy_(scale * torch.randn(t.shape, generator=gen))


def _check_parity(hf_block, ours: MoEFeedForward, kind: str, d: int, seed: int) -> None:
    _randomise(hf_block, seed)
    ours.load_state_dict(moe_state_from_hf(hf_block.state_dict(), kind))
    x = torch.randn(2, 7, d, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected = hf_block(x)
        expected = (
            expected[0] if isinstance(expected, tuple) else expected
        )  # gpt-oss: (y, scores)
        for impl in ("reference", "grouped"):
            ours.experts.impl = impl
            assert (ours(x) - expected).abs().max().item() <= 1e-5, impl


def _eager(config):
    config._experts_implementation = "eager"  # the plain loop, with no warning
    return config


@pytest.mark.parametrize(
    "n_experts, top_k, norm",
    [(8, 2, True), (8, 2, False), (16, 4, True), (6, 1, False)],
    ids=str,
)
def test_parity_with_qwen3_moe(n_experts, top_k, norm):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    d, f = 24, 16
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=d,
        moe_intermediate_size=f,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
    )
    ours = MoEFeedForward(d, n_experts, top_k, f, norm_topk=norm)
    _check_parity(Qwen3MoeSparseMoeBlock(_eager(cfg)), ours, "glu", d, seed=top_k)


@pytest.mark.parametrize(
    "n_experts, top_k, groups, topk_groups, norm",
    [(8, 3, 4, 2, True), (16, 4, 4, 3, True), (12, 2, 3, 2, False)],
    ids=str,
)
def test_parity_with_deepseek_v3(n_experts, top_k, groups, topk_groups, norm):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    d, f = 24, 16
    cfg = transformers.DeepseekV3Config(
        hidden_size=d,
        moe_intermediate_size=f,
        n_routed_experts=n_experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=topk_groups,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
        n_shared_experts=1,
    )
    ours = MoEFeedForward(
        d,
        n_experts,
        top_k,
        f,
        scoring="sigmoid",
        norm_topk=norm,
        n_groups=groups,
        topk_groups=topk_groups,
        scale=2.5,
        selection_bias=True,
        shared_d_ff=f,
    )
    _check_parity(DeepseekV3MoE(_eager(cfg)), ours, "glu", d, seed=n_experts)
    assert (
        ours.router.selection_bias.abs().min() > 0
    )  # the random balancing bias was used


@pytest.mark.parametrize("n_experts, top_k, limit", [(8, 2, 7.0), (6, 3, 0.5)], ids=str)
def test_parity_with_gpt_oss(n_experts, top_k, limit):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    d, f = 24, 16
    cfg = transformers.GptOssConfig(
        hidden_size=d,
        intermediate_size=f,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
        swiglu_limit=limit,
    )
    ours = MoEFeedForward(d, n_experts, top_k, f, kind="gpt_oss", router_bias=True)
    ours.experts.limit = limit
    _check_parity(GptOssMLP(_eager(cfg)), ours, "gpt_oss", d, seed=top_k)


@pytest.mark.parametrize(
    "n_experts, top_k, norm", [(8, 2, True), (10, 3, False)], ids=str
)
def test_parity_with_qwen3_next(n_experts, top_k, norm):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextSparseMoeBlock,
    )

    d, f, shared = 24, 16, 40
    cfg = transformers.Qwen3NextConfig(
        hidden_size=d,
        moe_intermediate_size=f,
        shared_expert_intermediate_size=shared,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
    )
    ours = MoEFeedForward(
        d, n_experts, top_k, f, norm_topk=norm, shared_d_ff=shared, shared_gate=True
    )
    _check_parity(Qwen3NextSparseMoeBlock(_eager(cfg)), ours, "glu", d, seed=n_experts)


# ---------------------------------------------------------------- benchmark smoke test


def test_moe_bench_runs_on_tiny_sizes():
    pytest.importorskip("transformers")
    from companion.bench.moe import bench_moe, format_moe

    rows = bench_moe([32], n_experts=8, top_k=2, d_model=16, d_ff=8, repeats=1)
    assert len(rows) == 1 and rows[0]["tokens"] == 32
    assert rows[0]["max_abs_diff"] < 1e-5
    table = format_moe(rows)
    assert "reference/grouped" in table and "x |" in table.splitlines()[-1]
