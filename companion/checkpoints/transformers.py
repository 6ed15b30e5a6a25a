"""Convert Hugging Face transformers models into ``companion`` models (chapters 05-13).

``from_hf(hf_model)`` reads the config
(:mod:`companion.checkpoints.transformers_config`) and the weights of a transformers
causal LM and returns the equivalent :class:`companion.models.decoder.DecoderLM`, with
the same logits. Weights that have no place in the model, or places with no weight, are
errors that name them.

This module and its config half are the only ones that touch transformers objects, and
they import nothing from transformers itself: they read ``hf_model.config`` and
``hf_model.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from companion.checkpoints.hf_v4 import v4_layer_key
from companion.checkpoints.transformers_config import (
    SUPPORTED,
    architecture,
    config_from_hf,
)
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM

__all__ = ["convert_state_dict", "from_hf", "load_state_dict_strict"]

# HF block norm name -> ours, per placement
_NORM_NAMES = {
    "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
    "sandwich": {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "attn_out_norm",
        "pre_feedforward_layernorm": "ffn_norm",  # Gemma 3
        "post_feedforward_layernorm": "ffn_out_norm",
        "pre_mlp_layernorm": "ffn_norm",  # Trinity
        "post_mlp_layernorm": "ffn_out_norm",
    },
    "post_branch": {
        "post_attention_layernorm": "attn_out_norm",
        "post_feedforward_layernorm": "ffn_out_norm",
    },
}


_MLA_NAMES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.q_a_proj": "attn.q_a_proj",
    "self_attn.q_a_layernorm": "attn.q_a_norm",
    "self_attn.q_b_proj": "attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa": "attn.kv_a_proj",
    "self_attn.kv_a_layernorm": "attn.kv_a_norm",
    "self_attn.kv_b_proj": "attn.kv_b_proj",
}
_DENSE_FFN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MOE_NAMES = {
    "mlp.gate.weight": "ffn.router.weight",  # Qwen3-MoE, DeepSeek-V3, Qwen3-Next
    "mlp.gate.e_score_correction_bias": "ffn.router.selection_bias",
    "mlp.router.weight": "ffn.router.weight",  # gpt-oss
    "mlp.router.bias": "ffn.router.bias",
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up",
    "mlp.experts.down_proj": "ffn.experts.down",
    "mlp.experts.gate_up_proj_bias": "ffn.experts.gate_up_bias",
    "mlp.experts.down_proj_bias": "ffn.experts.down_bias",
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
    "mlp.router.gate.weight": "ffn.router.weight",  # Trinity
    "mlp.expert_bias": "ffn.router.selection_bias",
    "mlp.e_score_correction_bias": "ffn.router.selection_bias",  # MiniMax-M2
}
# gpt-oss stores each expert's matrices as (in, out); ours are (out, in) like nn.Linear
_TRANSPOSED = {
    "GptOssForCausalLM": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
}


def _kda_layer(cfg: ModelConfig, layer: int) -> bool:
    """True if layer ``layer`` is Kimi Delta Attention (its weights under ``self_attn``
    carry our names already)."""
    return (
        cfg.linear is not None
        and cfg.linear.kind == "kda"
        and cfg.layer_types[layer] == "linear"
    )


def _layer_key(rest: str, cfg: ModelConfig, layer: int = 0) -> str | None:
    """Our name (inside ``blocks.i``) of one HF layer tensor, or None if no rule maps
    it. Separate q, k and v projections are fused later, in
    :func:`convert_state_dict`."""
    mod, leaf = rest.rsplit(".", 1)  # e.g. "self_attn.o_proj", "weight"
    if cfg.compression is not None and v4_layer_key(rest) is not None:
        return v4_layer_key(rest)  # DeepSeek-V4: attention, hyper-connections, hash
    if rest.startswith("self_attn.") and _kda_layer(cfg, layer):
        return "attn." + rest.removeprefix("self_attn.")  # KDA: the same names
    if cfg.is_mla and mod in _MLA_NAMES:
        return f"{_MLA_NAMES[mod]}.{leaf}"
    if cfg.is_mla and mod == "self_attn.g_proj":  # Bailing's gate per head
        return f"attn.gate_proj.{leaf}"
    if cfg.is_mla and rest.startswith("self_attn.indexer."):  # DSA: the same names
        return "attn." + rest.removeprefix("self_attn.")
    if mod == "self_attn.o_proj":
        return f"attn.out_proj.{leaf}"
    if mod == "self_attn.gate_proj":  # Trinity's output gate
        return f"attn.gate_proj.{leaf}"
    if mod in ("self_attn.q_norm", "self_attn.k_norm"):
        return f"attn.{mod.split('.')[1]}.{leaf}"
    if rest == "self_attn.sinks":
        return "attn.sinks"
    if rest.startswith("linear_attn."):  # Gated DeltaNet: the same names, one level up
        return "attn." + rest.removeprefix("linear_attn.")
    if cfg.moe is not None and rest in _MOE_NAMES:
        return _MOE_NAMES[rest]
    if mod.startswith("mlp.") and mod.count(".") == 1 and mod[4:] in _DENSE_FFN:
        return f"ffn.{_DENSE_FFN[mod[4:]]}.{leaf}"
    shared, _, proj = mod.rpartition(".")
    if shared in ("mlp.shared_experts", "mlp.shared_expert") and proj in _DENSE_FFN:
        return f"ffn.shared.{_DENSE_FFN[proj]}.{leaf}"
    norm_names = _NORM_NAMES[cfg.norm_placement]
    if mod in norm_names:
        return f"{norm_names[mod]}.{leaf}"
    return None


def _check_tensors(sd: object, name: str) -> None:
    """Raise a TypeError unless ``sd`` maps str keys to tensors, naming every key that
    does not."""
    if not isinstance(sd, Mapping):
        raise TypeError(
            f"{name} must be a mapping of names to tensors, got {type(sd).__name__}"
        )
    bad = [
        f"{k!r} ({type(v).__name__})"
        for k, v in sd.items()
        if not isinstance(k, str) or not isinstance(v, Tensor)
    ]
    if bad:
        raise TypeError(
            f"{name} must map str names to tensors; not a tensor (or not a str name): "
            + ", ".join(bad)
        )


def _check_layer_keys(hf_sd: Mapping[str, Tensor], n_layers: int) -> None:
    """Raise one ValueError naming every ``model.layers.*`` key without a layer index
    in ``0..n_layers-1`` and a tensor name after it."""
    bad = []
    for key in hf_sd:
        parts = key.split(".")
        if parts[:2] != ["model", "layers"]:
            continue
        if len(parts) < 5:
            bad.append(f"{key!r} (expected model.layers.<index>.<module>.<tensor>)")
        elif not parts[2].isdecimal():
            bad.append(f"{key!r} (layer index {parts[2]!r} is not an integer)")
        elif int(parts[2]) >= n_layers:
            bad.append(
                f"{key!r} (layer index {parts[2]} out of range: the config has "
                f"{n_layers} layers, 0..{n_layers - 1})"
            )
    if bad:
        raise ValueError("cannot convert the state dict; bad keys: " + ", ".join(bad))


def _fuse_qkv(i: int, leaf: str, parts: dict[str, Tensor]) -> Tensor:
    """Layer ``i``'s q, k and v projections (``leaf``: weight or bias) as one tensor;
    an error naming them if one is missing or they do not stack."""
    names = {p: f"model.layers.{i}.self_attn.{p}_proj.{leaf}" for p in "qkv"}
    missing = [names[p] for p in "qkv" if p not in parts]
    if missing:
        raise ValueError(f"cannot load weights; missing tensors: {missing}")
    if len({t.shape[1:] for t in parts.values()}) != 1:
        shapes = ", ".join(f"{names[p]} {tuple(parts[p].shape)}" for p in "qkv")
        raise ValueError(
            f"cannot load weights; q, k and v must agree past their first dimension: "
            f"{shapes}"
        )
    return torch.cat([parts["q"], parts["k"], parts["v"]])


def convert_state_dict(
    hf_sd: Mapping[str, Tensor], cfg: ModelConfig, arch: str = ""
) -> dict[str, Tensor]:
    """Rename (and fuse q, k, v of) a transformers state dict into ``companion``'s
    names.

    ``arch`` (e.g. ``"GptOssForCausalLM"``) names layouts that differ by more than
    names. Keys that no rule maps are kept under their own name, so that
    :func:`load_state_dict_strict` reports them as unexpected; a value that is not a
    tensor, or a layer key whose index is not one of the config's layers, is an error
    that names the key.
    """
    _check_tensors(hf_sd, "hf_sd")
    _check_layer_keys(hf_sd, cfg.n_layers)
    transposed = _TRANSPOSED.get(arch, ())
    out: dict[str, Tensor] = {}
    qkv: dict[
        tuple[int, str], dict[str, Tensor]
    ] = {}  # (layer, "weight"|"bias") -> q, k, v
    for key, t in hf_sd.items():
        parts = key.split(".")
        if key == "model.embed_tokens.weight":
            out["tok_emb.weight"] = t
        elif key == "model.norm.weight":
            out["final_norm.weight"] = t
        elif key.startswith("model.hc_head."):  # DeepSeek-V4's last stream collapse
            out[key.removeprefix("model.")] = t
        elif key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = t
        elif parts[:2] == ["model", "layers"] and len(parts) >= 5:
            i, rest = int(parts[2]), ".".join(parts[3:])
            mod, leaf = rest.rsplit(".", 1)
            ours = _layer_key(rest, cfg, i)
            if ours is None and mod in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
            ):
                qkv.setdefault((i, leaf), {})[mod[-6]] = t  # "q", "k" or "v"
            else:
                if rest in transposed and t.dim() == 3:  # else a wrong shape, named
                    t = t.transpose(1, 2)
                out[f"blocks.{i}.{ours}" if ours else key] = t
        else:
            out[key] = t
    for (i, leaf), parts in qkv.items():
        out[f"blocks.{i}.attn.qkv.{leaf}"] = _fuse_qkv(i, leaf, parts)
    if cfg.tie_embeddings and "tok_emb.weight" in out:
        out["lm_head.weight"] = out["tok_emb.weight"]  # one tensor under both names
    return out


def load_state_dict_strict(model: nn.Module, sd: Mapping[str, Tensor]) -> None:
    """Copy ``sd`` into ``model``; raise one error naming every missing, unexpected or
    mis-shaped tensor."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_tensors(sd, "sd")
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    wrong = [
        f"{k}: expected {tuple(own[k].shape)}, got {tuple(sd[k].shape)}"
        for k in sorted(set(own) & set(sd))
        if own[k].shape != sd[k].shape
    ]
    if missing or unexpected or wrong:
        lines = []
        if missing:
            lines.append(f"missing tensors: {missing}")
        if unexpected:
            lines.append(f"unexpected tensors: {unexpected}")
        if wrong:
            lines.append(f"wrong shapes: {wrong}")
        raise ValueError("cannot load weights; " + "; ".join(lines))
    model.load_state_dict(sd, strict=True)


