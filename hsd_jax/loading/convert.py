"""Turn per-layer Hugging Face tensors ([out, in] layout) into the stacked Flax param pytree."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from hsd_jax.config import ModelConfig
from hsd_jax.loading.errors import ModelLoadError
from hsd_jax.models.layers import jnp_dtype

# HF per-layer name -> (Flax path inside a layer, transpose)
LAYER_TENSORS = {
    "input_layernorm.weight": (("input_layernorm", "scale"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), False),
    "self_attn.q_proj.weight": (("q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("o_proj", "kernel"), True),
    "self_attn.q_proj.bias": (("q_proj", "bias"), False),
    "self_attn.k_proj.bias": (("k_proj", "bias"), False),
    "self_attn.v_proj.bias": (("v_proj", "bias"), False),
    "self_attn.q_norm.weight": (("q_norm", "scale"), False),
    "self_attn.k_norm.weight": (("k_norm", "scale"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
    "mlp.gate_proj.bias": (("mlp", "gate_proj", "bias"), False),
    "mlp.up_proj.bias": (("mlp", "up_proj", "bias"), False),
    "mlp.down_proj.bias": (("mlp", "down_proj", "bias"), False),
}


def _top_and_layer_shapes(cfg: ModelConfig) -> tuple[dict, dict]:
    """HF-layout shapes: the tensors outside the layers by HF name, and one layer's by name in the layer."""
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    top = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        top["lm_head.weight"] = (cfg.vocab_size, d)
    layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
             "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
             "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
             "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    if cfg.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.qk_norm:
        layer.update({"self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)})
    if cfg.mlp_bias:
        layer.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)})
    return top, layer


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF-layout shapes of every tensor the config implies, by HF name."""
    top, layer = _top_and_layer_shapes(cfg)
    for i in range(cfg.num_layers):
        top.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return top


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the param tree `build_params` returns, by flat name ("layers/mlp/up_proj/kernel");
    never enumerates the layers (a damaged file may claim billions)."""
    hf, layer = _top_and_layer_shapes(cfg)
    out = {"embed_tokens/embedding": hf["model.embed_tokens.weight"], "norm/scale": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head/kernel"] = hf["lm_head.weight"][::-1]
    for name, (path, transpose) in LAYER_TENSORS.items():
        shape = layer.get(name)
        if shape is not None:
            out["layers/" + "/".join(path)] = (cfg.num_layers,) + (shape[::-1] if transpose else shape)
    return out


def build_params(cfg: ModelConfig, get: Callable[[str], np.ndarray], source: str, host: bool = False,
                 out: dict | None = None) -> dict:
    """Assemble params from `get(hf_name) -> array`, checking every shape against the config.

    host=True keeps them as host numpy arrays, so a mesh can place each slice straight into
    its device (`sharding.shard_params`) without a full copy on one device first. `out`: host
    arrays by flat name (`param_shapes`) to fill and return instead of new ones (a weights-cache
    file's mapping, `weights_cache.create`)."""
    out = out or {}
    dtype = jnp_dtype(cfg)
    asarray = (lambda a, dt: np.asarray(a, dt)) if host else jnp.asarray
    get(f"model.layers.{cfg.num_layers - 1}.input_layernorm.weight")   # a damaged layer count fails here, at once
    shapes = expected_shapes(cfg)

    def fetch(name):
        arr = get(name)
        if tuple(arr.shape) != shapes[name]:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, "
                                 f"but the config implies {shapes[name]}")
        return arr

    layers: dict = {}
    per_layer = [k for k in LAYER_TENSORS if f"model.layers.0.{k}" in shapes]
    for hf_name in per_layer:
        path, transpose = LAYER_TENSORS[hf_name]
        stacked = None
        for i in range(cfg.num_layers):   # each layer copied (and transposed) once, straight into its slot
            arr = fetch(f"model.layers.{i}.{hf_name}")
            arr = arr.T if transpose else arr
            if stacked is None:
                stacked = out.get("layers/" + "/".join(path))
                stacked = np.empty((cfg.num_layers,) + arr.shape, arr.dtype) if stacked is None else stacked
            stacked[i] = arr
        node = layers
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = asarray(stacked, dtype)

    def whole(name: str, hf_name: str, transpose: bool = False):
        arr = fetch(hf_name)
        arr = arr.T if transpose else arr
        if name in out:
            np.copyto(out[name], arr)
            arr = out[name]
        return asarray(arr, dtype)

    params = {
        "embed_tokens": {"embedding": whole("embed_tokens/embedding", "model.embed_tokens.weight")},
        "layers": layers,
        "norm": {"scale": whole("norm/scale", "model.norm.weight")},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": whole("lm_head/kernel", "lm_head.weight", transpose=True)}
    return params
