"""Multi-device runs: a (data, model) device mesh, partition rules, sharded placement.

Layout (Megatron-style tensor parallelism over `model`, data parallelism over `data`):

- q/k/v/gate/up kernels [L, in, out] are column-sharded (heads and MLP hidden over `model`),
  o/down kernels [L, in, out] row-sharded; their biases follow the output dimension.
- token embeddings [V, d] and the LM head [d, V] are sharded over the vocabulary.
- norms (Qwen3's per-head q/k norms [L, D_h] too: every head shares them) and small drafter
  pieces (`fc`, additive `inject.w`) are replicated; the fused
  injection MLP is column/row sharded like an MLP.
- KV caches [L, B, H_kv, S, D_h] over batch (`data`) and KV heads (`model`); prompts, lengths
  and per-sequence loop state over `data`. Everything else is left to XLA's partitioner
  (GSPMD), which propagates these shardings through the jitted decode loop.

A dimension that does not divide by its mesh axis is replicated instead (the MLP hidden or
the vocab of an odd model); heads, KV heads and the batch must divide (`check_mesh`).

Multi-host (one mesh over the devices of several processes): `hsd_jax.distributed` starts the
processes; `put` and `fetch` below place and gather arrays whose shards live in other processes.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hsd_jax.config import ConfigError

DATA, MODEL = "data", "model"

# (regex over the "/"-joined parameter path, spec over the full array shape); first match wins.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"layers/(q_proj|k_proj|v_proj)/kernel$", P(None, None, MODEL)),
    (r"layers/(q_proj|k_proj|v_proj)/bias$", P(None, MODEL)),
    (r"layers/o_proj/kernel$", P(None, MODEL, None)),
    (r"layers/mlp/(gate_proj|up_proj)/kernel$", P(None, None, MODEL)),
    (r"layers/mlp/(gate_proj|up_proj)/bias$", P(None, MODEL)),
    (r"layers/mlp/down_proj/kernel$", P(None, MODEL, None)),
    (r"(^|/)embed_tokens/embedding$", P(MODEL, None)),
    (r"(^|/)lm_head/kernel$", P(None, MODEL)),
    (r"(^|/)midlayer/(q_proj|k_proj|v_proj)/kernel$", P(None, MODEL)),   # EAGLE-3's one layer (not stacked)
    (r"(^|/)midlayer/mlp/(gate_proj|up_proj)/kernel$", P(None, MODEL)),
    (r"(^|/)midlayer/(o_proj|mlp/down_proj)/kernel$", P(MODEL, None)),
    (r"(^|/)inject/w1$", P(None, MODEL)),
    (r"(^|/)inject/b1$", P(MODEL)),
    (r"(^|/)inject/w2$", P(MODEL, None)),
)
CACHE_SPEC = P(None, DATA, MODEL, None, None)   # KVCache.k / .v [L, B, H_kv, S, D_h]
BATCH_SPEC = P(DATA)                            # [B, ...] per-sequence inputs


def make_mesh(data: int = 1, model: int | None = None, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """A (data, model) mesh with Auto axes over the first data * model devices.

    `model=None` takes all remaining devices. Auto axes let `jax.jit` partition the
    existing (sharding-unaware) model code from the input shardings.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1:
        raise ConfigError(f"mesh data axis must be >= 1, got {data}")
    if model is None:
        if len(devices) % data:
            raise ConfigError(f"mesh data axis {data} does not divide the {len(devices)} available devices")
        model = len(devices) // data
    if model < 1:
        raise ConfigError(f"mesh model axis must be >= 1, got {model}")
    if data * model > len(devices):
        raise ConfigError(f"mesh {data}x{model} needs {data * model} devices, only {len(devices)} available "
                          f"({devices[0].platform})")
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * model])


def parse_mesh(spec: str) -> tuple[int, int]:
    """Parse a "DATAxMODEL" string (e.g. "2x4") into (data, model)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(spec))
    if not m:
        raise ConfigError(f"mesh must look like DATAxMODEL (e.g. 2x4), got {spec!r}")
    data, model = int(m.group(1)), int(m.group(2))
    if data < 1 or model < 1:
        raise ConfigError(f"mesh axes must be >= 1, got {spec!r}")
    return data, model


def axis_size(mesh, name: str) -> int:
    return dict(mesh.shape).get(name, 1)


def check_mesh(cfg, mesh, batch: int | None = None, what: str = "model") -> None:
    """Refuse a mesh whose `model` axis does not divide the (KV) heads, or `data` the batch."""
    model, data = axis_size(mesh, MODEL), axis_size(mesh, DATA)
    for name in ("num_heads", "num_kv_heads"):
        n = getattr(cfg, name)
        if n % model:
            raise ConfigError(f"mesh model axis {model} does not divide the {what}'s {name}={n}: "
                              f"pick a model axis that divides {n}")
    if batch is not None and batch % data:
        raise ConfigError(f"mesh data axis {data} does not divide the batch size {batch}: "
                          f"use a multiple of {data} prompts or a smaller data axis")


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def fit_spec(spec: P, shape: Sequence[int], mesh) -> P:
    """`spec` padded to the array's rank, with axes dropped where they do not divide the dimension."""
    if len(spec) > len(shape):
        return P()
    sizes = dict(mesh.shape)
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        n = int(np.prod([sizes.get(a, 1) for a in names])) if names else 1
        keep = names and all(a in sizes for a in names) and dim % n == 0
        out.append(axes if keep else None)
    return P(*out)


def param_specs(params, mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES):
    """PartitionSpec per parameter leaf from the first rule matching its path (replicated if none)."""
    def spec(path, x):
        name = _path_str(path)
        for pattern, s in rules:
            if re.search(pattern, name):
                return fit_spec(s, np.shape(x), mesh)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params, mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh, rules),
                        is_leaf=lambda s: isinstance(s, P))


def put(x, sharding: NamedSharding):
    """Place one array (host numpy or a jax array) into its shards; each device gets only its slice.

    Uses `make_array_from_callback` when some devices belong to other processes (multi-host),
    so every process materializes only its addressable slices.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):   # typed PRNG keys: place their raw data
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    return jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x[idx]))


def shard_params(params, mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES):
    """Params (host numpy, e.g. memory-mapped weights, or jax arrays) placed directly into their shards."""
    return jax.tree.map(put, params, param_shardings(params, mesh, rules))


def shard_batch(x, mesh):
    """A per-sequence array [B, ...] sharded over `data` (replicated if B does not divide)."""
    return put(x, NamedSharding(mesh, fit_spec(BATCH_SPEC, np.shape(x), mesh)))


def replicate(x, mesh):
    return put(x, NamedSharding(mesh, P()))


def use_mesh(mesh):
    """Context for tracing and running under `mesh` (a no-op context for None)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def constrain_cache(cache):
    """Pin a KV cache to (batch over `data`, KV heads over `model`) when tracing under a mesh; else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {DATA, MODEL} & set(mesh.axis_names):
        return cache
    kv = fit_spec(CACHE_SPEC, cache.k.shape, mesh)
    wsc = jax.lax.with_sharding_constraint
    return cache.replace(k=wsc(cache.k, kv), v=wsc(cache.v, kv),
                         lengths=wsc(cache.lengths, fit_spec(BATCH_SPEC, cache.lengths.shape, mesh)))


def fetch(tree):
    """Host numpy copy of a (possibly multi-host sharded) result pytree."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
