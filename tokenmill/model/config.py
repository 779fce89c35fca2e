"""Architecture description of a Llama-family checkpoint, read from its own metadata.

Both loaders (GGUF and Hugging Face folders) produce a `ModelConfig`; the model is
built from it alone. Nothing here is guessed from a file name.

The families share one decoder (tokenmill/model/llama.py) and differ by switches read
from their config: Qwen2's qkv bias; Qwen3's norm over each q and k head (QK-norm);
Gemma 3's QK-norm, norms on the attention and MLP outputs, GeGLU, scaled embeddings,
its attention scale (query_pre_attn_scalar) and sliding-window layers with a RoPE base
of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the problem in one line."""


# Architectures that share the Llama block (RMSNorm, RoPE, GQA, gated MLP). Mistral is
# Llama with a different default context and sliding window metadata we do not need
# for the context lengths we serve.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "gemma3"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "dynamic"}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"
_GEMMA3_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' and llama.cpp's defaults


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # -- per-family switches (the Llama defaults) --
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    output_norms: bool = False  # norms on the attention's and the MLP's outputs before each residual add (Gemma)
    hidden_act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_multiplier: float = 1.0  # token embeddings are scaled by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer; () = all FULL
    rope_local_theta: float | None = None  # the RoPE base of sliding layers (None: rope_theta)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.hidden_act not in ACTIVATIONS.values():
            raise ModelLoadError(f"unsupported activation {self.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= {SLIDING, FULL}):
            raise ModelLoadError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                                 f"{self.num_layers} layers")
        if SLIDING in self.layer_types and self.sliding_window < 1:
            raise ModelLoadError("sliding-window layers need a positive sliding_window")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling type {rope_type!r}; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window (the keys a query sees, itself included); 0: all of them."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == SLIDING else 0

    def is_sliding(self, i: int) -> bool:
        return self.layer_window(i) > 0

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        theta, scaling, local_theta = _hf_rope(cfg, arch)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            name=name,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072 if arch == "gemma3" else 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_local_theta=local_theta,
            **_hf_family(cfg, arch, hidden),
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], name: str, has_output_tensor: bool) -> "ModelConfig":
        arch = md.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            return md.get(f"{arch}.{key}", default)

        try:
            heads = int(get("attention.head_count"))
            hidden = int(get("embedding_length"))
            layers = int(get("block_count"))
            ffn = int(get("feed_forward_length"))
        except TypeError as exc:
            raise ModelLoadError(f"GGUF metadata lacks a required {arch}.* hyperparameter") from exc
        vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens") or ())
        if not vocab:
            raise ModelLoadError("GGUF metadata gives no vocabulary size and no token list")
        head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
        scaling = None
        scaling_type = get("rope.scaling.type")
        if scaling_type and scaling_type != "none":
            scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
            orig = get("rope.scaling.original_context_length")
            if orig:
                scaling["original_max_position_embeddings"] = int(orig)
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            name=name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", _GEMMA3_THETA if arch == "gemma3" else 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=arch == "qwen2",
            rope_scaling=scaling,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            **_gguf_family(get, arch, layers, hidden, heads, head_dim),
        )


def _hf_rope(cfg: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' base) from a config.json: the flat
    keys of transformers 4, or transformers 5's rope_parameters (per layer type for
    Gemma 3)."""
    params = dict(cfg.get("rope_parameters") or {})
    local_theta = cfg.get("rope_local_base_freq")
    if FULL in params or SLIDING in params:
        local = params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"unsupported rope scaling {local.get('rope_type')!r} on sliding layers")
        local_theta = local.get("rope_theta", local_theta)
        params = dict(params.get(FULL) or {})
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    theta = cfg.get("rope_theta") or params.get("rope_theta") or (_GEMMA3_THETA if arch == "gemma3" else 10000.0)
    if arch == "gemma3":
        local_theta = float(local_theta or _GEMMA3_LOCAL_THETA)
    return float(theta), scaling, (float(local_theta) if local_theta else None)


def _hf_family(cfg: dict[str, Any], arch: str, hidden: int) -> dict[str, Any]:
    """The switches of Qwen3 and Gemma 3 from their config.json."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch != "gemma3":
        return {}
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelLoadError(f"unsupported Gemma setting {key}={cfg[key]!r} (Gemma 3 has none)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("unsupported Gemma setting use_bidirectional_attention (not a causal decoder)")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:  # configs before layer_types: every n-th layer global
        n = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % n else FULL for i in range(layers)]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}")
    return {"qk_norm": True, "output_norms": True, "hidden_act": ACTIVATIONS[act],
            "embed_multiplier": hidden ** 0.5, "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar"),
            "sliding_window": int(cfg.get("sliding_window") or 0), "layer_types": tuple(types)}


def _gguf_family(get, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """The switches of Qwen3 and Gemma 3 from GGUF metadata (the keys gguf's constants
    name), with llama.cpp's defaults where a file leaves them out."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch != "gemma3":
        return {}
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(key) is not None:
            raise ModelLoadError(f"unsupported Gemma setting {arch}.{key} (Gemma 3 has none)")
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):  # one flag a layer: sliding or not
        types = [SLIDING if flag else FULL for flag in pattern]
    else:  # llama.cpp's rule: layer i slides unless i % n == n - 1
        n = int(pattern)
        types = [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(layers)]
    scale = get("attention.scale")
    # llama.cpp scales by 1/sqrt(head_dim) but for the 62-layer 27B model (hidden/heads)
    scalar = (1.0 / float(scale)) ** 2 if scale else (hidden // heads if layers == 62 else head_dim)
    return {"qk_norm": True, "output_norms": True, "hidden_act": "gelu_tanh",
            "embed_multiplier": hidden ** 0.5, "query_pre_attn_scalar": float(scalar),
            "sliding_window": int(get("attention.sliding_window") or 0), "layer_types": tuple(types),
            "rope_local_theta": float(get("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))}
