"""companion.checkpoints.transformers for the sparse and hybrid families: Qwen3-MoE,
DeepSeek-V3 (both MLA forms), gpt-oss and Qwen3-Next, and the 2026 Qwen3.5 (dense and
MoE), Trinity, SmolLM3 and MiniMax-M2, tiny random configs: same
logits, same cached greedy tokens, and named errors for what cannot be converted (chapters
08, 10-12)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from companion.checkpoints.transformers import (  # noqa: E402
    convert_state_dict,
    from_hf,
    load_state_dict_strict,
)
from companion.checkpoints.transformers_config import config_from_hf  # noqa: E402
from companion.models.decoder import DecoderLM  # noqa: E402

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, max_position_embeddings=96
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 24,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
FAMILIES = {
    "qwen3-moe": (
        "Qwen3Moe",
        dict(
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "qwen3-moe-unnormed-odd": (
        "Qwen3Moe",
        dict(
            moe_intermediate_size=12,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    "deepseek-v3": (
        "DeepseekV3",
        dict(
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            routed_scaling_factor=2.5,
        ),
    ),
    "deepseek-v3-yarn-direct-q": (
        "DeepseekV3",
        dict(
            moe_intermediate_size=12,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            n_routed_experts=4,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=2,
            first_k_dense_replace=0,
            n_shared_experts=2,
            kv_lora_rank=12,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=12,
            v_head_dim=8,
            rope_interleave=False,
            rope_parameters=YARN,
        ),
    ),
    "gpt-oss": (
        "GptOss",
        dict(
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
        ),
    ),
    "gpt-oss-mqa-4-layers": (
        "GptOss",
        dict(
            intermediate_size=12,
            num_hidden_layers=4,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            num_local_experts=5,
            num_experts_per_tok=1,
            sliding_window=3,
            rope_parameters={**YARN, "rope_theta": 150000.0, "truncate": False},
        ),
    ),
    "qwen3-next": (
        "Qwen3Next",
        dict(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        ),
    ),
    "qwen3-next-odd": (
        "Qwen3Next",
        dict(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=3,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_conv_kernel_dim=3,
            norm_topk_prob=False,
        ),
    ),
    # 2026: Qwen3.5 (split DeltaNet projections), Trinity (NoPE global layers, a gate of
    # its own, sigmoid routing), SmolLM3 (NoPE every n-th layer), MiniMax-M2 (full QK-norm)
    "qwen3.5": (
        ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
    ),
    "qwen3.5-moe": (
        ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
    ),
    "trinity": (
        "Afmoe",
        dict(
            num_hidden_layers=4,
            global_attn_every_n_layers=2,
            sliding_window=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=2,
            moe_intermediate_size=16,
            route_scale=2.5,
            mup_enabled=True,
            tie_word_embeddings=True,
        ),
    ),
    "smollm3": (
        "SmolLM3",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=5,
        ),
    ),
    "minimax-m2": (
        "MiniMaxM2",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rotary_dim=4,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    # 2026 KDA hybrids: Kimi Linear (low-rank KDA gates, MLA without RoPE) and Ling's
    # Bailing (full-rank, bounded KDA gates; MLA with RoPE and a gate per head); both
    # with a dense first layer, then grouped sigmoid routing that skips experts
    "kimi-linear": (
        "KimiLinear",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=16,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            linear_num_heads=3,
            linear_head_dim=8,
            linear_conv_kernel_dim=3,
        ),
    ),
    "bailing-hybrid": (
        "BailingHybrid",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,  # the KDA heads' width (linear_head_dim)
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            short_conv_kernel_size=3,
        ),
    ),
    "bailing-hybrid-unbounded-gate": (
        "BailingHybrid",
        dict(
            num_hidden_layers=3,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=12,
            kv_lora_rank=12,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=12,
            v_head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            first_k_dense_replace=0,
            kda_safe_gate=False,
            moe_intermediate_size=12,
        ),
    ),
    # DeepSeek Sparse Attention: each query reads the index_topk = 5 keys its lightning
    # indexer picks (far fewer than the 29 tokens); GLM-5's "shared" layers reuse the
    # selection of the last "full" one. Index scores are sums of ReLUs, so with few
    # indexer heads a score can be exactly 0 for two keys: ties that two top-k
    # implementations may break differently. Enough heads make exact zeros rare.
    "deepseek-v3.2": (
        "DeepseekV32",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            index_topk=5,
            index_n_heads=3,
            index_head_dim=16,
        ),
    ),
    "glm-5": (
        "GlmMoeDsa",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=20,
            qk_rope_head_dim=8,
            qk_nope_head_dim=12,
            v_head_dim=8,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            index_topk=6,
            index_n_heads=8,
            index_head_dim=12,
            indexer_types=["full", "shared", "full", "shared"],
        ),
    ),
}


# families whose norm gains are stored as w and applied as 1 + w
ZERO_CENTRED = ("Qwen3Next", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig")


def make(name: str):
    prefix, kw = FAMILIES[name]
    names = (
        (f"{prefix}Config", f"{prefix}ForCausalLM")
        if isinstance(prefix, str)
        else prefix
    )
    cfg = getattr(transformers, names[0])(
        **{**BASE, **kw}, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    hf = getattr(transformers, names[1])(cfg).eval()
    zero_centred = prefix in ZERO_CENTRED or names[0] in ZERO_CENTRED
    with (
        torch.no_grad()
    ):  # random gains, biases, sinks and balancing biases: wiring shows up
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0.0 if zero_centred else 1.0, 0.2)
            elif n.endswith(("bias", "sinks", "router.gate.weight")):
                p.normal_(0.0, 0.5)  # Trinity's router starts at zero: all ties
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    hf = make(request.param)
    return hf, from_hf(hf)


def _forms(model):
    """The model as it is, and (MLA only) again with the absorbed form."""
    yield "naive"
    if model.cfg.is_mla:
        for block in model.blocks:
            block.attn.form = "absorbed"
        yield "absorbed"
        for block in model.blocks:
            block.attn.form = "naive"


def test_logits_match_past_the_window(pair):
    hf, ours = pair
    x = torch.randint(3, 97, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        for form in _forms(ours):
            got = ours(x)
            assert (got - want).abs().max().item() <= 1e-4, form


def test_cached_greedy_generation_matches(pair):
    hf, ours = pair
    x = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    hf.generation_config.eos_token_id = (
        None  # no early stop and no EOS ban: plain argmax
    )
    with torch.no_grad():
        want = hf.generate(x, max_new_tokens=12, do_sample=False)
    for form in _forms(ours):
        assert torch.equal(ours.generate(x, 12), want), form


def test_expert_and_latent_tensors_are_named_when_wrong():
    hf = make("deepseek-v3")
    cfg = config_from_hf(hf.config)
    sd = convert_state_dict(hf.state_dict(), cfg)
    bad = dict(sd)
    del bad["blocks.1.ffn.experts.gate_up"]
    bad["blocks.2.attn.kv_b_proj.weight"] = torch.zeros(3, 16)
    bad["blocks.0.mlp.experts.extra"] = torch.zeros(1)
    with pytest.raises(ValueError) as err:
        load_state_dict_strict(DecoderLM(cfg), bad)
    msg = str(err.value)
    assert "missing tensors: ['blocks.1.ffn.experts.gate_up']" in msg
    assert "unexpected tensors: ['blocks.0.mlp.experts.extra']" in msg
    assert "blocks.2.attn.kv_b_proj.weight: expected (80, 16), got (3, 16)" in msg


def test_gpt_oss_experts_are_transposed_into_linear_layout():
    hf = make("gpt-oss")
    cfg = config_from_hf(hf.config)
    sd = convert_state_dict(hf.state_dict(), cfg, "GptOssForCausalLM")
    theirs = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]  # (E, d, 2F)
    assert theirs.shape == (4, 48, 32)
    assert torch.equal(sd["blocks.0.ffn.experts.gate_up"], theirs.transpose(1, 2))


def test_unsupported_layouts_are_named():
    kw = dict(FAMILIES["qwen3-moe"][1], decoder_sparse_step=2)
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        config_from_hf(transformers.Qwen3MoeConfig(**{**BASE, **kw}))
    kw = dict(FAMILIES["gpt-oss"][1], swiglu_limit=5.0)
    with pytest.raises(ValueError, match="swiglu_limit/alpha=5.0/1.702"):
        config_from_hf(transformers.GptOssConfig(**{**BASE, **kw}))


def test_padded_batches_are_refused_by_delta_net_layers():
    _, ours = pair.__wrapped__(type("R", (), {"param": "qwen3-next"})())
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(
        ValueError, match="Gated DeltaNet layers take no attention mask"
    ):
        ours(torch.randint(3, 97, (1, 5)), attention_mask=mask)


def test_kda_and_sparse_layers_are_built_where_the_config_says():
    cfg = config_from_hf(make("bailing-hybrid").config)
    assert cfg.layer_types == ("linear", "full") * 2
    assert (cfg.linear.kind, cfg.linear.kda_gate_lower_bound) == ("kda", -5.0)
    assert cfg.mla.output_gate and cfg.moe.dense_layers == 1
    glm = DecoderLM(config_from_hf(make("glm-5").config))
    kinds = [type(b.attn.indexer).__name__ for b in glm.blocks]
    assert kinds == ["LightningIndexer", "SharedIndexer"] * 2
    assert glm.blocks[3].attn.indexer.source is glm.blocks[2].attn.indexer


def test_new_family_options_that_cannot_be_expressed_are_named():
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw = dict(FAMILIES["kimi-linear"][1], mlp_layer_types=["sparse", "dense"] * 2)
    with pytest.raises(ValueError, match="mlp_layer_types=.*only dense layers first"):
        config_from_hf(transformers.KimiLinearConfig(**{**BASE, **kw}, **ids))
    kw = dict(FAMILIES["bailing-hybrid"][1], hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        config_from_hf(transformers.BailingHybridConfig(**{**BASE, **kw}, **ids))
