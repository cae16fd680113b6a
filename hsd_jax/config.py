"""Validated, hashable configs. Hashable so they can be static arguments of `jax.jit`."""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_IMPLS = ("auto", "pallas", "reference", "pallas_tpu", "pallas_triton", "positional")   # pallas_kernels.tree_attention
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class InputError(ValueError):
    """Bad user input to generate (empty prompt, too long for the cache, wrong drafter, ...)."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _coerce(tp, value, where: str):
    """`value` (parsed JSON) as a field of type `tp`, or a ConfigError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _coerce(tp, value, where)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif origin is tuple:
        ok = isinstance(value, (list, tuple))
        if ok:
            return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_json(tp, value, where)
    else:
        ok = True
    if not ok:
        name = "a list" if origin is tuple else getattr(tp, "__name__", str(tp))
        raise ConfigError(f"{where} must be {name}, got {json_repr(value)}")
    return value


def json_repr(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_json(cls, raw, what: str = "config"):
    """`cls(**raw)` for a dataclass config parsed from an untrusted JSON file: every key a field,
    every value of its field's type (ints for int fields, numbers for floats, lists for tuples,
    objects for nested configs), so a damaged file fails here naming the field, never deep in a
    jitted program."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} must be a JSON object, got {json_repr(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ConfigError(f"{what} has unknown fields {unknown}")
    return cls(**{k: _coerce(hints[k], v, f"{what} field {k!r}") for k, v in raw.items()})


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as in Hugging Face configs (`rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _require(self.rope_type in ROPE_TYPES,
                 f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        _require(self.factor > 0, f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            _require(self.high_freq_factor > self.low_freq_factor,
                     "llama3 rope scaling needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None) -> "RopeScaling":
        if not d:
            return cls()
        if not isinstance(d, dict):
            raise ConfigError(f"rope scaling must be a JSON object, got {json_repr(d)}")
        rope_type = d.get("rope_type", d.get("type", "default"))
        kw = {k: d[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings") if k in d}
        return from_json(cls, dict(kw, rope_type=rope_type), "rope scaling")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-family decoder (LLaMA, SmolLM, Qwen2, Qwen3 dense, Mistral without sliding window).

    head_dim may differ from hidden_size / num_heads (Qwen3: 128 with 1024 / 16); qk_norm is Qwen3's
    per-head RMSNorm on q and k (weights [head_dim]) before RoPE."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    feature_layers: tuple[int, ...] = ()
    attention_impl: str = "auto"
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.head_dim is None:
            _require(self.hidden_size % max(self.num_heads, 1) == 0,
                     f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _require(int(getattr(self, name)) > 0, f"{name} must be a positive integer, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _require(self.attention_impl in ATTENTION_IMPLS,
                 f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        for i in self.feature_layers:
            _require(0 <= i < self.num_layers,
                     f"feature layer {i} out of range for a model with {self.num_layers} layers")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How a token is drawn from the target's logits. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _require(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
