"""Load a Hugging Face model directory (config.json + safetensors, single or sharded)."""
from __future__ import annotations

import json
import os

import numpy as np

from hsd_jax.config import ConfigError, ModelConfig, RopeScaling, from_json, json_repr
from hsd_jax.loading.convert import build_params
from hsd_jax.loading.errors import ModelLoadError, reading

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# safetensors dtypes a weight may have; an integer or boolean tensor is a damaged or foreign file
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def read_json(path: str, error=ModelLoadError) -> dict:
    """A JSON object from an untrusted file (config.json, an index, drafter.json, ...)."""
    if not os.path.isfile(path):
        raise error(f"missing file: {path}")
    with reading(path, "not valid JSON", error):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    if not isinstance(d, dict):
        raise error(f"{path}: not a JSON object")
    return d


def open_safetensors(path: str):
    """A safetensors file opened for reading; its header (JSON, offsets, the file covered exactly)
    is checked here, so damage never surfaces while tensors are read."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ModelLoadError(f"missing safetensors file: {path}")
    with reading(path, "not a valid safetensors file"):
        return safe_open(path, framework="numpy")


def read_tensor(handle, path: str, name: str) -> np.ndarray:
    """Tensor `name` of an `open_safetensors` file as float32, refusing non-float tensors."""
    with reading(path, f"tensor {name} unreadable"):
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name} has dtype {dtype}; weights are one of {', '.join(FLOAT_DTYPES)}")
        if dtype == "BF16":   # numpy has no bfloat16: read through JAX
            from safetensors import safe_open

            return np.asarray(safe_open(path, framework="flax").get_tensor(name).astype("float32"))
        return np.asarray(handle.get_tensor(name), np.float32)


def token_ids(value) -> tuple[int, ...]:
    """An `eos_token_id` field (one id, a list or null) as a tuple."""
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)


def generation_eos(path: str) -> tuple[int, ...]:
    """EOS ids of generation_config.json, when the directory has one (chat models list the end-of-turn
    token there, e.g. Qwen3's <|im_end|> and <|endoftext|>)."""
    gen = os.path.join(path, "generation_config.json")
    return token_ids(read_json(gen).get("eos_token_id")) if os.path.isfile(gen) else ()


def hf_config(d: dict, source: str, **overrides) -> ModelConfig:
    """ModelConfig from a parsed HF config.json; refuses architectures we do not implement."""
    mtype = d.get("model_type")
    if mtype in MOE_MODEL_TYPES:
        raise ModelLoadError(f"{source}: model_type {mtype!r} is a mixture-of-experts model, which is not "
                             f"supported; supported (dense): {', '.join(SUPPORTED_MODEL_TYPES)}")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{source}: unsupported model_type {mtype!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if mtype in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: sliding-window attention is not supported "
                             "(config.json has use_sliding_window: true)")
    windowed = [t for t in d.get("layer_types") or () if t != "full_attention"]
    if windowed:
        raise ModelLoadError(f"{source}: only full attention is supported, config.json's layer_types "
                             f"has {windowed[0]!r}")
    try:
        rope = RopeScaling.from_hf(d.get("rope_parameters") or d.get("rope_scaling"))
        theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        eos = list(token_ids(d.get("eos_token_id")))
        return from_json(ModelConfig, dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            rope_theta=theta,
            rope_scaling=rope,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=True if mtype == "qwen2" else d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
            qk_norm=mtype == "qwen3",
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            **overrides,
        ), "config.json")
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks the field {e.args[0]!r}") from None
    except (ConfigError, AttributeError) as e:
        raise ModelLoadError(f"{source}: {e}") from None


def has_pickle_weights(path: str) -> bool:
    """A directory with PyTorch pickle weights (.bin/.pt/.pth): never loaded, it can run code."""
    return any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path))


def _tensor_files(path: str) -> dict[str, str]:
    """Map tensor name -> safetensors file, from the index or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        for k, v in weight_map.items():
            if not isinstance(v, str) or os.path.basename(v) != v or v in ("", ".", ".."):
                raise ModelLoadError(f"{index}: weight_map names {json_repr(v)} for {k}; shards are file names "
                                     "in the model directory")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        if has_pickle_weights(path):
            raise ModelLoadError(f"{path}: only pickle weights found; hsd-jax loads safetensors "
                                 "only (pickle files can run code). Convert with save_pretrained("
                                 "..., safe_serialization=True)")
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return {k: single for k in open_safetensors(single).keys()}


def load_hf_dir(path: str, host: bool = False, **overrides) -> tuple[ModelConfig, dict]:
    """Config and params of a HF LLaMA/Qwen2/Qwen3/Mistral directory; EOS ids from config.json and
    generation_config.json (the tokenizer's are added by `api.load_target`)."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory not found: {path}")
    cfg = hf_config(read_json(os.path.join(path, "config.json")), path, **overrides)
    extra = tuple(i for i in generation_eos(path) if i not in cfg.eos_token_ids)
    if extra:
        cfg = cfg.replace(eos_token_ids=cfg.eos_token_ids + extra)
    files = _tensor_files(path)
    handles: dict = {}

    def get(name: str) -> np.ndarray:
        if name not in files:
            raise ModelLoadError(f"{path}: tensor {name} is missing from the safetensors files")
        fname = files[name]
        if fname not in handles:
            if not os.path.isfile(fname):
                raise ModelLoadError(f"missing shard: {fname}")
            handle = open_safetensors(fname)
            handles[fname] = handle, set(handle.keys())
        handle, names = handles[fname]
        if name not in names:
            raise ModelLoadError(f"{fname}: tensor {name} is missing (the index places it in this shard)")
        return read_tensor(handle, fname, name)

    return cfg, build_params(cfg, get, path, host)