def from_hf(hf_model: nn.Module) -> DecoderLM:
    """The ``companion`` model equivalent to a transformers causal LM (fp32, eval
    mode)."""
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(
            "hf_model must be a transformers model (an nn.Module with a .config), got "
            f"{type(hf_model).__name__}"
        )
    arch, cls = architecture(hf_model.config), type(hf_model)
    if cls.__module__.startswith("transformers.") and cls.__name__ not in SUPPORTED:
        raise ValueError(
            f"hf_model is a {cls.__name__}, not a causal LM companion converts; "
            f"for this config pass {arch} (the model with its language-model head)"
        )
    cfg = config_from_hf(hf_model.config)
    hf_sd = hf_model.state_dict()
    _check_tensors(hf_sd, f"{cls.__name__}.state_dict()")
    if "model.embed_tokens.weight" not in hf_sd:
        raise ValueError(
            f"{cls.__name__}.state_dict() has no 'model.embed_tokens.weight' (keys "
            f"start {sorted(hf_sd)[:3]}): from_hf takes a causal LM laid out as {arch}"
        )
    model = DecoderLM(cfg)
    sd = {k: v.detach().float() for k, v in hf_sd.items()}
    load_state_dict_strict(model, convert_state_dict(sd, cfg, arch))
    return model.eval()
