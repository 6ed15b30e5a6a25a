"""Bad input to a layer, a cache, attention, a loss or a schedule called on its own: each
raises an error of the right type whose message names the argument, before any state
changes (the caches and modules are as they were)."""

import pytest
import torch

from companion.layers.gated_deltanet import GatedDeltaNet
from companion.layers.kv_cache import KVCache, LatentCache, SlidingWindowCache
from companion.layers.mha import MultiHeadAttention
from companion.models.decoder import DecoderLM
from companion.models.presets import tiny
from companion.ops.cross_entropy import chunked_cross_entropy, naive_cross_entropy
from companion.ops.dispatch import IMPLS, attention
from companion.training import (
    cosine_lr,
    inverse_sqrt_lr,
    label_smoothed_cross_entropy,
    lm_loss,
    train,
)


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in module.named_buffers()}


def _same(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(b, before[n]) for n, b in module.named_buffers())


def _mha(**kw: object) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(8, 4, **{"n_kv_heads": 2, "causal": True, **kw}).eval()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, c: m(torch.randn(2, 1, 6), torch.tensor([3]), c), ValueError,
         r"x must have shape \(B, T, 8\)"),
        (lambda m, c: m(torch.randn(2, 8), torch.tensor([3]), c), ValueError,
         r"x must have shape \(B, T, 8\), got \(2, 8\)"),
        (lambda m, c: m(torch.randn(1, 1, 8), torch.tensor([3]), c), ValueError,
         r"cache is a KVCache whose k is \(2, 2, 6, 2\).* needs \(1, 2, 6, 2\)"),
        (lambda m, c: m(torch.randn(2, 1, 8), torch.tensor([3]),
                        _mha(n_kv_heads=1).new_cache(2, 6)), ValueError,
         r"cache is a KVCache whose k is \(2, 1, 6, 2\).* needs \(2, 2, 6, 2\)"),
        (lambda m, c: m(torch.randn(2, 1, 8), torch.tensor([3]),
                        m.new_cache(2, 6, dtype=torch.float64)), ValueError,
         "cache is a KVCache whose k is .*float64.* needs .*float32"),
        (lambda m, c: m(torch.randn(2, 1, 8), torch.tensor([3]),
                        _mha(window=2).new_cache(2, 6)), ValueError,
         "cache is a SlidingWindowCache of window 2 but this layer's window is None"),
        (lambda m, c: m(torch.randn(2, 1, 8), torch.tensor([3]),
                        GatedDeltaNet(8, 1, 1, 4, 4).new_cache(2)), TypeError,
         "cache must be a KVCache from this layer's new_cache"),
        (lambda m, c: m(torch.randn(2, 1, 8), torch.tensor([3]), c,
                        context=torch.randn(2, 3, 6)), ValueError,
         r"context must have shape \(2, S, 8\)"),
    ],
    ids=["width", "rank", "batch", "heads", "dtype", "window", "kind", "context"],
)  # fmt: skip
def test_attention_layer_checks_x_and_cache_before_writing(call, error, message):
    layer = _mha()
    cache = layer.new_cache(2, 6)
    with torch.no_grad():
        layer(torch.randn(2, 3, 8), torch.arange(3), cache)
        before = _buffers(cache)
        with pytest.raises(error, match=message):
            call(layer, cache)
    assert _same(cache, before)


CACHES = {
    "kv": (lambda: KVCache(2, 2, 6, 4), (2, 2, 1, 4)),
    "sliding": (lambda: SlidingWindowCache(2, 2, 3, 4), (2, 2, 1, 4)),
    "latent": (lambda: LatentCache(2, 6, 3, 1), (2, 1, 4)),
}
BAD_UPDATES = {
    "pos-int32": (lambda s: (torch.tensor([1], dtype=torch.int32), torch.zeros(s)),
                  TypeError, r"input_pos must have dtype in \(int64\)"),
    "pos-2d": (lambda s: (torch.tensor([[1]]), torch.zeros(s)), ValueError,
               r"input_pos must have shape \(T,\), got \(1, 1\)"),
    "pos-negative": (lambda s: (torch.tensor([-1]), torch.zeros(s)), ValueError,
                     "input_pos must hold positions .*got \\[-1, -1\\]"),
    "new-length": (lambda s: (torch.tensor([1, 2]), torch.zeros(s)), ValueError,
                   "_new must have shape .*2"),
    "new-width": (lambda s: (torch.tensor([1]), torch.zeros(*s[:-1], 5)), ValueError,
                  "_new must have shape"),
    "new-int": (lambda s: (torch.tensor([1]), torch.zeros(s, dtype=torch.long)),
                TypeError, "_new must have dtype in"),
    "new-device": (lambda s: (torch.tensor([1]), torch.zeros(s, device="meta")),
                   ValueError, "_new is on meta but must be on cpu"),
}  # fmt: skip


@pytest.mark.parametrize("bad", BAD_UPDATES)
@pytest.mark.parametrize("kind", CACHES)
def test_cache_update_checks_its_arguments_before_writing(kind, bad):
    make, shape = CACHES[kind]
    cache = make()
    args, error, message = BAD_UPDATES[bad]
    n_new = 2 if kind != "latent" else 1
    good = [torch.randn(*shape[:-2], 2, shape[-1]) if kind != "latent" else
            torch.randn(2, 2, 4)] * n_new  # fmt: skip
    cache.update(torch.tensor([0, 1]), *good)
    before = _buffers(cache)
    pos, new = args(shape)
    with pytest.raises(error, match=message):
        cache.update(pos, *[new] * n_new)
    assert _same(cache, before)


