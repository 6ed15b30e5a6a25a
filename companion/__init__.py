"""companion: the runnable code behind the book "The Transformer, 2017 → 2026".

The package is layered, each layer importing only the ones before it:

- the base: ``device``, ``numerics``, ``checks``, ``plotting``, ``training``, ``data_parallel``;
- :mod:`companion.kernels`: Triton kernels for the fast paths (the ``gpu`` extra);
- :mod:`companion.ops`: functions on tensors (attention forms, masks, RoPE, linear
  attention);
- :mod:`companion.layers`: modules (attention, FFNs, experts, norms, caches, the block);
- :mod:`companion.models`: the config, the builders and whole models, generation;
- :mod:`companion.checkpoints`: real weights (transformers, SmolLM2, MiniLM);
- :mod:`companion.tasks`: data and synthetic tasks;
- :mod:`companion.analysis`: the calculator, decode cost, diagnostics, scaling fits;
- ``companion.bench``: the benchmarks (``python -m companion.bench``).

Each module opens with the chapter that explains it. Every public name is also
importable from here (``from companion import ModelConfig, DecoderLM, from_hf``), except
the few names two modules share (IMPLS), which live in their modules. Importing the
package loads nothing else: names are imported on first use, so ``from
companion.numerics import pin_cpu_path`` can run before torch loads.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# module -> the public names it defines (its __all__; a test checks the table is complete)
_MODULES: dict[str, tuple[str, ...]] = {
    "analysis.calculator": (
        "attention_layer_params", "COMPONENTS", "count_params", "dense_ffn_params",
        "flops_per_token", "ParamCount", "Tally", "tally_moe",
    ),
    "analysis.cache_size": ("check_config", "kv_cache_bytes", "kv_cache_bytes_per_token"),
    "analysis.mixer_params": (
        "compressed_attention_flops", "compressed_attention_params", "compressed_bytes_per_token",
        "compressed_cache_bytes", "gated_deltanet_params", "hyper_connection_params",
        "indexer_params", "kimi_delta_params", "latent_attention_params", "own_indexer",
    ),
    "analysis.calculator_dials": (
        "ABSENT_VALUES", "DIAL_CHOICES", "DIAL_FIELDS", "DIALS", "FLOAT_DIALS", "GROUP_DIALS",
        "GROUP_SWITCHES", "PATTERNS", "USAGE",
    ),
    "analysis.calculator_page": (
        "calculator_html", "config_from_dials", "dial_values", "layer_period", "PAGE_PRESETS",
        "undialled",
    ),
    "analysis.decode_cost": (
        "arithmetic_intensity", "attainable_flops", "attended_pairs", "decode_attention_bytes",
        "decode_attention_flops", "max_context_tokens", "projected_tokens", "ridge_point",
    ),
    "analysis.expert_traffic": ("all_to_all_bytes", "moe_layers", "rank_load", "traffic_matrix"),
    "analysis.diagrams": (
        "block_diagram", "block_parts", "changed_parts", "COLORS", "end_parts", "layer_groups",
        "model_diagram", "Part",
    ),
    "analysis.diagnostics": (
        "attention_logit_max", "AttentionLogitTracker", "block_grad_norms", "capture_stream",
        "identity_path_jacobian", "IdentityPath", "LayerTracker", "residual_norms",
        "residual_write_weights", "stream_states", "StreamTracker", "token_cosine",
    ),
    "analysis.extrapolation": (
        "ntk_theta", "per_position_loss", "per_position_loss_scaled", "position_config",
        "rope_scaling_for", "rope_used_per_layer", "same_weights", "SCALING_METHODS",
        "train_short", "with_rope",
    ),
    "analysis.phases": (
        "decode_step_cost", "latent_attention_flops", "meta_model", "phase_cost", "PhaseCost",
        "prefill_cost",
    ),
    "analysis.op_counts": ("count_aten_ops", "count_reductions", "REDUCTIONS"),
    "analysis.peak_memory": ("PeakMemory",),
    "analysis.receptive_fields": (
        "input_gradient_norms", "layer_masks", "receptive_field_size", "receptive_fields",
        "visible_pairs",
    ),
    "analysis.seeds": ("compare", "Difference", "difference", "Spread", "spread", "t_quantile"),
    "analysis.scaling": (
        "CHINCHILLA_FIT", "chinchilla_tokens", "CHINCHILLA_TOKENS_PER_PARAM", "ChinchillaLoss",
        "compute_optimal", "count_flops", "dense_flops_per_token", "fit_isoflop", "fit_power_law",
        "IsoFLOPFit", "kaplan_flops_per_token", "PowerLaw", "span_exact_match", "training_compute",
        "training_flops_per_token",
    ),
    "analysis.family_2018": (
        "bert_hf_config", "corrupt_spans", "exact_params", "FAMILY", "family_rows", "Member",
        "pooler_params", "random_spans",
    ),
    "checkpoints.minilm": (
        "bert_config", "bert_name_map", "BertTokenizer", "convert_bert_state_dict", "embed",
        "load_minilm", "model_dir", "PACKAGE", "WeightConversionError",
    ),
    "checkpoints.smollm2": (
        "GGUFTokenizer", "load_smollm2", "read_gguf", "smollm2_path", "state_dict_from_gguf",
        "read_gguf_blocks", "unpermute_qk",
    ),
    "checkpoints.transformers": ("convert_state_dict", "from_hf", "load_state_dict_strict"),
    "checkpoints.hf_families": ("FAMILIES", "Family"),
    "checkpoints.hf_latent_families": ("LATENT_FAMILIES",),
    "checkpoints.hf_v4": ("deepseek_v4", "V4_NAMES", "v4_layer_key"),
    "checkpoints.hf_reader": ("ConfigReader", "REQUIRED"),
    "checkpoints.transformers_config": ("architecture", "config_from_hf", "SUPPORTED"),
    "checks": (
        "check_choice", "check_id_list", "check_int", "check_number", "check_positive",
        "check_targets", "check_text", "DISTRIBUTION", "read_checked", "require",
    ),
    "kernels": ("check_triton", "interpret_on_cpu", "interpreting", "triton_available"),
    "kernels.flash_attention": (
        "block_sizes", "flash_attention", "flash_forward", "forward_kernel_source",
    ),
    "kernels.flash_attention_bwd": ("flash_backward",),
    "kernels.rms_norm": ("add_rms_norm",),
    "kernels.gated_delta": ("gated_delta_chunks", "kernel_sources"),
    "ops.delta_rule_triton": ("chunk_gated_delta_rule_triton",),
    "device": ("bf16_supported", "default_device", "default_dtype", "describe"),
    "data_parallel": (
        "DataParallelHistory", "global_mean", "setup_process_group", "shard_batch",
        "train_data_parallel",
    ),
    "layers.additive_attention": ("AdditiveAttention", "AttentionSeq2Seq", "reversal_task"),
    "layers.block": ("PLACEMENTS", "TransformerBlock"),
    "layers.deepnorm": ("deepnorm_", "deepnorm_constants", "DeepNormResidual"),
    "layers.conv": ("CausalConvStack", "dilations"),
    "layers.embedding": ("embed_tokens", "embedding_params", "normal_init"),
    "layers.ffn": (
        "ACTIVATIONS", "FeedForward", "FFN_FORMS", "GatedFeedForward", "glu_hidden_size",
        "relu_squared",
    ),
    "layers.compressed_attention": (
        "CompressedAttention", "convert_hf_state_dict", "GroupedLinear", "HF_LAYER_TYPES", "KINDS",
    ),
    "layers.gated_deltanet": (
        "GATE_FUNCTIONS", "GatedDeltaNet", "GatedDeltaNetCache", "GatedRMSNorm", "PROJECTIONS",
    ),
    "layers.hyper_connections": (
        "collapse_streams", "collapse_streams_reference", "expand_streams", "HYPER_IMPLS",
        "hyper_step", "hyper_step_reference", "HyperConnection", "HyperHead", "sinkhorn",
        "sinkhorn_reference",
    ),
    "layers.kimi_delta": ("KDA_LAYOUTS", "KDAForgetGate", "KimiDeltaAttention"),
    "layers.kv_cache": (
        "attention_mask", "IndexKeyCache", "KVCache", "LatentCache", "position_mask",
        "query_positions", "SlidingWindowCache", "SparseLatentCache",
    ),
    "layers.page_pool": ("CacheFootprint", "cache_footprint", "PagePool", "pages_needed"),
    "layers.paged_cache": (
        "fork_cache", "paged", "PagedKVCache", "PagedLatentCache", "PageTable", "release_cache",
    ),
    "layers.lightning_indexer": (
        "check_indexer", "DSAIndexer", "key_mask", "LightningIndexer", "SharedIndexer",
    ),
    "layers.kv_quant": (
        "dequantize_rows", "FORMATS", "quantize_cache", "quantize_rows", "QuantizedKVCache",
        "QuantizedLatentCache", "QuantizedSlidingWindowCache", "SCALE_BYTES", "stored_bytes",
    ),
    "layers.weight_quant": (
        "block_matvec", "BLOCK_FORMATS", "BlockLinear", "dequantize_blocks", "int8_matvec",
        "Int8Linear", "quantize_linears", "stored_weight_bytes",
    ),
    "layers.v4_cache": ("CompressedAttentionCache", "CompressorState"),
    "layers.v4_compressor": ("Compressor", "rope_tail"),
    "layers.v4_indexer": ("index_scores", "Indexer", "top_k_mask"),
    "layers.mha": ("GATE_LAYOUTS", "MultiHeadAttention", "QK_NORMS"),
    "layers.alibi": ("ALIBI_IMPLS", "alibi_bias", "alibi_slopes", "biased_attention"),
    "layers.expert_parallel": (
        "AllToAll", "all_to_all", "exchange_counts", "ExpertParallelMoE", "Traffic",
    ),
    "layers.gated_mla": ("HeadGatedLatentAttention",),
    "layers.mla": ("bytes_per_token", "FORMS", "MultiHeadLatentAttention", "softmax_scale"),
    "layers.moe": (
        "ClampedGatedFeedForward", "EXPERT_KINDS", "GLUExperts", "GptOssExperts", "MoEFeedForward",
        "ROUTINGS",
    ),
    "layers.norms": (
        "build_norm", "DyT", "layer_norm_reference", "LayerNorm", "NORMS", "rms_norm_reference",
        "RMSNorm",
    ),
    "layers.positions": (
        "LearnedPositions", "POSITIONS", "sinusoid_shift_matrix", "sinusoidal_table",
        "SinusoidalPositions",
    ),
    "layers.rnn": (
        "autograd_depth", "distant_recall", "GRU", "gru_cell", "LSTM", "lstm_cell", "RecurrentLM",
        "RNN", "rnn_cell",
    ),
    "layers.recording": ("recorded_inputs",),
    "layers.rotary": ("RotaryEmbedding",),
    "layers.router": (
        "check_routing", "HashRouter", "load_balancing_loss", "Routing", "SCORINGS", "TopKRouter",
        "update_selection_bias",
    ),
    "models.beam_search": (
        "beam_search", "Decoded", "EncoderDecoder", "greedy_decode", "length_penalty",
    ),
    "models.builders": (
        "build_block", "build_blocks", "build_ffn", "build_mixer", "build_norms",
        "rotary_embedding",
    ),
    "models.config": ("CHOICES", "ModelConfig"),
    "models.v4_builders": ("compressed_attention", "hyper_connections"),
    "models.config_streams": (
        "CompressedAttentionConfig", "HyperConnectionConfig", "validate_streams",
    ),
    "models.config_parts": (
        "changed_fields", "ConfigError", "ConfigPart", "LinearAttentionConfig", "MLAConfig",
        "MoEConfig", "SparseConfig",
    ),
    "models.decoder": ("DecodeCache", "DecoderLM"),
    "models.encoder": (
        "Encoder", "IGNORE_INDEX", "mask_tokens", "mean_pool", "mlm_loss", "MLMHead",
    ),
    "models.generation": (
        "check_generation_args", "decode_n_tokens", "decode_one_token", "generate", "prefill",
        "sample",
    ),
    "models.mtp": ("mtp_losses", "MTPModule", "trunk_forward"),
    "models.speculative": (
        "accept_or_resample", "check_rollback", "Drafter", "expected_tokens_per_step",
        "MTPDrafter", "PromptLookupDrafter", "speculative_generate", "SpeculativeResult",
        "target_probs",
    ),
    "models.presets": (
        "SOURCES", "Source", "GLU_NAMES", "head_sharing", "preset", "PRESETS", "rope_base",
        "spec_row", "tiny",
    ),
    "models.seq2seq": (
        "base_param_breakdown", "PAPER_BASE_PARAMS", "Seq2SeqTransformer",
        "transformer_base_config",
    ),
    "models.inputs": ("check_mask", "check_token_ids"),
    "models.validation": ("LAYER_TYPES", "validate", "validate_rope"),
    "numerics": ("applies", "pin_cpu_path", "PINNED_ENV", "pinned_path", "read_path", "THREADS"),
    "ops.attention": (
        "attention_weights", "check_qkv", "full_mask", "masked_scores", "naive_attention",
        "sdpa_attention",
    ),
    "ops.cross_entropy": (
        "chunked_cross_entropy", "ChunkedCrossEntropy", "logits_bytes", "naive_cross_entropy",
    ),
    "ops.delta_rule": (
        "chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "delta_rule_chunks",
        "delta_rule_loop", "recurrent_delta_rule", "recurrent_gated_delta_rule", "recurrent_kda",
    ),
    "ops.sparse_attention": (
        "gather_sparse_attention", "masked_sparse_attention", "selection_mask", "sparse_attention",
        "SPARSE_IMPLS",
    ),
    "ops.compressed_attention": (
        "blocked_compress", "check_compress", "naive_compress", "visible_entries",
    ),
    "ops.dispatch": ("attention",),
    "ops.experts": (
        "ContiguousGrad", "EXPERT_FORMS", "EXPERT_IMPLS", "expert_load", "experts_grouped",
        "experts_reference", "gpt_oss_glu", "GROUPED_KERNELS", "grouped_matmul",
        "grouped_mm_available", "swiglu", "swiglu_clamped",
    ),
    "ops.flex": ("available", "causal_window_block_mask", "flex_attention_forward"),
    "ops.grouped": ("expand_kv", "grouped_attention"),
    "ops.linear_attention": (
        "check_chunk_size", "check_linear_inputs", "chunk_linear_attention", "GATE_RANGES",
        "heads_first", "heads_last", "inv_l2norm", "l2norm", "parallel_linear_attention",
        "recurrent_linear_attention", "split_chunks",
    ),
    "ops.masks": ("causal_mask", "combine_masks", "guard_empty_rows", "padding_mask"),
    "ops.matvec": ("matvec", "OneRowLinears"),
    "ops.rope": (
        "apply_rope", "apply_rope_reference", "base_inv_freq", "dynamic_ntk_theta", "LAYOUTS",
        "llama3_inv_freq", "rope_cos_sin", "rope_frequencies", "ROPE_TYPES", "RopeScaling",
        "yarn_inv_freq", "yarn_mscale",
    ),
    "ops.softcap": ("soft_cap", "z_loss"),
    "ops.sinks": (
        "check_sinks", "sink_as_key", "sink_attention_weights", "sink_naive_attention",
        "sink_sdpa_attention",
    ),
    "ops.tiled": (
        "key_tiles", "online_softmax_trace", "tile_scores", "tile_setup", "tiled_attention",
        "tiled_attention_forward",
    ),
    "plotting": ("animate", "glue", "heatmap", "loglog_fit", "PALETTE", "use_style"),
    "tasks.icl_regression": (
        "best_gd_lr", "effective_step", "gd_construction", "gd_step_prediction",
        "least_squares_prediction", "LinearSelfAttention", "regression_prompts", "train_icl_layer",
    ),
    "tasks.induction": (
        "AttentionOnlyLM", "induction_targets", "prefix_matching_score", "repeated_segments",
    ),
    "tasks.products": (
        "exact_product_glu", "mse", "product_surface", "product_task", "RegressionHistory",
        "train_regression",
    ),
    "tasks.probes": (
        "accuracy", "fit", "induction_copy", "memorisation", "memorisation_table", "mqar",
        "mqar_vocab", "needle", "needle_vocab", "position_accuracy", "scored_loss",
    ),
    "tasks.recall": ("recall_pairs", "recall_read", "recall_scores", "RULES"),
    "tasks.sentiment": (
        "fit_linear_probe", "LABELS", "LinearProbe", "load_sentiment", "prompt_label_scores",
        "split_pairs",
    ),
    "tasks.synthetic": ("IGNORE",),
    "tasks.text": (
        "BPETokenizer", "CharTokenizer", "load_bpe", "load_shakespeare", "sample_windows",
        "split_tokens", "train_bpe",
    ),
    "tasks.translation": (
        "aligned_words", "BOS", "EOS", "number_to_words", "NumberTranslation", "NumberVocab",
        "PAD", "TranslationBatch",
    ),
    "training": (
        "cosine_lr", "evaluate", "History", "inverse_sqrt_lr", "label_smoothed_cross_entropy",
        "lm_loss", "make_adamw", "portable_adam", "progress", "seed_everything", "train",
    ),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'companion' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
