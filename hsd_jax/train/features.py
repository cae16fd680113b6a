"""Target features for training, computed once by prefill and cached as float16 `.npy` files.

Measured on the 2-core CPU: generating a token costs ~10x a prefill token, and a training
run reads every feature many times, so caching (1.15 KB per token for d=576) beats
recomputing in each step. One file per data shard, `<data dir name>/feat_XXXXX.npy`
[n, L_shard, d], with rows aligned to the shard's `tokens`. A drafter that fuses several
target layers (`feature_layers`) also gets `<data dir name>/aux-<layers>/aux_XXXXX.npy`
[n, L_shard, k, d]: those layers' outputs.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from hsd_jax.api import PROMPT_BUCKET, round_up
from hsd_jax.cache import init_cache
from hsd_jax.models import llama
from hsd_jax.train.data import read_shard, shard_paths


@functools.partial(jax.jit, static_argnames=("cfg",))
def _features(params, cfg, tokens):
    b, t = tokens.shape
    cache = init_cache(cfg.num_layers, b, cfg.num_kv_heads, t, cfg.head_dim, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = llama.forward(params, cfg, tokens, pos, cache)
    return out.features.astype(jnp.float16), jnp.moveaxis(out.aux_features, 0, 2).astype(jnp.float16)


def feature_path(cache_dir: str, shard: str) -> str:
    """`<cache_dir>/<data dir name>/feat_XXXXX.npy`: one cache folder serves several data dirs."""
    name = os.path.basename(shard).replace("shard_", "feat_").replace(".npz", ".npy")
    return os.path.join(cache_dir, os.path.basename(os.path.dirname(os.path.abspath(shard))), name)


def aux_path(cache_dir: str, shard: str, layers) -> str:
    """`<cache_dir>/<data dir name>/aux-<layers>/aux_XXXXX.npy`: the outputs of target `layers`."""
    name = os.path.basename(shard).replace("shard_", "aux_").replace(".npz", ".npy")
    folder = "aux-" + "-".join(str(int(i)) for i in layers)
    return os.path.join(os.path.dirname(feature_path(cache_dir, shard)), folder, name)


def _save(path: str, arr: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.save(path + ".tmp.npy", arr)
    os.replace(path + ".tmp.npy", path)


def build_feature_cache(target, data_dir: str, cache_dir: str, batch_size: int = 8, progress: bool = True,
                        feature_layers=()) -> None:
    """Prefill every shard's sequences through the target; skips shards already cached. With
    `feature_layers`, those layers' outputs are cached too. Multi-process: every process runs the
    prefill (the target may be sharded over all of them), process 0 alone writes, and all return
    once the cache is complete."""
    from tqdm import tqdm

    from hsd_jax import distributed
    from hsd_jax.sharding import fetch

    layers = tuple(int(i) for i in feature_layers)
    cfg = target.config.replace(feature_layers=layers)
    for shard in tqdm(shard_paths(data_dir), desc="target features", unit="shard", disable=not progress):
        out = feature_path(cache_dir, shard)
        aux_out = aux_path(cache_dir, shard, layers) if layers else None
        if distributed.agree(os.path.exists(out) and (aux_out is None or os.path.exists(aux_out))):
            continue
        tokens = read_shard(shard)[0]
        n, length = tokens.shape
        padded = np.zeros((n, round_up(length, PROMPT_BUCKET)), np.int32)
        padded[:, :length] = tokens
        feats = np.zeros((n, length, cfg.hidden_size), np.float16)
        aux = np.zeros((n, length, len(layers), cfg.hidden_size), np.float16)
        for i in range(0, n, batch_size):
            f, a = fetch(_features(target.params, cfg, padded[i: i + batch_size]))
            feats[i: i + batch_size] = f[:, :length]
            aux[i: i + batch_size] = a[:, :length]
        if distributed.is_primary():
            if not os.path.exists(out):
                _save(out, feats)
            if aux_out is not None:
                _save(aux_out, aux)
    distributed.barrier("feature_cache")
