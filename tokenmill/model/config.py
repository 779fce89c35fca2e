"""Architecture description of a Llama-family checkpoint, read from its own metadata.

Both loaders (GGUF and Hugging Face folders) produce a `ModelConfig`; the model is
built from it alone. Nothing here is guessed from a file name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the problem in one line."""


# Architectures that share the Llama block (RMSNorm, RoPE, GQA, SwiGLU). Qwen2 adds a
# bias to q/k/v; Mistral is Llama with a different default context and sliding window
# metadata we do not need for the context lengths we serve.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "dynamic"}


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
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
        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope_params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
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
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
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
        head_dim = int(get("rope.dimension_count") or hidden // heads)
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
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=arch == "qwen2",
            rope_scaling=scaling,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
