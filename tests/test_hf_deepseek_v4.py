"""companion.checkpoints.transformers for DeepSeek-V4 (``DeepseekV4ForCausalLM``): tiny
random configs in which every mechanism acts (sequences longer than the window, than a
compression block and than the indexer's top-k; sliding, CSA and HCA layers; hash-routed
and top-k MoE layers with experts left out; several residual streams): the same logits,
the same cached greedy tokens, and named errors for what cannot be converted (chapters
08, 10, 12)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from companion.checkpoints.transformers import from_hf  # noqa: E402
from companion.checkpoints.transformers_config import config_from_hf  # noqa: E402
from companion.layers.compressed_attention import CompressedAttention  # noqa: E402
from companion.models.decoder import DecoderLM  # noqa: E402

VOCAB, T = 97, 29  # T > window 6, > the blocks 4 and 8, and T / 4 = 7 > index_topk 3
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    moe_intermediate_size=16,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=4,
    index_head_dim=12,
    index_topk=3,
    sliding_window=6,
    compress_rates={
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 8,
    },
    partial_rotary_factor=0.5,
    n_routed_experts=6,
    num_experts_per_tok=2,
    routed_scaling_factor=1.5,
    hc_sinkhorn_iters=5,
    hc_eps=1e-4,  # away from rms_norm_eps, so a swap shows
    rms_norm_eps=1e-5,
    swiglu_limit=0.5,  # small, so the clamps bite
    max_position_embeddings=64,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
S, C, H = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
CASES = {
    "all-kinds-hc3": dict(
        num_hidden_layers=4,
        layer_types=[H, S, C, H],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        hc_mult=3,
    ),
    "yarn-csa-first-hc2": dict(
        num_hidden_layers=3,
        layer_types=[C, S, H],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
}


def make(name: str):
    cfg = transformers.DeepseekV4Config(**(BASE | CASES[name]))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # everything away from its start, so wiring shows
        for n, t in hf.state_dict().items():
            if n.endswith("tid2eid"):  # distinct random experts per token id
                draw = torch.rand(t.shape[0], cfg.n_routed_experts, generator=gen)
                t.copy_(draw.topk(t.shape[1], dim=-1).indices)
            elif "norm" in n or n.endswith("scale"):
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
            elif n.endswith(("sinks", "position_bias", "base", "correction_bias")):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    hf = make(request.param)
    return hf, from_hf(hf)


def test_config_reads_every_mechanism(pair):
    hf, ours = pair
    cfg, c = ours.cfg, hf.config
    kinds = {"sliding_attention": "sliding"} | {C: "csa", H: "hca"}
    assert cfg.layer_types == tuple(kinds[t] for t in c.layer_types)
    assert cfg.residual.n_streams == c.hc_mult and ours.hc_head is not None
    assert cfg.moe.hash_layers == c.mlp_layer_types.count("hash_moe")
    routing = [b.ffn.routing for b in ours.blocks]
    assert routing == ["hash" if t == "hash_moe" else "topk" for t in c.mlp_layer_types]
    assert all(isinstance(b.attn, CompressedAttention) for b in ours.blocks)
    assert [b.attn.kind for b in ours.blocks] == list(cfg.layer_types)


def test_logits_match(pair):
    hf, ours = pair
    x = torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(x).logits
        got = ours(x)
        assert (got - want).abs().max().item() <= 1e-4
        # the routing left experts out, and a hash layer chose from its table
        assert ours.blocks[-1].ffn.last_routing.indices.unique().numel() > 2
        first = ours.blocks[0].ffn
        table = hf.model.layers[0].mlp.gate.tid2eid
        assert torch.equal(first.last_routing.indices, table[x.reshape(-1)])


def test_cached_greedy_generation_matches(pair):
    hf, ours = pair
    x = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    hf.generation_config.eos_token_id = None  # plain argmax, no early stop
    with torch.no_grad():
        want = hf.generate(x, max_new_tokens=T - 7, do_sample=False)
    assert torch.equal(ours.generate(x, T - 7), want)


def test_every_mechanism_changes_the_logits():
    """Dropping one mechanism from the converted model moves its logits: the parity
    above would catch a converter that lost any of them."""
    hf = make("all-kinds-hc3")
    x = torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(x).logits
    cfg = config_from_hf(hf.config)
    changes = {
        "streams": dict(residual=cfg.residual.replace(sinkhorn_iters=1)),
        "hash": dict(moe=cfg.moe.replace(hash_layers=0)),
        "limit": dict(moe=cfg.moe.replace(swiglu_limit=50.0)),
        "topk": dict(compression=cfg.compression.replace(index_topk=7)),
        "compress-rope": dict(compression=cfg.compression.replace(rope_theta=1e4)),
    }
    sd = from_hf(hf).state_dict()
    for name, change in changes.items():
        model = DecoderLM(cfg.replace(**change)).eval()
        model.load_state_dict(sd, strict=False)
        with torch.no_grad():
            assert (model(x) - want).abs().max() > 1e-3, name


def test_options_that_cannot_be_expressed_are_named():
    kw = BASE | CASES["all-kinds-hc3"]
    bad = dict(mlp_layer_types=["moe", "hash_moe", "moe", "moe"])
    with pytest.raises(ValueError, match="mlp_layer_types=.*only hash_moe layers"):
        config_from_hf(transformers.DeepseekV4Config(**(kw | bad)))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        config_from_hf(transformers.DeepseekV4Config(**(kw | {"hidden_act": "gelu"})))
    with pytest.raises(ValueError, match="mlp_bias=True"):
        config_from_hf(transformers.DeepseekV4Config(**(kw | {"mlp_bias": True})))
