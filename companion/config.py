"""The model configuration: one typed dataclass that checks itself (chapters 02, 03, 13).

Later chapters add fields (RoPE, RMSNorm, GQA, experts...). Each field's allowed values
live next to it in ``_CHOICES`` or in a check in ``_validate``, so an error always names
the field, what it got, and what it accepts. Derived values are properties; ``__post_init__``
never rewrites what the user set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

__all__ = ["ConfigError", "ModelConfig", "check_token_ids"]


class ConfigError(ValueError):
    """A config field holds a value the model cannot be built from."""


# field name -> allowed values, for every field whose value is a choice
_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": ("layernorm", "rmsnorm"),
    "norm_placement": ("pre", "post", "sandwich", "post_branch"),
    "activation": ("relu", "gelu", "gelu_tanh", "silu"),
    "ffn": ("mlp", "glu"),
    "position": ("sinusoidal", "learned", "rope", "none"),
    "rope_layout": ("half", "interleaved"),
    "qk_norm": ("none", "head", "full"),
    "attn_impl": ("reference", "sdpa", "tiled", "flex"),
    "router": ("softmax", "sigmoid"),
    "expert_kind": ("glu", "gpt_oss"),
    "mla_form": ("naive", "absorbed"),
}
LAYER_TYPES = ("full", "sliding", "linear")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Transformer: the 2017 block by default, a 2026 one by choice.

    Shapes are named in the chapters as: V ``vocab_size``, d ``d_model``, L ``n_layers``,
    H ``n_heads``, H_kv ``n_kv_heads``, D ``head_dim``, d_ff ``d_ff``, S_max ``max_seq_len``.

    Placements (chapter 06): ``pre`` x + f(norm(x)); ``post`` norm(x + f(x)) (2017);
    ``sandwich`` x + norm(f(norm(x))) (Gemma); ``post_branch`` x + norm(f(x)) (Olmo 2/3).
    ``qk_norm``: ``head`` normalises each head's q and k (Qwen3, Gemma 3), ``full`` the whole
    q and k projections (Olmo). ``layer_types`` gives each layer ``"full"`` or ``"sliding"``
    attention; sliding layers see the last ``sliding_window`` keys (the query's own included)
    and use ``rope_local_theta`` when set (Gemma 3). ``nope_layers`` skip RoPE.
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None  # None: 4 * d_model, as in 2017
    max_seq_len: int = 256
    dropout: float = 0.0
    attn_dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    activation: str = "gelu"
    position: str = "learned"
    attn_impl: str = "sdpa"
    fused_qkv: bool = True
    bias: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by √d, as in 2017
    init_std: float = 0.02
    # --- the modern dense block (chapters 05-09) ---
    n_kv_heads: int | None = None  # None: n_heads (MHA); 1: MQA; in between: GQA
    head_size: int | None = None  # None: d_model // n_heads
    ffn: str = "mlp"
    qkv_bias: bool | None = None  # None: same as `bias`
    norm_offset: float = 0.0  # 1.0: RMSNorm gain stored as 1 + w (Gemma)
    qk_norm: str = "none"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"dynamic"|"yarn"|"llama3", ...}
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    rope_layout: str = "half"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # None: all "full" ("sliding" if a window is set)
    nope_layers: tuple[int, ...] = ()
    attn_scale: float | None = None  # None: 1 / √head_dim
    # --- experts, latent attention, sinks, gates, linear attention (chapters 10-13) ---
    n_experts: int = 0  # routed experts per MoE layer; 0: every FFN is dense
    experts_per_token: int = 0  # k of the top-k routing
    expert_d_ff: int | None = None  # hidden width of one routed expert (None: d_ff)
    expert_kind: str = "glu"  # "gpt_oss": biased experts with the clamped SwiGLU
    dense_layers: int = 0  # the first N layers keep a dense FFN of width d_ff (DeepSeek-V3)
    shared_d_ff: int = 0  # hidden width of the always-on shared expert; 0: none
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert (Qwen3-Next)
    router: str = "softmax"  # how expert scores are made from the router logits
    router_norm_topk: bool = True  # renormalise the k chosen weights to sum to 1
    router_groups: int = 1  # DeepSeek-V3's group-limited routing: experts in G groups...
    router_topk_groups: int = 1  # ...of which the best few are searched for the top-k
    router_scale: float = 1.0  # routed_scaling_factor: multiplies the routed weights
    router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    router_selection_bias: bool = False  # DeepSeek-V3's balancing bias: a buffer, selection only
    kv_lora_rank: int = 0  # > 0: multi-head latent attention with this latent width
    q_lora_rank: int = 0  # > 0 (with MLA): queries through a low-rank latent too
    qk_nope_head_dim: int = 0  # MLA: per-head query/key width without RoPE
    qk_rope_head_dim: int = 0  # MLA: width of the decoupled RoPE query/key
    v_head_dim: int = 0  # MLA: per-head value width
    mla_form: str = "naive"  # "absorbed": W_UK folded into q, W_UV into the output
    attn_sinks: bool = False  # a learned per-head logit in the softmax denominator (gpt-oss)
    attn_output_gate: bool = False  # sigmoid gate on each head's output (Qwen3-Next)
    linear_key_heads: int = 0  # Gated DeltaNet ("linear" layers): query/key heads
    linear_value_heads: int = 0  # ... value heads (a multiple of the key heads)
    linear_key_dim: int = 0  # ... width of one query/key head
    linear_value_dim: int = 0  # ... width of one value head
    linear_conv_kernel: int = 4  # ... the short causal convolution's width

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def head_dim(self) -> int:
        """The width D of one head (``head_size`` if given, else d / H)."""
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads

    @property
    def is_mla(self) -> bool:
        """True if attention is multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """The width of one head's query and key (D, or nope + rope under MLA)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The channels per head that RoPE's tables are built for (under MLA, the RoPE part)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def moe_d_ff(self) -> int:
        """The hidden width of one routed expert."""
        return self.expert_d_ff if self.expert_d_ff is not None else self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """True if layer ``layer`` routes its FFN through experts."""
        return self.n_experts > 0 and layer >= self.dense_layers

    @property
    def kv_heads(self) -> int:
        """The number H_kv of key/value heads."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def attn_bias(self) -> bool:
        """True if the q, k and v projections carry biases."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The token mixer of each layer, ``"full"``, ``"sliding"`` or ``"linear"``."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return ("sliding" if self.sliding_window else "full",) * self.n_layers

    @property
    def ffn_dim(self) -> int:
        """The FFN's hidden width, ``d_ff`` if given, else 4·d."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {self.field_names()}")
        return ModelConfig(**{**asdict(self), **changes})

    @classmethod
    def field_names(cls) -> list[str]:
        """All field names, for error messages and docs."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        """Build from a plain dict, rejecting keys that are not fields."""
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {cls.field_names()}")
        return cls(**data)  # type: ignore[arg-type]


def _positive_int(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _probability(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1), got {value!r}")


def _validate(cfg: ModelConfig) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
        _positive_int(cfg, name)
    if cfg.d_ff is not None:
        _positive_int(cfg, "d_ff")
    for name in ("dropout", "attn_dropout"):
        _probability(cfg, name)
    for name, allowed in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")
    if cfg.qkv_bias is not None and not isinstance(cfg.qkv_bias, bool):
        raise ConfigError(f"qkv_bias must be None, True or False, got {cfg.qkv_bias!r}")
    for name in ("fused_qkv", "bias", "tie_embeddings", "scale_embeddings"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(cfg, name)!r}")
    if cfg.head_size is not None:
        _positive_int(cfg, "head_size")
    elif cfg.d_model % cfg.n_heads != 0:
        divisors = [h for h in range(1, cfg.d_model + 1) if cfg.d_model % h == 0][:12]
        raise ConfigError(
            f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}); "
            f"n_heads values that divide it: {divisors}"
        )
    if cfg.n_kv_heads is not None:
        _positive_int(cfg, "n_kv_heads")
        if cfg.n_heads % cfg.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})"
            )
    if cfg.sliding_window is not None:
        _positive_int(cfg, "sliding_window")
    if cfg.layer_types is not None:
        if len(cfg.layer_types) != cfg.n_layers:
            raise ConfigError(
                f"layer_types has {len(cfg.layer_types)} entries but n_layers is {cfg.n_layers}"
            )
        bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad}")
        if "sliding" in cfg.layer_types and cfg.sliding_window is None:
            raise ConfigError("layer_types has 'sliding' layers but sliding_window is None")
        if "linear" in cfg.layer_types:
            _validate_linear(cfg)
    bad_layers = [i for i in cfg.nope_layers if not 0 <= i < cfg.n_layers]
    if bad_layers:
        raise ConfigError(
            f"nope_layers must be layer indices in [0, {cfg.n_layers}), got {bad_layers}"
        )
    _validate_moe(cfg)
    _validate_mla(cfg)
    if cfg.position == "rope":
        from .rope import rope_frequencies

        try:
            rope_frequencies(
                cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor
            )
        except ValueError as err:
            raise ConfigError(f"rope settings: {err}") from None
    if not (isinstance(cfg.norm_eps, (int, float)) and cfg.norm_eps > 0):
        raise ConfigError(f"norm_eps must be a positive number, got {cfg.norm_eps!r}")
    if not (isinstance(cfg.init_std, (int, float)) and cfg.init_std > 0):
        raise ConfigError(f"init_std must be a positive number, got {cfg.init_std!r}")


def _non_negative_int(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


def _validate_moe(cfg: ModelConfig) -> None:
    for name in ("n_experts", "experts_per_token", "dense_layers", "shared_d_ff"):
        _non_negative_int(cfg, name)
    for name in (
        "shared_expert_gate",
        "router_norm_topk",
        "router_bias",
        "router_selection_bias",
        "attn_sinks",
        "attn_output_gate",
    ):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(cfg, name)!r}")
    if cfg.n_experts == 0:
        return
    if not 1 <= cfg.experts_per_token <= cfg.n_experts:
        raise ConfigError(
            f"experts_per_token must be in [1, n_experts={cfg.n_experts}], "
            f"got {cfg.experts_per_token}"
        )
    if cfg.expert_d_ff is not None:
        _positive_int(cfg, "expert_d_ff")
    for name in ("router_groups", "router_topk_groups"):
        _positive_int(cfg, name)
    if cfg.n_experts % cfg.router_groups != 0:
        raise ConfigError(
            f"n_experts ({cfg.n_experts}) must be a multiple of router_groups ({cfg.router_groups})"
        )
    if cfg.router_topk_groups > cfg.router_groups:
        raise ConfigError(
            f"router_topk_groups ({cfg.router_topk_groups}) must be <= router_groups "
            f"({cfg.router_groups})"
        )
    per_group = cfg.n_experts // cfg.router_groups
    if cfg.router_groups > 1 and (
        per_group < 2 or cfg.experts_per_token > cfg.router_topk_groups * per_group
    ):
        raise ConfigError(
            f"group-limited routing needs >= 2 experts per group and experts_per_token <= "
            f"router_topk_groups * n_experts / router_groups; got n_experts={cfg.n_experts}, "
            f"router_groups={cfg.router_groups}, router_topk_groups={cfg.router_topk_groups}, "
            f"experts_per_token={cfg.experts_per_token}"
        )
    if cfg.shared_expert_gate and cfg.shared_d_ff == 0:
        raise ConfigError("shared_expert_gate needs a shared expert: set shared_d_ff > 0")


def _validate_mla(cfg: ModelConfig) -> None:
    for name in (
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    ):
        _non_negative_int(cfg, name)
    if not cfg.is_mla:
        if cfg.q_lora_rank:
            raise ConfigError("q_lora_rank needs multi-head latent attention: set kv_lora_rank")
        return
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _positive_int(cfg, name)
    if cfg.position != "rope":
        raise ConfigError(
            f"multi-head latent attention needs position='rope', got {cfg.position!r}"
        )


def _validate_linear(cfg: ModelConfig) -> None:
    for name in (
        "linear_key_heads",
        "linear_value_heads",
        "linear_key_dim",
        "linear_value_dim",
        "linear_conv_kernel",
    ):
        try:
            _positive_int(cfg, name)
        except ConfigError as err:
            raise ConfigError(f"layer_types has 'linear' layers: {err}") from None
    if cfg.linear_value_heads % cfg.linear_key_heads != 0:
        raise ConfigError(
            f"linear_value_heads ({cfg.linear_value_heads}) must be a multiple of "
            f"linear_key_heads ({cfg.linear_key_heads})"
        )


def check_token_ids(
    ids: torch.Tensor, name: str, vocab_size: int, max_len: int, start: int = 0
) -> None:
    """Raise a ValueError naming ``name`` if ``ids`` is not a (B, T) integer tensor of ids in
    [0, vocab_size) whose last position (``start`` + T) fits in ``max_len``."""
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 or int32 token ids, got {ids.dtype}")
    t = start + ids.shape[1]
    if t > max_len:
        raise ValueError(
            f"{name} reaches {t} tokens but the model's context is max_seq_len={max_len}; "
            "shorten the prompt"
        )
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"{name} ids must lie in [0, vocab_size={vocab_size}), got ids in "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