@pytest.mark.parametrize("kind", ["kv", "latent"])
def test_a_position_beyond_max_len_is_named(kind):
    make, shape = CACHES[kind]
    cache = make()
    n_new = 2 if kind != "latent" else 1
    before = _buffers(cache)
    with pytest.raises(ValueError, match=r"input_pos must hold positions \[0, max_len"):
        cache.update(torch.tensor([6]), *[torch.zeros(shape)] * n_new)
    assert _same(cache, before)
    ring = SlidingWindowCache(2, 2, 3, 4)  # a ring takes any position >= 0
    ring.update(torch.tensor([6]), torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("odd", ["k", "v", "mask"])
def test_attention_names_mixed_dtypes(impl, odd):
    torch.manual_seed(0)
    t = {"q": torch.randn(1, 2, 3, 4), "k": torch.randn(1, 2, 3, 4),
         "v": torch.randn(1, 2, 3, 4), "mask": torch.zeros(3, 3)}  # fmt: skip
    t[odd] = t[odd].to(torch.float64)
    q, k, v, mask = t["q"], t["k"], t["v"], t["mask"] if odd == "mask" else None
    with pytest.raises(ValueError, match="must share one dtype, got q float32, k .*64"):
        attention(q, k, v, impl=impl, mask=mask)


@pytest.mark.parametrize(
    "field", ["d_model", "n_key_heads", "n_value_heads", "key_dim", "value_dim"]
)
def test_linear_attention_layer_needs_positive_widths(field):
    kw = {"d_model": 8, "n_key_heads": 1, "n_value_heads": 2, "key_dim": 4,
          "value_dim": 4, field: 0}  # fmt: skip
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got 0"):
        GatedDeltaNet(**kw)


def test_linear_attention_layer_checks_x_and_cache_before_writing():
    torch.manual_seed(0)
    layer = GatedDeltaNet(8, 1, 2, 4, 4).eval()
    cache = layer.new_cache(2)
    with torch.no_grad():
        layer(torch.randn(2, 3, 8), cache=cache)
        before = _buffers(cache)
        with pytest.raises(ValueError, match=r"x must have shape \(B, T, 8\)"):
            layer(torch.randn(3, 8), cache=cache)
        other = GatedDeltaNet(8, 1, 1, 4, 4).new_cache(2)  # one value head, not two
        with pytest.raises(
            ValueError, match=r"conv_state is \(2, 12, 3\).* needs \(2, 16, 3\)"
        ):
            layer(torch.randn(2, 1, 8), cache=other)
        with pytest.raises(ValueError, match=r"conv_state is \(1, 16, 3\)"):
            layer(torch.randn(2, 1, 8), cache=layer.new_cache(1))
    assert _same(cache, before)


ALL_IGNORED = "every target equals ignore_index=-100"


def test_a_loss_over_no_targets_raises_in_every_form():
    model = DecoderLM(tiny(vocab_size=37))
    x, y = torch.zeros(1, 2, dtype=torch.long), torch.full((1, 2), -100)
    hidden, weight = torch.randn(2, 8), torch.randn(37, 8)
    calls = {
        "lm_loss": lambda: lm_loss(model, x, y),
        "lm_loss-smoothed": lambda: lm_loss(model, x, y, smoothing=0.1),
        "label_smoothed": lambda: label_smoothed_cross_entropy(
            torch.randn(2, 37), y.view(-1)
        ),
        "naive": lambda: naive_cross_entropy(hidden, weight, y.view(-1)),
        "chunked": lambda: chunked_cross_entropy(hidden, weight, y.view(-1)),
    }
    messages = {}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=ALL_IGNORED) as err:
            call()
        messages[name] = str(err.value)
    assert len(set(messages.values())) == 1, messages  # the forms agree
    # one kept target is enough, and both forms give the same loss
    y[0, 1] = 5
    torch.testing.assert_close(
        naive_cross_entropy(hidden, weight, y.view(-1)),
        chunked_cross_entropy(hidden, weight, y.view(-1)),
    )


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(1, 3), (2, 1), (2,)])
def test_targets_must_have_the_logits_shape(shape, smoothing):
    model = DecoderLM(tiny(vocab_size=37))
    x = torch.zeros(1, 2, dtype=torch.long)
    y = torch.ones(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets y must have the shape .*\(1, 2\)"):
        lm_loss(model, x, y, smoothing=smoothing)
    for form in (naive_cross_entropy, chunked_cross_entropy):
        for bad in (torch.ones(3).long(), torch.ones(2, 2).long()):
            with pytest.raises(ValueError, match=r"targets must be .* \(N,\) = \(4,\)"):
                form(torch.randn(4, 8), torch.randn(37, 8), bad)


def test_schedules_name_a_non_finite_learning_rate():
    with pytest.raises(ValueError, match="inverse_sqrt_lr returned nan at step 3"):
        inverse_sqrt_lr(3, 8, 4, factor=float("nan"))
    with pytest.raises(ValueError, match="cosine_lr returned inf at step 1"):
        cosine_lr(1, 1.7e308, 2, 10)  # (step + 1) · max_lr overflows

    def broken(step: int) -> float:
        return 1e-3 if step < 2 else float("nan")

    torch.manual_seed(0)
    model = DecoderLM(tiny(vocab_size=37))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="schedule broken returned nan at step 2"):
        train(model, lambda s: batch, 4, opt, lr_at=broken)
    assert opt.param_groups[0]["lr"] == 1e-3  # the last good step's, not NaN
    assert all(torch.isfinite(p).all() for p in model.parameters())
